"""Builds the CPU emulations of the CUDA kernels (tests/cuda_emu/*_emu_main.cpp): the kernels'
device code compiled with the host compiler against cuda_shim.h."""

import os
import shutil
import subprocess

import pytest
import torch

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


def dump(t, path):
    """Writes tensor t to path as raw bytes in its own dtype (float16 / bfloat16 as their
    16-bit patterns), as the emulation mains read it."""
    t = t.contiguous()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    t.numpy().tofile(str(path))


def build_mutant(out_dir, main: str, header: str, old: str, new: str) -> str:
    """Compiles tests/cuda_emu/<main>.cpp against a broken copy of csrc/cuda/<header>, with the
    one occurrence of `old` replaced by `new`; returns the executable's path. The copy's
    directory comes first on the include path, so it is found before csrc/cuda's. Skips the
    calling test when there is no C++ compiler."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    text = open(os.path.join(ROOT, "csrc", "cuda", header)).read()
    assert text.count(old) == 1, f"{header}: {old!r} must occur once"
    with open(os.path.join(str(out_dir), header), "w") as f:
        f.write(text.replace(old, new))
    exe = os.path.join(str(out_dir), "mutant")
    cmd = [CXX, "-std=c++20", "-O0", "-pthread", f"-I{out_dir}", f"-I{ROOT}/csrc/include",
           f"-I{ROOT}/csrc/cuda", os.path.join(ROOT, "tests", "cuda_emu", f"{main}.cpp"), "-o",
           exe]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe
