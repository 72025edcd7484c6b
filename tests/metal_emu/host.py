"""The Metal host code (csrc/mps/*.mm) on Linux: built with clang and GNU's Objective-C runtime
against the mock Metal runtime, the mock of PyTorch's MPS stream and the mock MPS device in
mock/, with every dispatch run by the emulator. After `load()`, MPS tensors exist in this
process (`torch.empty(3, device="mps")`) and `torch.ops.rlx.*` on them runs the real host code.

    from tests.metal_emu import host
    rt = host.load()          # builds once (cached in build/metal_emu/host-*), then dlopens
    rt.set_torch_mode(205)    # get_command_buffer() as in torch 2.5-2.8 (209: as in 2.9+)
    rt.set_max_threads(64)    # maxTotalThreadsPerThreadgroup of pipelines built from now on
    rt.counters()             # commits, dispatches, encoders, autoreleased_without_pool, ...

Needs clang++, libobjc (gcc's, package libobjc-12-dev) and libBlocksRuntime
(libblocksruntime-dev); `missing_tools()` says which are absent.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from . import BUILD, HERE, ORDERS, REPO, load_source

MOCK = HERE / "mock"
STUBS = HERE / "objc_stubs"
CLANG = os.environ.get("RLX_CLANGXX", "clang++")
COUNTERS = ("commits", "user_commits", "dispatches", "encoders_created",
            "autoreleased_without_pool", "violations")
_lock = threading.Lock()
_runtime = None


def _gcc_file(name):
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    out = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True)
    path = out.stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _objc_include():
    runtime_h = _gcc_file("include/objc/runtime.h")
    return os.path.dirname(os.path.dirname(runtime_h)) if runtime_h else None


def _libobjc():
    return _gcc_file("libobjc.so")


def _blocks_runtime():
    dirs = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib",
            "/usr/local/lib")
    for d in dirs:
        if os.path.exists(os.path.join(d, "libBlocksRuntime.so")):
            return d
    return None


def missing_tools():
    """The tools the build needs that are not installed (an empty list when all are)."""
    missing = []
    if shutil.which(CLANG) is None:
        missing.append("clang++ (apt: clang)")
    if _libobjc() is None:
        missing.append("libobjc (apt: libobjc-12-dev)")
    if _blocks_runtime() is None:
        missing.append("libBlocksRuntime (apt: libblocksruntime-dev)")
    return missing


def _sources():
    mm = sorted((REPO / "csrc" / "mps").glob("*.mm"))
    return mm + [MOCK / "mock_metal.mm", MOCK / "mock_torch_mps.mm", MOCK / "mock_mps_backend.cpp"]


def _build():
    import torch

    sys.path.insert(0, str(REPO / "tools"))
    import embed_metal

    torch_dir = Path(torch.__file__).parent
    generated = embed_metal.generate(str(REPO), str(BUILD / "host-generated"))
    common = [
        "-std=c++17", "-fPIC", "-O1", "-g0", "-fexceptions",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"-I{REPO / 'csrc' / 'include'}", f"-I{generated}", f"-I{REPO / 'csrc' / 'mps'}",
        "-isystem", str(torch_dir / "include"),
        "-isystem", str(torch_dir / "include" / "torch" / "csrc" / "api" / "include"),
    ]
    objc = ["-x", "objective-c++", "-fblocks", "-fobjc-runtime=gcc", "-fno-objc-exceptions",
            f"-I{STUBS}",
            "-isystem", _objc_include(), "-Wno-objc-root-class"]
    headers = hashlib.sha256(" ".join([CLANG, *common, *objc, torch.__version__]).encode())
    deps = sorted(STUBS.rglob("*.h")) + sorted(MOCK.glob("*.h"))
    deps += sorted((REPO / "csrc" / "include").rglob("*.h"))
    deps += sorted((REPO / "csrc" / "mps").glob("*.h"))
    deps.append(Path(generated) / "rlx" / "mps_kernels_embedded.h")
    for d in deps:
        headers.update(str(d.name).encode() + d.read_bytes())
    BUILD.mkdir(parents=True, exist_ok=True)
    objects = []
    whole = hashlib.sha256(headers.digest())
    for src in _sources():  # one cached object per source: a change rebuilds only its file
        key = hashlib.sha256(headers.digest() + src.read_bytes()).hexdigest()[:16]
        obj = BUILD / f"host-{src.stem}-{key}.o"
        whole.update(key.encode())
        if not obj.exists():
            lang = objc if src.suffix == ".mm" else ["-x", "c++"]
            fd, tmp_obj = tempfile.mkstemp(suffix=".o", dir=BUILD)
            os.close(fd)
            cmd = [CLANG, "-c", *common, *lang, str(src), "-o", tmp_obj]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                os.unlink(tmp_obj)
                raise RuntimeError(f"building {src.name} for the mock runtime failed:\n"
                                   f"{' '.join(cmd)}\n{proc.stderr[-8000:]}")
            os.replace(tmp_obj, obj)
        objects.append(str(obj))
    out = BUILD / f"host-{whole.hexdigest()[:16]}.so"
    if out.exists():
        return out
    tmp = Path(tempfile.mkdtemp(dir=BUILD, prefix="host-build-"))
    so_tmp = tmp / "host.so"
    link = [CLANG, "-shared", "-o", str(so_tmp), *objects,
            f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}",
            _libobjc(), f"-L{_blocks_runtime()}", "-lBlocksRuntime",
            # our torch::mps mock wins over libtorch's (non-MPS) definitions of those symbols
            "-Wl,-Bsymbolic"]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking the mock host library failed:\n{proc.stderr[-8000:]}")
    os.replace(so_tmp, out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


_COMPILE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_size_t)


def _write(out, size, text):
    data = text.encode()[: size - 1] + b"\0"
    ctypes.memmove(out, data, len(data))


def _compile_library(source, metal_version, out, size):
    """newLibraryWithSource: the embedded text through the emulator's translator and g++."""
    try:
        text = source.decode()
        name = "embedded_" + hashlib.sha256(text.encode()).hexdigest()[:12]
        lib = load_source(text, name, metal_version=metal_version)
        _write(out, size, "\n".join([lib.so_path, *lib.kernels]))
        return 0
    except Exception as e:  # reported as the NSError of newLibraryWithSource
        _write(out, size, f"{type(e).__name__}: {e}")
        return 1


