"""Builds rlx_torch._C with torch.utils.cpp_extension.

C++ sources under csrc/ (ops.cpp + csrc/cpu/) are always compiled. The Objective-C++
Metal host code (csrc/mps/*.mm) is added only on macOS when this torch was built with MPS;
the .metal kernel sources are embedded into a generated header either way (see
tools/embed_metal.py), so the host code and the Linux emulator tests read the same text.
"""

import glob
import os
import platform
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def _write_build_info():
    # Lets `import rlx_torch` explain a torch-version mismatch instead of an undefined symbol.
    path = os.path.join(ROOT, "rlx_torch", "_build_info.py")
    text = f'TORCH_VERSION = "{torch.__version__}"\n'
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def _sources():
    srcs = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    use_mps = sys.platform == "darwin" and torch.backends.mps.is_built()
    if use_mps:
        srcs += sorted(glob.glob("csrc/mps/*.mm"))
    return srcs, use_mps


def _extension():
    srcs, use_mps = _sources()
    debug = os.getenv("DEBUG", "0") == "1"
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    # Python's own flags (sysconfig CFLAGS) bring -fwrapv, which CPython needs and these
    # kernels do not: with it, signed index arithmetic may wrap, and GCC's loop optimizations
    # lose ground (gated delta backward 3-5% slower, in-process A/B on the 2-core EPYC).
    cxx += ["-fno-wrapv"]
    cxx += ["-Wall", "-Wextra", "-Wno-unused-parameter", "-fdiagnostics-color=always"]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    extra_link = []
    if use_mps:
        import embed_metal

        include_dirs.append(embed_metal.generate(ROOT))
        extra_link += ["-framework", "Metal", "-framework", "Foundation"]
    if platform.machine() in ("x86_64", "AMD64"):
        # AVX2/FMA: every x86-64 CPU since Haswell (2013). RLX_AVX2=0 builds for older ones.
        cxx += ["-mavx2", "-mfma"] if os.getenv("RLX_AVX2", "1") == "1" else []
        # Loops start on 32-byte boundaries: the gated delta backward's hottest loop ran
        # 4-6% slower when it happened to start 16 bytes into a 64-byte line (in-process A/B
        # on the 2-core EPYC), and any edit elsewhere in the file moved it there or back.
        cxx += ["-falign-loops=32"]
    if os.getenv("RLX_SANITIZE", "0") == "1":
        # AddressSanitizer + UndefinedBehaviorSanitizer (scripts/sanitize.sh builds this into
        # its own directory and runs the C++-heavy tests with libasan preloaded); UB aborts.
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
               "-fno-omit-frame-pointer"]
        cxx = [f for f in cxx if f != "-O3"] + ["-O1", "-g"] + san
        extra_link += san
    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is header-inlined `#pragma omp parallel`: without -fopenmp every
        # kernel of ours silently runs on one thread.
        cxx.append("-fopenmp")
        extra_link.append("-fopenmp")
    return CppExtension(
        "rlx_torch._C",
        srcs,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx},
        extra_link_args=extra_link,
    )


_write_build_info()
setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
