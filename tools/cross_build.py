"""Cross-builds rlx_torch._C for another Linux architecture (scripts/ci_arm64.sh: aarch64).

torch's cpp_extension can only build for the torch it runs in, so this compiles the same
sources with the same flags, taken from setup.py's `source_files` and `build_flags` for the
target machine, against the target's torch (an unpacked wheel) and Python headers:

    python tools/cross_build.py --cxx aarch64-linux-gnu-g++ --machine aarch64 \
        --torch build/arm64/site/torch --python-include build/arm64/sysroot/usr/include/python3.11 \
        --ext-suffix .cpython-311-aarch64-linux-gnu.so --out build/arm64/pkg/rlx_torch
"""

import argparse
import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_module():
    spec = importlib.util.spec_from_file_location("rlx_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: builds nothing
    return module


def _torch_version(torch_dir: str) -> str:
    text = open(os.path.join(torch_dir, "version.py")).read()
    return re.search(r"__version__\s*=\s*'([^']+)'", text).group(1)


def _openmp_runtime(torch_dir: str) -> str | None:
    """The libgomp a manylinux torch wheel bundles under a hashed soname (torch.libs/), which
    our kernels must share with torch; None when torch/lib holds a plain libgomp.so.1."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(torch_dir), "torch.libs",
                                          "libgomp*.so*")))
    return found[0] if found else None


def main(argv: list[str] | None = None) -> int:
    """Compiles and links; returns the exit status (0: built)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cxx", required=True, help="the cross compiler, e.g. aarch64-linux-gnu-g++")
    p.add_argument("--machine", required=True, help="platform.machine() of the target: aarch64")
    p.add_argument("--torch", required=True, help="the target's torch package folder")
    p.add_argument("--python-include", required=True, action="append", default=[])
    p.add_argument("--ext-suffix", required=True, help="the target's EXT_SUFFIX")
    p.add_argument("--out", required=True, help="folder for the built _C library")
    p.add_argument("--build-dir", default=None, help="object files (default: OUT/../obj)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--extra", default="", help="more compile flags, e.g. -Werror")
    p.add_argument("--compile-only", action="store_true",
                   help="a warnings check: compile every source, link nothing (with clang, "
                        "whose OpenMP runtime is not torch's)")
    args = p.parse_args(argv)

    rlx_setup = _setup_module()
    compiler = rlx_setup.compiler_family(args.cxx)
    srcs, _ = rlx_setup.source_files(ROOT, "linux", mps_built=False)
    torch_lib = os.path.join(args.torch, "lib")
    flags = rlx_setup.build_flags(
        "linux", args.machine, compiler, std=rlx_setup.cxx_standard(_torch_version(args.torch)),
        torch_openmp=True, use_mps=False, clang_openmp=args.compile_only)
    includes = [os.path.join(ROOT, "csrc", "include")]
    system_includes = [os.path.join(args.torch, "include"),
                       os.path.join(args.torch, "include", "torch", "csrc", "api", "include"),
                       *args.python_include]
    cflags = ["-fPIC", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
              *(f"-I{d}" for d in includes),
              *(a for d in system_includes for a in ("-isystem", d)),
              *flags["cxx"], *shlex.split(args.extra)]
    build_dir = args.build_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "obj")
    os.makedirs(build_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)

    def compile_one(src):
        obj = os.path.join(build_dir, src.replace(os.sep, "_") + ".o")
        command = [*shlex.split(args.cxx), *cflags, "-c", os.path.join(ROOT, src), "-o", obj]
        result = subprocess.run(command, capture_output=True, text=True)
        print(f"{args.cxx} -c {src}: {'ok' if result.returncode == 0 else 'FAILED'}", flush=True)
        if result.stderr:
            print(result.stderr, end="", file=sys.stderr, flush=True)
        return obj if result.returncode == 0 else None

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        objects = list(pool.map(compile_one, srcs))
    if None in objects:
        return 1
    if args.compile_only:
        print(f"compiled {len(objects)} sources", flush=True)
        return 0
    # torch's OpenMP runtime: a bundled libgomp with a hashed soname is linked by path, so that
    # the kernels share torch's threads; otherwise -fopenmp's libgomp.so.1 is torch's own.
    link = list(flags["link"])
    bundled = _openmp_runtime(args.torch)
    if bundled:
        link = [f for f in link if f != "-fopenmp"]
        link += [bundled, "-Wl,-rpath,$ORIGIN/../torch.libs"]
    out = os.path.join(args.out, "_C" + args.ext_suffix)
    command = [*shlex.split(args.cxx), "-shared", "-o", out, *objects, f"-L{torch_lib}",
               "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", *link,
               f"-Wl,-rpath-link,{torch_lib}",
               f"-Wl,-rpath-link,{os.path.join(os.path.dirname(args.torch), 'torch.libs')}"]
    result = subprocess.run(command)
    print(f"linked {out}" if result.returncode == 0 else "link FAILED", flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