class Runtime:
    """Controls of the mock runtime (see the module docstring)."""

    def __init__(self, path):
        self.path = path
        self.dll = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        self._compile = _COMPILE_FN(_compile_library)  # kept alive with the runtime
        self.dll.rlx_mock_set_compiler(self._compile)
        self.dll.rlx_mock_live_objects.restype = ctypes.c_long
        self.dll.rlx_mock_install_backend()
        self.configure()

    def configure(self, order="shuffle", seed=0, timeout=None):
        """Emulator settings of every dispatch from now on (see metal_emu.MetalLibrary.run)."""
        from . import DEFAULT_TIMEOUT

        t = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        self.dll.rlx_mock_configure(ORDERS[order], ctypes.c_uint64(seed), ctypes.c_double(t))

    def set_torch_mode(self, version):
        """205: torch::mps::get_command_buffer() as in torch 2.5-2.8; 209: as from 2.9."""
        self.dll.rlx_mock_set_torch_mode(int(version))

    def set_max_threads(self, n, kernel=""):
        """maxTotalThreadsPerThreadgroup of pipelines built from now on (of one kernel)."""
        self.dll.rlx_mock_set_max_threads(kernel.encode(), ctypes.c_uint32(n))

    def clear_max_threads(self):
        self.dll.rlx_mock_clear_max_threads()

    def reset(self):
        """Ends PyTorch's encoder, commits, and zeroes the counters."""
        self.dll.rlx_mock_reset()

    def counters(self):
        arr = (ctypes.c_uint64 * len(COUNTERS))()
        self.dll.rlx_mock_counters(arr)
        return dict(zip(COUNTERS, arr, strict=True))

    def coalescing_open(self):
        """Whether PyTorch's coalesced compute encoder is open now."""
        return bool(self.dll.rlx_mock_coalescing_open())

    def pytorch_kernel(self):
        """What any PyTorch Metal kernel does to the stream: leaves its encoder open."""
        self.dll.rlx_mock_pytorch_kernel()

    def encode_on_own_encoder(self):
        """The pre-2.9 custom-kernel pattern (get_command_buffer + a new encoder): None, or
        the error the mock raised."""
        err = ctypes.create_string_buffer(4096)
        rc = self.dll.rlx_mock_encode_on_own_encoder(err, len(err))
        return err.value.decode() if rc else None

    def compile_record(self):
        """Options the last newLibraryWithSource got."""
        lang, lang_set = ctypes.c_uint64(), ctypes.c_int()
        math, fp, libs = ctypes.c_long(), ctypes.c_long(), ctypes.c_int()
        self.dll.rlx_mock_compile_record(ctypes.byref(lang), ctypes.byref(lang_set),
                                         ctypes.byref(math), ctypes.byref(fp), ctypes.byref(libs))
        return {"language_version": lang.value, "language_version_set": bool(lang_set.value),
                "math_mode": math.value, "fp_functions": fp.value, "libraries": libs.value}

    def live_objects(self):
        return self.dll.rlx_mock_live_objects()

    def last_violation(self):
        buf = ctypes.create_string_buffer(4096)
        self.dll.rlx_mock_last_violation(buf, len(buf))
        return buf.value.decode()


def load():
    """Builds (once) and loads the host code on the mock runtime; returns its Runtime."""
    global _runtime
    with _lock:
        if _runtime is None:
            import rlx_torch  # noqa: F401  (the rlx schemas must exist before the MPS kernels)

            _runtime = Runtime(_build())
        return _runtime
