"""What the CPU offers Muon's Newton–Schulz (and the benchmarks' reports): the facts that
decide its dtype and kernels.

- bf16 Newton–Schulz is the CPU default only where the CPU has native bf16 arithmetic
  (x86 AVX512-BF16 or AMX, Arm's BF16 extension); elsewhere bf16 matmuls are emulated through
  float32 and are slower than float32 ones, so float32 is the default there.
- The symmetric bf16 products (`rlx::symmetric_matmul`, about half the work of a full product)
  are used on AVX512-BF16 CPUs without AMX. With AMX the products run on the tile units at
  several times the AVX512-BF16 rate: there the whole iteration of each matrix runs in
  `rlx::newton_schulz_amx` (shapes it takes), otherwise through oneDNN's `bmm`.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass

import torch

__all__ = ["CpuFeatures", "amx_kernel_pays", "cpu_features", "native_bf16",
           "symmetric_kernel_pays"]


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU model and the ISA features that Muon's kernel choices depend on.

    Example::

        >>> f = cpu_features()
        >>> f.arch == platform.machine().lower()
        True
    """

    model: str
    arch: str
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx: bool
    neon: bool
    arm_bf16: bool
    avx512_vbmi: bool = False  # byte permutes: the codebook forward's one-row lookups

    def summary(self) -> str:
        """One line: the model, the architecture and the features present.

        Example::

            >>> CpuFeatures("AMD EPYC 7B13", "x86_64", True, False, False, False, False,
            ...             False).summary()
            'AMD EPYC 7B13 (x86_64): AVX2'
        """
        names = [n.upper().replace("_", "-") for n in
                 ("avx2", "avx512", "avx512_vbmi", "avx512_bf16", "amx", "neon", "arm_bf16")
                 if getattr(self, n)]
        return f"{self.model} ({self.arch}): {', '.join(names) or 'no SIMD features detected'}"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _darwin_sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


@functools.cache
def cpu_features() -> CpuFeatures:
    """Detects the CPU's features once per process.

    >>> f = cpu_features()
    >>> isinstance(f.avx2, bool)
    True
    """
    arch = platform.machine().lower()
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    model = info.get("model name") or info.get("CPU part") or platform.processor() or arch
    x86 = arch in ("x86_64", "amd64", "i686", "x86")
    arm = arch in ("aarch64", "arm64")
    avx2 = avx512 = avx512_bf16 = amx = neon = arm_bf16 = vbmi = False
    if x86:
        vbmi = "avx512vbmi" in flags
        cpu = torch.cpu
        avx2 = bool(cpu._is_avx2_supported()) if hasattr(cpu, "_is_avx2_supported") else (
            "avx2" in flags)
        avx512 = bool(cpu._is_avx512_supported()) if hasattr(cpu, "_is_avx512_supported") else (
            "avx512f" in flags)
        avx512_bf16 = (bool(cpu._is_avx512_bf16_supported())
                       if hasattr(cpu, "_is_avx512_bf16_supported") else "avx512_bf16" in flags)
        amx = (bool(cpu._is_amx_tile_supported()) if hasattr(cpu, "_is_amx_tile_supported")
               else "amx_tile" in flags) and ("amx_bf16" in flags or not flags)
    elif arm:
        neon = True  # Advanced SIMD is mandatory on AArch64
        if platform.system() == "Darwin":
            model = _darwin_sysctl("machdep.cpu.brand_string") or model
            arm_bf16 = _darwin_sysctl("hw.optional.arm.FEAT_BF16") == "1"
        else:
            arm_bf16 = "bf16" in flags
    if os.environ.get("RLX_NO_AVX512_BF16") == "1":  # the extension's switch, seen alike here
        avx512_bf16 = False
    return CpuFeatures(model=model, arch=arch, avx2=avx2, avx512=avx512,
                       avx512_bf16=avx512_bf16, amx=amx, neon=neon, arm_bf16=arm_bf16,
                       avx512_vbmi=vbmi)


def native_bf16() -> bool:
    """Whether the CPU computes bf16 products natively (AVX512-BF16, AMX or Arm BF16).

    >>> isinstance(native_bf16(), bool)
    True
    """
    f = cpu_features()
    return f.avx512_bf16 or f.amx or f.arm_bf16


@functools.cache
def symmetric_kernel_pays() -> bool:
    """Whether bf16 symmetric products go through `rlx::symmetric_matmul` rather than `bmm`:
    the kernel runs natively (AVX512-BF16, extension loaded) and there is no AMX.

    >>> isinstance(symmetric_kernel_pays(), bool)
    True
    """
    try:
        native = bool(torch.ops.rlx.symmetric_matmul_is_native())
    except (AttributeError, RuntimeError):  # the compiled extension is not loaded
        native = False
    return native and not cpu_features().amx


@functools.cache
def amx_kernel_pays() -> bool:
    """Whether bf16 Newton–Schulz runs in `rlx::newton_schulz_amx` on AMX tiles (the extension
    is loaded and its AMX path runs on this CPU).

    >>> isinstance(amx_kernel_pays(), bool)
    True
    """
    try:
        return bool(torch.ops.rlx.newton_schulz_amx_is_native())
    except (AttributeError, RuntimeError):  # the compiled extension is not loaded
        return False
