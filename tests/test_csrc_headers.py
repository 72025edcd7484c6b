"""Every C++ header under csrc/ compiles on its own: a translation unit that includes only that
header (twice, for the include guard) passes `-fsyntax-only` with the extension's own compile
flags (setup.py: standard, warnings, ISA flags) plus -Werror, against this torch's headers. A
header that leans on names its includer happened to define before it fails here.

The Objective-C++ header csrc/mps/mps_common.h is compiled with each .mm that includes it
(tests/test_metal_host_compile.py), and the CUDA headers (*.cuh) with each .cu by nvcc
(tests/test_cuda_compile.py); neither can compile as plain C++."""

import glob
import importlib.util
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
HEADERS = sorted(
    os.path.relpath(p, CSRC)
    for pattern in ("*.h", "cpu/*.h", "include/rlx/*.h")
    for p in glob.glob(os.path.join(CSRC, pattern))
)


def _load_setup():
    path = os.path.join(ROOT, "setup.py")
    spec = importlib.util.spec_from_file_location("rlx_setup_headers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, builds nothing
    return module


def _compile(command, header):
    source = f'#include "{header}"\n#include "{header}"\n'
    return subprocess.run([*command, f"-I{CSRC}", "-"], input=source, text=True,
                          capture_output=True, timeout=900)


@pytest.fixture(scope="module")
def results():
    """Every header's compile, run side by side on the machine's cores (each takes seconds
    of torch headers), by header."""
    ext = _load_setup()._extension()
    flags = [f for f in ext.extra_compile_args["cxx"] if f != "-fdiagnostics-color=always"]
    includes = [f"-I{d}" for d in ext.include_dirs] + [f"-isystem{d}" for d in include_paths()]
    command = [*os.environ.get("CXX", "c++").split(), "-fsyntax-only", "-x", "c++", *flags,
               "-Werror", *includes]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda h: _compile(command, h), HEADERS)
        return dict(zip(HEADERS, done, strict=True))


def test_the_headers_are_found():
    assert "cpu/gated_delta_common.h" in HEADERS and "include/rlx/gdn_checks.h" in HEADERS
    assert not any(h.endswith(".cuh") or h.startswith("mps/") for h in HEADERS)


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_on_its_own(results, header):
    result = results[header]
    assert result.returncode == 0, f"{header} does not compile on its own:\n{result.stderr}"
    assert "warning" not in result.stderr, result.stderr
