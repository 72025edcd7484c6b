"""Runs Metal kernels (.metal files) on the CPU, with real threadgroup/simdgroup semantics.

    from tests.metal_emu import load, Plan
    lib = load("csrc/mps/kernels/codebook.metal")      # translate + g++, cached by content hash
    lib.run("kernel_name", threadgroups=(gx, gy, gz), threads=(tx, 1, 1),
            buffers={0: x, 1: out, 2: params_bytes}, threadgroup_memory=[4096],
            order="shuffle", seed=3)

See README.md in this folder. Buffers are CPU tensors (contiguous; written in place), bytes,
bytearray or ctypes objects. Every kernel access is bounds-checked against the bound extent.
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .translate import BUILTINS, TranslationError, generate  # noqa: F401

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
INCLUDE = HERE / "include"
BUILD = Path(os.environ.get("RLX_EMU_BUILD", REPO / "build" / "metal_emu"))
CXX = os.environ.get("CXX_EMU", "g++")
CXXFLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-w", "-fno-strict-aliasing"]
if sys.platform.startswith("linux"):  # big private arrays touch the stack guard page first
    CXXFLAGS += ["-fstack-clash-protection"]
if sys.platform == "darwin":  # macOS declares the (deprecated) ucontext routines only then
    CXXFLAGS += ["-D_XOPEN_SOURCE=700", "-D_DARWIN_C_SOURCE"]
ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
# Watchdog: a launch that runs longer than this (seconds) is stopped with an EmulatorError.
DEFAULT_TIMEOUT = float(os.environ.get("RLX_EMU_TIMEOUT", "120"))
MAX_BUFFERS = 31

_lock = threading.Lock()
_EMPTY = ctypes.create_string_buffer(16)
_libraries = {}


class EmulatorError(RuntimeError):
    """A kernel misbehaved: out-of-bounds access, barrier divergence, unbound buffer, ..."""


class CompileError(RuntimeError):
    pass


class _LaunchDesc(ctypes.Structure):
    _fields_ = [
        ("threadgroups", ctypes.c_uint32 * 3),
        ("threads", ctypes.c_uint32 * 3),
        ("n_buffers", ctypes.c_uint32),
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("buffer_bytes", ctypes.POINTER(ctypes.c_uint64)),
        ("n_threadgroup_memory", ctypes.c_uint32),
        ("threadgroup_memory_bytes", ctypes.POINTER(ctypes.c_uint64)),
        ("order", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("max_steps", ctypes.c_uint64),
    ]


class CPlan(ctypes.Structure):
    """Mirror of rlx_emu_plan in include/rlx_emu_plan.h."""

    _fields_ = [
        ("kernel", ctypes.c_char * 128),
        ("threadgroups", ctypes.c_uint32 * 3),
        ("threads", ctypes.c_uint32 * 3),
        ("n_threadgroup_memory", ctypes.c_uint32),
        ("threadgroup_memory", ctypes.c_uint32 * 8),
        ("params_index", ctypes.c_int32),
        ("params_size", ctypes.c_uint32),
        ("params", ctypes.c_ubyte * 1024),
    ]


@dataclass
class Plan:
    """One dispatch: what the .mm host code would encode (dispatchThreadgroups semantics)."""

    kernel: str
    threadgroups: tuple
    threads: tuple
    threadgroup_memory: list = field(default_factory=list)
    params: bytes = b""
    params_index: int = -1

    @classmethod
    def from_c(cls, c):
        return cls(
            kernel=c.kernel.decode(),
            threadgroups=tuple(c.threadgroups),
            threads=tuple(c.threads),
            threadgroup_memory=list(c.threadgroup_memory[: c.n_threadgroup_memory]),
            params=bytes(c.params[: c.params_size]),
            params_index=c.params_index,
        )


def _compile(source, stem, extra_flags=()):
    """Compiles C++ text to a shared library under BUILD, cached by content hash."""
    deps = sorted(INCLUDE.rglob("*.h"))
    h = hashlib.sha256()
    h.update(source.encode())
    for d in deps:
        h.update(d.read_bytes())
    h.update(" ".join([CXX, *CXXFLAGS, *extra_flags]).encode())
    out = BUILD / f"{stem}-{h.hexdigest()[:16]}.so"
    if out.exists():
        return out
    BUILD.mkdir(parents=True, exist_ok=True)
    # private file names until the end: concurrent test processes never see half a file
    fd, src_tmp = tempfile.mkstemp(suffix=".cpp", dir=BUILD)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=BUILD)
    os.close(fd)
    cmd = [CXX, *CXXFLAGS, f"-I{INCLUDE}", *extra_flags, src_tmp, "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    os.replace(src_tmp, out.with_suffix(".cpp"))  # kept for reading compiler errors
    if proc.returncode != 0:
        os.unlink(tmp)
        raise CompileError(f"emulator compile of {stem} failed:\n{proc.stderr[-6000:]}")
    os.replace(tmp, out)
    return out


class MetalLibrary:
    """The kernels of one .metal file, translated and compiled for the CPU."""

    def __init__(self, path, entries, so_path):
        self.path = path
        self.so_path = str(so_path)
        self.entries = {e.name: e for e in entries}
        self._dll = ctypes.CDLL(str(so_path))
        self._launch = self._dll.rlx_emu_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(_LaunchDesc), ctypes.c_char_p,
                                 ctypes.c_size_t]

    @property
    def kernels(self):
        return sorted(self.entries)

    def run(self, kernel, threadgroups, threads, buffers, threadgroup_memory=(),
            order="forward", seed=0, timeout=None, max_steps=None):
        """Dispatches `kernel` over threadgroups x threads (like dispatchThreadgroups).

        buffers: {slot: tensor | bytes | ctypes object} or a list (slot = position, None = unbound).
        threadgroup_memory: byte size of each [[threadgroup(i)]] allocation.
        order: "forward" | "reverse" | "shuffle" (seeded) -- the order in which simdgroups, their
        lanes, and threadgroups are resumed between synchronisation points.
        timeout: wall-clock seconds before the watchdog stops the launch (default
        RLX_EMU_TIMEOUT or 120; 0 = none). max_steps: a deterministic budget of loop
        iterations plus synchronisations over the whole launch (default: none).
        """
        if kernel not in self.entries:
            raise KeyError(f"{self.path} has no kernel {kernel!r}; it has {self.kernels}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {sorted(ORDERS)}, got {order!r}")
        timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        tg, th = _dim3(threadgroups, "threadgroups"), _dim3(threads, "threads")
        if 0 in tg:
            raise EmulatorError(f"{kernel}: empty grid {tg}; host code must not dispatch it")
        if isinstance(buffers, dict):
            slots = buffers
        else:
            slots = dict(enumerate(buffers))
        n = max(slots, default=-1) + 1
        if n > MAX_BUFFERS:
            raise ValueError(f"at most {MAX_BUFFERS} buffers, got slot {n - 1}")
        ptrs = (ctypes.c_void_p * max(n, 1))()
        sizes = (ctypes.c_uint64 * max(n, 1))()
        keep = []
        for i, b in slots.items():
            if b is None:
                continue
            ptrs[i], sizes[i], holder = _buffer(b, f"buffer {i} of {kernel}")
            keep.append(holder)
        tgm = list(threadgroup_memory)
        tgm_arr = (ctypes.c_uint64 * max(len(tgm), 1))(*tgm)
        desc = _LaunchDesc(
            (ctypes.c_uint32 * 3)(*tg), (ctypes.c_uint32 * 3)(*th), n,
            ctypes.cast(ptrs, ctypes.POINTER(ctypes.c_void_p)),
            ctypes.cast(sizes, ctypes.POINTER(ctypes.c_uint64)), len(tgm),
            ctypes.cast(tgm_arr, ctypes.POINTER(ctypes.c_uint64)), ORDERS[order], seed,
            timeout, max_steps or 0,
        )
        err = ctypes.create_string_buffer(4096)
        rc = self._launch(kernel.encode(), ctypes.byref(desc), err, len(err))
        del keep
        if rc != 0:
            raise EmulatorError(err.value.decode(errors="replace"))

    def run_plan(self, plan, buffers, order="forward", seed=0, timeout=None, max_steps=None):
        """Runs a Plan; its params bytes are bound at plan.params_index."""
        slots = dict(buffers) if isinstance(buffers, dict) else dict(enumerate(buffers))
        if plan.params_index >= 0:
            if plan.params_index in slots:
                raise ValueError(f"buffer slot {plan.params_index} is the plan's params slot")
            slots[plan.params_index] = plan.params
        self.run(plan.kernel, plan.threadgroups, plan.threads, slots, plan.threadgroup_memory,
                 order=order, seed=seed, timeout=timeout, max_steps=max_steps)


def _dim3(v, what):
    v = (v,) if isinstance(v, int) else tuple(v)
    if not 1 <= len(v) <= 3 or any((not isinstance(x, int)) or x < 0 for x in v):
        raise ValueError(f"{what} must be 1 to 3 non-negative ints, got {v}")
    return v + (1,) * (3 - len(v))


def _buffer(b, what):
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(b, torch.Tensor):
        if b.device.type != "cpu":
            raise ValueError(f"{what}: the emulator needs CPU tensors, got {b.device}")
        if not b.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (the host code binds "
                             "contiguous tensors)")
        nbytes = b.numel() * b.element_size()
        if nbytes == 0:  # bound but empty: any access is out of bounds
            return ctypes.addressof(_EMPTY), 0, b
        return b.data_ptr(), nbytes, b
    if isinstance(b, (bytes, bytearray)):
        buf = ctypes.create_string_buffer(bytes(b), max(len(b), 1))
        return ctypes.addressof(buf), len(b), buf
    if isinstance(b, ctypes.Structure | ctypes.Array):
        return ctypes.addressof(b), ctypes.sizeof(b), b
    raise TypeError(f"{what}: expected a tensor, bytes or a ctypes object, got {type(b).__name__}")


def load(path):
    """Translates and compiles one .metal file (relative to the repo root, or absolute)."""
    p = Path(path)
    if not p.is_absolute():
        p = REPO / p
    src = p.read_text()
    rel = str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)
    key = (rel, hashlib.sha256(src.encode()).hexdigest())
    with _lock:
        if key not in _libraries:
            cpp, entries = generate(src, rel)
            so = _compile(cpp, p.stem)
            _libraries[key] = MetalLibrary(rel, entries, so)
        return _libraries[key]


def load_source(src, name="inline", metal_version=None):
    """Like load() for MSL text held in a string (tests of the emulator itself, and the mock
    Metal runtime's newLibraryWithSource). metal_version: the `__METAL_VERSION__` to compile
    with (e.g. 300, 310; default: the shim's)."""
    flags = () if metal_version is None else (f"-D__METAL_VERSION__={int(metal_version)}",)
    key = (name, hashlib.sha256(src.encode()).hexdigest(), flags)
    with _lock:
        if key not in _libraries:
            cpp, entries = generate(src, f"{name}.metal")
            _libraries[key] = MetalLibrary(name, entries, _compile(cpp, name, flags))
        return _libraries[key]


def compile_cpp(path, include_dirs=()):
    """Compiles a C++ file (e.g. extern "C" wrappers of the launch-plan headers) to a ctypes.CDLL.

    csrc/include and this folder's include/ are always on the include path.
    """
    p = Path(path)
    if not p.is_absolute():
        p = REPO / p
    flags = [f"-I{REPO / 'csrc' / 'include'}"] + [f"-I{d}" for d in include_dirs]
    with _lock:
        key = ("cpp", str(p), hashlib.sha256(p.read_bytes()).hexdigest())
        if key not in _libraries:
            src = f'#line 1 "{p}"\n' + p.read_text()
            # headers it includes from csrc/include take part in the cache key
            for h in sorted((REPO / "csrc" / "include").rglob("*.h")):
                src += f"\n// dep {h.name} {hashlib.sha256(h.read_bytes()).hexdigest()}"
            _libraries[key] = ctypes.CDLL(str(_compile(src, p.stem, flags)))
        return _libraries[key]


def call_plan(fn, *args):
    """Calls `void fn(const int64_t* args, int n, rlx_emu_plan* out)` and returns a Plan."""
    arr = (ctypes.c_int64 * max(len(args), 1))(*[int(a) for a in args])
    out = CPlan()
    fn.restype = ctypes.c_int
    rc = fn(arr, len(args), ctypes.byref(out))
    if rc != 0:
        raise ValueError(f"plan function {fn.__name__} rejected arguments {args} (code {rc})")
    return Plan.from_c(out)
