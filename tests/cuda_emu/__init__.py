"""Builds the CPU emulations of the CUDA kernels (tests/cuda_emu/*_emu_main.cpp): the kernels'
device code compiled with the host compiler against cuda_shim.h."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")


def build_emulator(out_dir, main: str) -> str:
    """Compiles tests/cuda_emu/<main>.cpp into out_dir (warnings are errors); returns the
    executable's path. Skips the calling test when there is no C++ compiler."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    exe = os.path.join(str(out_dir), main)
    cmd = [CXX, "-std=c++20", "-O1", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-Wno-unknown-pragmas", "-Werror", f"-I{ROOT}/csrc/include", f"-I{ROOT}/csrc/cuda",
           os.path.join(ROOT, "tests", "cuda_emu", f"{main}.cpp"), "-o", exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe
