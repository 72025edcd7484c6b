"""Builds rlx_torch._C with torch.utils.cpp_extension.

C++ sources under csrc/ (ops.cpp + csrc/cpu/) are always compiled, for the architecture's
baseline (plain x86-64, plain arm64): the CPU kernels' AVX2+FMA copies (csrc/cpu/avx2/, see
csrc/cpu/cpu_isa.h) are chosen at run time, so a wheel runs on any CPU of its architecture.
The CUDA kernels (csrc/cuda/*.cu) are added, through CUDAExtension, when this torch was built
with CUDA and nvcc is found (RLX_CUDA=0 leaves them out). The Objective-C++
Metal host code (csrc/mps/*.mm) is added only on macOS when this torch was built with MPS;
the .metal kernel sources are embedded into a generated header either way (see
tools/embed_metal.py), so the host code and the Linux emulator tests read the same text.

The per-platform choices (sources, compile flags, link flags) are pure functions of the
platform, the compiler and torch's configuration (`source_files`, `build_flags`), so that
tests/test_setup_flags.py can check the macOS arm64 build from Linux.
"""

import glob
import os
import platform
import re
import subprocess
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    include_paths,
)

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def arm64_only(config_vars: dict, machine: str) -> dict:
    """Rewrites Python's build flags (distutils' config vars, in place) for macOS: arm64 only.

    A universal2 Python's CFLAGS/LDFLAGS/LDSHARED carry ``-arch arm64 -arch x86_64``; the
    x86_64 slice cannot link against the arm64-only libtorch. (distutils' own $ARCHFLAGS
    rewrite misses an ``-arch`` at the very end of a value.)

    >>> arm64_only({"LDFLAGS": "-arch arm64 -arch x86_64", "CC": "clang"}, "arm64")["LDFLAGS"]
    '-arch arm64'
    """
    if machine != "arm64":
        raise SystemExit(
            f"rlx_torch builds on macOS for Apple silicon (arm64) only, but this Python runs as "
            f"{machine} (under Rosetta?); use an arm64 Python (torch has no x86_64 macOS wheels "
            f"since 2.3)")
    for key, value in config_vars.items():
        if isinstance(value, str) and re.search(r"-arch\s", value):
            rest = re.sub(r"\s*-arch\s+\S+", "", value).strip()
            config_vars[key] = f"{rest} -arch arm64".strip()
    return config_vars


if sys.platform == "darwin":
    from distutils import sysconfig as _distutils_sysconfig  # setuptools' copy, as build_ext's

    # The cached dict that the compiler and linker commands are made from, before any is made.
    arm64_only(_distutils_sysconfig.get_config_vars(), platform.machine())


