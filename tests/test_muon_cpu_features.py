"""rlx_torch.optim.cpu_features: what the CPU offers, and the Newton–Schulz dtype and kernels
chosen from it."""

import importlib

import torch

from rlx_torch.optim import muon as muon_module
from rlx_torch.optim.cpu_features import cpu_features, native_bf16

# The package re-exports the function `cpu_features` under its module's name.
features_module = importlib.import_module("rlx_torch.optim.cpu_features")


def test_features_match_proc_cpuinfo():
    f = cpu_features()
    assert f.model and f.arch
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = None
    if flags is not None and f.arch == "x86_64":
        assert f.avx2 == ("avx2" in flags)
        assert f.avx512_bf16 == ("avx512_bf16" in flags)
        assert f.amx == ("amx_tile" in flags and "amx_bf16" in flags)
    assert native_bf16() == (f.avx512_bf16 or f.amx or f.arm_bf16)
    assert f.model in f.summary()


def test_default_ns_dtype_follows_native_bf16(monkeypatch):
    cpu = torch.device("cpu")
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(muon_module, "native_bf16", lambda native=native: native)
        assert muon_module.default_ns_dtype(cpu, torch.float32) == expected
        assert muon_module.default_ns_dtype(cpu, torch.bfloat16) == expected
        assert muon_module.default_ns_dtype(cpu, torch.float64) == torch.float64
    assert muon_module.default_ns_dtype(torch.device("cuda"), torch.float32) == torch.bfloat16
    assert muon_module.default_ns_dtype(torch.device("mps"), torch.float32) == torch.float32


def test_symmetric_kernel_is_not_chosen_with_amx(monkeypatch):
    amx = features_module.CpuFeatures(model="x", arch="x86_64", avx2=True, avx512=True,
                                      avx512_bf16=True, amx=True, neon=False, arm_bf16=False)
    monkeypatch.setattr(features_module, "cpu_features", lambda: amx)
    features_module.symmetric_kernel_pays.cache_clear()
    try:
        assert not features_module.symmetric_kernel_pays()
    finally:
        features_module.symmetric_kernel_pays.cache_clear()


def test_default_dtype_step_is_accurate():
    # Whatever this CPU's default NS dtype is, one default step is within that dtype's NS
    # error of the float64 step.
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(32, 48, generator=gen), torch.randn(32, 48, generator=gen)
    moved = {}
    for ns_dtype in (None, torch.float64):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        muon_module.Muon([p], lr=0.1, ns_dtype=ns_dtype).step()
        moved[ns_dtype] = (p.detach() - start).double()
    default = muon_module.default_ns_dtype(torch.device("cpu"), torch.float32)
    bound = 0.05 if default == torch.bfloat16 else 1e-4
    err = (moved[None] - moved[torch.float64]).norm() / moved[torch.float64].norm()
    assert err.item() < bound, (default, err.item())
