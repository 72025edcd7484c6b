"""Compile check of the CUDA kernels without a GPU: every csrc/cuda/*.cu must compile with nvcc
(device code for sm_80 and sm_90, host code through the host compiler) against the installed
torch's headers, with no error and no warning. A CPU-only torch wheel ships the c10/cuda and
ATen headers but not the generated cuda_cmake_macros.h, hence C10_CUDA_NO_CMAKE_CONFIGURE_FILE;
the kernels include c10/cuda/*.h only (ATen/cuda/CUDAContext.h would need cuSPARSE's headers).
This proves the kernels are well-formed for both architectures; their results are checked by
tests/test_codebook_cuda.py on a machine with a GPU.

nvcc comes from the CUDA toolkit. Without it the test fails in CI (CI=true) and skips locally."""

import glob
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
NVCC = shutil.which(os.environ.get("RLX_NVCC", "nvcc")) or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
)


def _require_nvcc():
    if NVCC is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("nvcc (CUDA toolkit) is required in CI for the CUDA compile check")
        pytest.skip("nvcc not installed")


def _command(path, out):
    torch_dir = os.path.dirname(torch.__file__)
    return [
        NVCC, "-c", path, "-o", out, "-std=c++17", "-O1",
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", "-DTORCH_EXTENSION_NAME=_C",
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        "-Werror", "all-warnings",
        "-Xcompiler", "-Wall,-Wextra,-Wno-unused-parameter,-Werror",
        f"-I{os.path.join(ROOT, 'csrc', 'include')}",
        "-isystem", os.path.join(torch_dir, "include"),
        "-isystem", os.path.join(torch_dir, "include", "torch", "csrc", "api", "include"),
        "-isystem", sysconfig.get_paths()["include"],
    ]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compiles every .cu file at once (one process per file); returns path -> (rc, output).

    Each compiler writes to its own log file, not a pipe: a pipe left unread while another
    process is waited for fills up (64 KiB of diagnostics) and stalls its compiler for good."""
    _require_nvcc()
    out_dir = tmp_path_factory.mktemp("cuda_objects")
    procs = {}
    for path in CU_FILES:
        name = os.path.basename(path)
        with open(out_dir / (name + ".log"), "w") as log:
            procs[path] = subprocess.Popen(_command(path, str(out_dir / (name + ".o"))),
                                           stdout=log, stderr=subprocess.STDOUT)
    results = {}
    for path, p in procs.items():
        rc = p.wait()
        results[path] = (rc, (out_dir / (os.path.basename(path) + ".log")).read_text())
    return results


def test_there_are_cuda_sources():
    assert CU_FILES, "csrc/cuda/*.cu not found"


@pytest.mark.parametrize("path", CU_FILES, ids=os.path.basename)
def test_cu_compiles_without_warnings(path, compiled):
    rc, output = compiled[path]
    assert rc == 0 and not output.strip(), output[-8000:]


def test_check_rejects_a_warning(tmp_path):
    _require_nvcc()
    src = tmp_path / "warn.cu"
    src.write_text(
        "__global__ void k(float* out) {\n"
        "  int unused = 3;\n"
        "  out[threadIdx.x] = 1.0f;\n"
        "}\n"
    )
    proc = subprocess.run(_command(str(src), str(tmp_path / "warn.o")), capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "unused" in (proc.stdout + proc.stderr)
    src.write_text(src.read_text().replace("  int unused = 3;\n", ""))
    proc = subprocess.run(_command(str(src), str(tmp_path / "warn.o")), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