def _write_build_info():
    # Lets `import rlx_torch` explain a torch-version mismatch instead of an undefined symbol.
    path = os.path.join(ROOT, "rlx_torch", "_build_info.py")
    text = f'TORCH_VERSION = "{torch.__version__}"\n'
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def source_files(root: str, system: str, mps_built: bool) -> tuple[list[str], bool]:
    """The sources to compile (relative to root) and whether the Metal host code is among them.

    >>> source_files(".", "linux", mps_built=False)[1]
    False
    """
    def rel(pattern):
        return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern)))

    # csrc/cpu/avx2/, avx512/: the kernels' AVX2 and AVX-512 copies (empty off x86-64)
    srcs = rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp") + rel("csrc/cpu/avx2/*.cpp")
    srcs += rel("csrc/cpu/avx512/*.cpp")
    use_mps = system == "darwin" and mps_built
    if use_mps:
        srcs += rel("csrc/mps/*.mm")
    return srcs, use_mps


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's cpp_extension builds with: C++17 before torch 2.10, C++20 from
    it. The sources stay C++17 (the oldest supported torch); RLX_CXX_STD overrides.

    >>> cxx_standard("2.9.1"), cxx_standard("2.13.0+cpu")
    ('c++17', 'c++20')
    """
    major, minor = (int(p) for p in torch_version.split("+")[0].split(".")[:2])
    return "c++17" if (major, minor) < (2, 10) else "c++20"


def compiler_family(cxx: str) -> str:
    """'clang' or 'gcc', from `cxx --version` (Apple's c++ is clang)."""
    try:
        out = subprocess.run([*cxx.split(), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "gcc"
    return "clang" if "clang" in out.lower() else "gcc"


LINUX_CLANG_OPENMP = (
    "On Linux torch's OpenMP runtime is GCC's libgomp, while clang's -fopenmp runs our kernels "
    "in LLVM's libomp beside it, which ignores torch.set_num_threads. Build with GCC on Linux "
    "(CC=gcc CXX=g++), or set RLX_CLANG_OPENMP=1 to build with libomp anyway (compile checks).")


def build_flags(system: str, machine: str, compiler: str, *, std: str, torch_openmp: bool,
                use_mps: bool, debug: bool = False, clang_openmp: bool = False,
                sanitize: bool = False) -> dict[str, list[str]]:
    """Compile ("cxx") and link ("link") arguments for one platform.

    system: sys.platform ("linux", "darwin"); machine: platform.machine(); compiler: "gcc" or
    "clang"; torch_openmp: torch's ATen parallel backend is OpenMP.

    >>> f = build_flags("darwin", "arm64", "clang", std="c++17", torch_openmp=True, use_mps=True)
    >>> "-Xpreprocessor" in f["cxx"] and "-mavx2" not in f["cxx"]
    True
    """
    cxx = [f"-std={std}"]
    # Release builds carry no debug info (Python's sysconfig CFLAGS bring -g, which made the
    # .so about 8x its code size); DEBUG=1 builds keep it.
    cxx += ["-O0", "-g"] if debug else ["-O3", "-g0"]
    # (No -fno-wrapv against the -fwrapv in Python's CFLAGS and no -falign-loops=32: neither
    # changed the gated delta or codebook benchmarks beyond their run-to-run spread in an A/B
    # of builds with and without them.)
    # ninja captures the compiler's output, so the compiler sees no terminal: keep its colors.
    cxx += ["-Wall", "-Wextra", "-Wno-unused-parameter", "-fdiagnostics-color=always"]
    link = []
    if use_mps:
        link += ["-framework", "Metal", "-framework", "Foundation"]
    # No -mavx2/-march: the baseline stays portable; AVX2 code lives only in the target
    # regions of the kernels' AVX2 copies (csrc/cpu/cpu_isa.h).
    if sanitize:
        # AddressSanitizer + UndefinedBehaviorSanitizer (scripts/sanitize.sh builds this into
        # its own directory and runs the C++-heavy tests with libasan preloaded); UB aborts.
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
               "-fno-omit-frame-pointer"]
        cxx = [f for f in cxx if f not in ("-O3", "-g0")] + ["-O1", "-g"] + san
        link += san
    if not torch_openmp:
        return {"cxx": cxx, "link": link}
    # at::parallel_for is header-inlined `#pragma omp parallel`: without OpenMP every kernel
    # of ours silently runs on one thread.
    if system == "darwin":
        # Apple's clang has no OpenMP driver support, but torch's macOS wheels ship LLVM's
        # libomp.dylib (torch/lib) and omp.h (torch/include). Compile the pragmas, and bind the
        # OpenMP calls at load time to the libomp that libtorch_cpu has already loaded: linking
        # -lomp would record libomp's install name, which is @rpath/libomp.dylib up to torch
        # 2.11 but /opt/llvm-openmp/lib/libomp.dylib (a path on torch's build machine) in 2.13,
        # and a second copy of the runtime must never be loaded beside torch's.
        cxx += ["-Xpreprocessor", "-fopenmp"]
        link += ["-Wl,-undefined,dynamic_lookup"]
    elif system.startswith("linux"):
        if compiler == "clang" and not clang_openmp:
            raise SystemExit(LINUX_CLANG_OPENMP)
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    return {"cxx": cxx, "link": link}


PCH_HEADER = os.path.join("csrc", "cpu", "torch_headers.h")


def pch_flags(compiler: str, system: str, pch_path: str | None) -> list[str]:
    """The flags that make every C++ file start from the precompiled torch headers
    (csrc/cpu/torch_headers.h), or none: GCC on Linux only (clang's -include-pch takes a
    different file format and flag; those builds parse the headers in each file as before),
    and only once the precompiled header was built (pch_path, the header's copy beside it).

    >>> pch_flags("gcc", "linux", "/b/pch/torch_headers.h")
    ['-include', '/b/pch/torch_headers.h', '-Winvalid-pch']
    >>> pch_flags("clang", "darwin", "/b/pch/torch_headers.h")
    []
    """
    if compiler != "gcc" or not system.startswith("linux") or not pch_path:
        return []
    # -Winvalid-pch: a precompiled header that no longer matches the flags says so (the build
    # then parses the header as usual and stays correct).
    return ["-include", pch_path, "-Winvalid-pch"]


def _build_pch(cmd: list[str], header: str, out_dir: str) -> str | None:
    """Precompiles header with the compile command cmd (every flag a source gets, no source)
    into out_dir, unless the copy there was built by the same command; returns the path of the
    header's copy beside its .gch, or None when the compiler fails (the build goes on without)."""
    os.makedirs(out_dir, exist_ok=True)
    copy = os.path.join(out_dir, os.path.basename(header))
    gch, stamp = copy + ".gch", copy + ".cmd"
    text = open(header).read()
    signature = "\n".join(cmd) + "\n" + text
    if os.path.exists(gch) and os.path.exists(stamp) and open(stamp).read() == signature:
        return copy
    with open(copy, "w") as f:
        f.write(text)
    print(f"precompiling {header} (the torch headers every C++ file includes)", flush=True)
    result = subprocess.run([*cmd, "-x", "c++-header", copy, "-o", gch])
    if result.returncode != 0:
        print(f"warning: precompiling {header} failed; compiling without it", flush=True)
        return None
    with open(stamp, "w") as f:
        f.write(signature)
    return copy


class _BuildExtension(BuildExtension):
    """torch's BuildExtension (ninja), plus the precompiled torch headers on GCC (pch_flags)."""

    def build_extension(self, ext):
        ninja_compile = self.compiler.compile  # BuildExtension's ninja wrapper
        family = compiler_family(os.environ.get("CXX", "c++"))
        if (os.getenv("RLX_PCH", "1") == "0" or not pch_flags(family, sys.platform, "-")
                or not isinstance(ext.extra_compile_args, dict)):
            return super().build_extension(ext)

        def compile_with_pch(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                             extra_preargs=None, extra_postargs=None, depends=None):
            # The command BuildExtension's ninja rule runs for a C++ source, less -c/-o: the
            # precompiled header is used only where every flag matches.
            _, _, _, pp_opts, _ = self.compiler._setup_compile(
                output_dir, macros, include_dirs, [], depends, extra_postargs)
            cflags = self.compiler.compiler_so[1:] + self.compiler._get_cc_args(
                pp_opts, debug, extra_preargs)
            post = list(extra_postargs["cxx"])
            cmd = [*os.environ.get("CXX", "c++").split(), *cflags, *post]
            pch = _build_pch(cmd, os.path.join(ROOT, PCH_HEADER),
                             os.path.join(os.path.abspath(output_dir), "pch"))
            postargs = dict(extra_postargs, cxx=post + pch_flags(family, sys.platform, pch))
            return ninja_compile(sources, output_dir, macros, include_dirs, debug,
                                 extra_preargs, postargs, depends)

        self.compiler.compile = compile_with_pch
        try:
            return super().build_extension(ext)
        finally:
            self.compiler.compile = ninja_compile


def _use_cuda() -> bool:
    if os.getenv("RLX_CUDA", "1") == "0" or torch.version.cuda is None or CUDA_HOME is None:
        return False
    return os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))


def _extension():
    srcs, use_mps = source_files(ROOT, sys.platform,
                                 sys.platform == "darwin" and torch.backends.mps.is_built())
    cxx_cmd = os.environ.get("CXX", "c++")
    torch_openmp = "OpenMP" in torch.__config__.parallel_info()
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    if sys.platform == "darwin" and torch_openmp and not os.path.exists(f"{torch_include}/omp.h"):
        raise SystemExit(f"this torch uses OpenMP but ships no omp.h in {torch_include}")
    flags = build_flags(
        sys.platform, platform.machine(), compiler_family(cxx_cmd),
        std=os.getenv("RLX_CXX_STD") or cxx_standard(torch.__version__),
        torch_openmp=torch_openmp, use_mps=use_mps,
        debug=os.getenv("DEBUG", "0") == "1",
        clang_openmp=os.getenv("RLX_CLANG_OPENMP", "0") == "1",
        sanitize=os.getenv("RLX_SANITIZE", "0") == "1")
    # torch's include directories as system directories (BuildExtension passes them with -I):
    # warnings raised inside torch's own templates (e.g. -Wsign-compare in c10's overflow
    # checks, instantiated by every file) are not this project's, and -I would print them.
    flags["cxx"] += [f"-isystem{d}" for d in include_paths()]
    include_dirs = [os.path.join(ROOT, "csrc", "include")]
    if use_mps:
        import embed_metal

        include_dirs.append(embed_metal.generate(ROOT))
    if _use_cuda():
        debug = os.getenv("DEBUG", "0") == "1"
        nvcc = ["-O0", "-g", "-G"] if debug else ["-O3", "-lineinfo"]
        nvcc += ["-std=c++17", "-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter"]
        return CUDAExtension(
            "rlx_torch._C",
            srcs + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": flags["cxx"], "nvcc": nvcc},
            extra_link_args=flags["link"],
        )
    return CppExtension(
        "rlx_torch._C",
        srcs,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": flags["cxx"]},
        extra_link_args=flags["link"],
    )


if __name__ == "__main__":  # setuptools runs this file as __main__ (setup.py and PEP 517 alike)
    _write_build_info()
    setup(
        ext_modules=[_extension()],
        cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
    )
