"""Every .metal file compiles as C++14 with -pedantic-errors against a minimal MSL prelude
(tests/metal_emu/cxx14/metal_prelude.h), once as Metal 3.0 (`__METAL_VERSION__` 300: no
bfloat) and once as Metal 3.1 (310). MSL is based on C++14; the emulator's shim is C++20 and
would accept later constructs that Apple's compiler rejects. The [[...]] attributes are
stripped first (line numbers are kept), the address spaces are macros of the prelude. Each
file is compiled as it is embedded for Metal (tools/embed_metal.py: its shared headers, such as
the params structs, inlined)."""

import glob
import os
import re
import shutil
import subprocess

import pytest

from tests.metal_emu.translate import blank_comments, embed_metal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELUDE = os.path.join(ROOT, "tests", "metal_emu", "cxx14", "metal_prelude.h")
METAL_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "mps", "kernels", "*.metal")))
CXX = shutil.which(os.environ.get("CXX_EMU", "g++"))


def as_cxx14(src):
    """The .metal text as C++ for the prelude: attributes and the metal_stdlib include
    blanked, everything else (and every line break) kept."""
    code = blank_comments(src)
    code = re.sub(r"^[ \t]*#[ \t]*include[ \t]*<metal_stdlib>", lambda m: " " * len(m.group()),
                  code, flags=re.M)
    return re.sub(r"\[\[.*?\]\]", lambda m: " " * len(m.group()), code, flags=re.S)


def compile_cxx14(src, metal_version, tmp_path, name="kernels"):
    path = tmp_path / f"{name}_{metal_version}.cpp"
    path.write_text(as_cxx14(src))
    cmd = [CXX, "-std=c++14", "-pedantic-errors", "-fsyntax-only", "-x", "c++",
           f"-D__METAL_VERSION__={metal_version}", "-include", PRELUDE, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("metal_version", [300, 310])
@pytest.mark.parametrize("path", METAL_FILES, ids=os.path.basename)
def test_metal_file_is_cxx14(path, metal_version, tmp_path):
    proc = compile_cxx14(embed_metal.read_kernel(path, ROOT), metal_version, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]


GOOD = """#include <metal_stdlib>
using namespace metal;
template <typename T>
kernel void k(device T* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = T(precise::exp(float(x[i])));
}
template [[host_name("k_f32")]] [[kernel]] decltype(k<float>) k<float>;
#if __METAL_VERSION__ >= 310
template [[host_name("k_bf16")]] [[kernel]] decltype(k<bfloat>) k<bfloat>;
#endif
"""


def test_prelude_accepts_msl_and_rejects_later_cxx(tmp_path):
    for v in (300, 310):
        assert compile_cxx14(GOOD, v, tmp_path, "good").returncode == 0
    cxx17 = GOOD.replace("x[i] = T(", "if constexpr (true) x[i] = T(")
    proc = compile_cxx14(cxx17, 310, tmp_path, "cxx17")
    assert proc.returncode != 0 and "constexpr" in proc.stderr
    # bfloat outside the `#if __METAL_VERSION__ >= 310` guard fails for Metal 3.0 only
    unguarded = GOOD.replace("#if __METAL_VERSION__ >= 310\n", "").replace("#endif\n", "")
    assert compile_cxx14(unguarded, 310, tmp_path, "unguarded").returncode == 0
    assert compile_cxx14(unguarded, 300, tmp_path, "unguarded").returncode != 0
