"""The chunked CUDA gated delta backward (csrc/cuda/gated_delta_chunk_bwd*.cuh, the default
for a per-head gate and 16-bit inputs; RLX_CUDA_GATED_DELTA_CHUNKED=0 selects the token
backward): against the token backward on the same forward outputs and the float64 reference,
on T < 64, T = 64, T not a multiple of 64, ragged K and V, GVA with varlen and an empty
sequence, g = -30, an initial state and chunk_size 128; and bitwise determinism. The same for
the per-channel gate (KDA, gated_delta_chunk_kda*.cuh), whose chunked forward is also held to
the token forward (o, final state, checkpoints). Needs a GPU: skips cleanly without one. (The
per-head chunked forward's tests, which also run this backward, are in
test_gated_delta_cuda.py.)"""

import pytest
import torch

import rlx_torch
from rlx_torch.ops import reference
from rlx_torch.ops.gated_delta import unpack_gradients
from tests.test_gated_delta_cuda import (
    CUDA,
    TOL,
    _split,
    compare,
    cotangents,
    forward_backward,
    make_inputs,
    rel_rms,
    to,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


CHUNKED_BWD_CASES = {  # the chunked backward: T < 64, = 64, not a multiple of 64, ragged K/V
    "T20_state": dict(B=2, T=20, H=2, HV=2, K=32, V=32, state=True),
    "T64": dict(B=1, T=64, H=1, HV=1, K=64, V=64),
    "T1000_K128_state": dict(B=2, T=1000, H=2, HV=2, K=128, V=128, state=True),
    "gva_varlen_empty": dict(B=1, T=700, H=1, HV=3, K=64, V=96, state=True,
                             cu_seqlens=[0, 64, 64, 65, 400, 700]),
    "ragged_kv_l2norm": dict(B=1, T=200, H=2, HV=2, K=40, V=70, normalize_k=False,
                             use_qk_l2norm=True),
    # K = V = 256 runs the chunked forward and the token backward (gated_delta_backward.cu),
    # as test_gated_delta_cuda.py checks
    "strong_decay": dict(B=1, T=300, H=1, HV=2, K=64, V=64, state=True, g_scale=30.0),
    "chunk128": dict(B=1, T=300, H=1, HV=1, K=32, V=32, state=True, chunk_size=128),
}


def _op_grads(inputs, cot, chunk_size, l2, forward_chunked, backward_chunked, monkeypatch):
    """The packed gradients of rlx::gated_delta_bwd, split, with the forward and the backward
    each on the chunked path or not."""
    x = inputs
    eps = 1e-6 if l2 else None
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], x["cu_seqlens"])

    def chunked(on):
        monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1" if on else "0")

    chunked(forward_chunked)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*args, chunk_size, eps)
    chunked(backward_chunked)
    do, dht = cot[0].to(CUDA, x["v"].dtype), cot[1].to(CUDA, torch.float32)
    packed = torch.ops.rlx.gated_delta_bwd(*args, ckpt, do, dht, chunk_size, eps, vw)
    grads = unpack_gradients(packed, x["q"], x["v"], x["g"], x["initial_state"], x["cu_seqlens"])
    names = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")
    return {n: t for n, t in zip(names, grads, strict=True) if t is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CHUNKED_BWD_CASES)
def test_chunked_backward_matches_token_backward_and_reference(case, dtype, monkeypatch):
    """The chunked backward against the token backward on the
    same forward outputs (the token forward's), and the chunked forward + backward against the
    float64 reference."""
    l2, kw = _split(CHUNKED_BWD_CASES[case])
    chunk_size = kw.pop("chunk_size", 64)
    g_scale = kw.pop("g_scale", None)
    cpu_inputs = make_inputs(dtype=dtype, **kw)
    if g_scale is not None:  # down to -g_scale per step: exp of cumulative gates would overflow
        gen = torch.Generator().manual_seed(3)
        cpu_inputs["g"] = -g_scale * torch.rand(cpu_inputs["g"].shape, generator=gen)
    inputs = to(cpu_inputs, CUDA)
    cot = cotangents(inputs)
    token = _op_grads(inputs, cot, chunk_size, l2, False, False, monkeypatch)
    chunked = _op_grads(inputs, cot, chunk_size, l2, False, True, monkeypatch)
    compare(chunked, token, 1e-2 if dtype == torch.bfloat16 else 2e-3, f"{case}, {dtype}")
    if kw.get("T", 0) <= 300:
        monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1")
        ours = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, l2,
                                chunk_size=chunk_size)
        ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64), cot,
                               l2)
        compare(ours, ref, TOL[dtype], f"{case}, {dtype} vs float64 reference")


@pytest.mark.parametrize("per_channel", [False, True])
def test_chunked_backward_deterministic_bitwise(per_channel, monkeypatch):
    """Two runs of the chunked backward on the same inputs: bitwise equal gradients."""
    inputs = to(make_inputs(B=1, T=700, H=1, HV=3, K=128, V=96, state=True,
                            cu_seqlens=[0, 64, 64, 65, 400, 700], dtype=torch.bfloat16,
                            per_channel=per_channel), CUDA)
    cot = cotangents(inputs)
    first = _op_grads(inputs, cot, 64, False, True, True, monkeypatch)
    for _ in range(2):
        again = _op_grads(inputs, cot, 64, False, True, True, monkeypatch)
        for name in first:
            assert torch.equal(first[name], again[name]), name


KDA_CASES = {  # the per-channel gate (KDA): the chunked kernels take K <= 128
    **CHUNKED_BWD_CASES,
    "odd_k_v_state": dict(B=1, T=130, H=1, HV=1, K=37, V=23, state=True),
    # V = 256: the chunked forward, and the token backward (the chunked one takes V <= 128)
    "V256": dict(B=1, T=200, H=1, HV=1, K=128, V=256, state=True),
}


def _kda_inputs(case, dtype):
    l2, kw = _split(KDA_CASES[case])
    chunk_size = kw.pop("chunk_size", 64)
    g_scale = kw.pop("g_scale", None)
    cpu_inputs = make_inputs(dtype=dtype, per_channel=True, **kw)
    if g_scale is not None:  # down to -g_scale per step: exp of cumulative gates would overflow
        gen = torch.Generator().manual_seed(3)
        cpu_inputs["g"] = -g_scale * torch.rand(cpu_inputs["g"].shape, generator=gen)
    return to(cpu_inputs, CUDA), l2, chunk_size


def _forward_outputs(inputs, chunk_size, l2, chunked, monkeypatch):
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1" if chunked else "0")
    x = inputs
    return torch.ops.rlx.gated_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3,
                                         x["initial_state"], x["cu_seqlens"], chunk_size,
                                         1e-6 if l2 else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", KDA_CASES)
def test_kda_chunked_forward_matches_token_forward(case, dtype, monkeypatch):
    """The per-channel gate's chunked forward (16-bit products) against the token recurrence:
    o, the final state and the checkpoints (which either backward reads), no vw (gdn_keeps_vw);
    and not bitwise equal to it, so the chunked kernels did run."""
    inputs, l2, chunk_size = _kda_inputs(case, dtype)
    token = _forward_outputs(inputs, chunk_size, l2, False, monkeypatch)
    chunked = _forward_outputs(inputs, chunk_size, l2, True, monkeypatch)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    names = ("o", "ht", "checkpoints")
    for name, a, e in zip(names, chunked[:3], token[:3], strict=True):
        assert torch.isfinite(a.double()).all(), (case, name)
        if name == "checkpoints":  # the tag in the last slot is the host's, equal in both
            a, e = a[:-1], e[:-1]
        err = rel_rms(a, e) if e.numel() else 0.0
        assert err <= tol, f"{case}, {dtype}: {name} rel RMS {err:.2e} > {tol:.1e}"
    assert chunked[3].numel() == 0 and token[3].numel() == 0  # no vw for a per-channel gate
    assert not torch.equal(chunked[0], token[0]), "the chunked forward did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", KDA_CASES)
def test_kda_chunked_backward_matches_token_backward_and_reference(case, dtype, monkeypatch):
    """The per-channel gate's chunked backward (which re-runs its own prep and state kernels:
    the forward keeps no vw) against the token backward on the same forward outputs; the token
    backward on the chunked forward's checkpoints; and the chunked forward + backward against
    the float64 reference. V = 256 runs the token backward (the chunked one takes V <= 128):
    bitwise that of the token path there, and not elsewhere, so the chunked kernels did run."""
    inputs, l2, chunk_size = _kda_inputs(case, dtype)
    cot = cotangents(inputs)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    token = _op_grads(inputs, cot, chunk_size, l2, False, False, monkeypatch)
    chunked = _op_grads(inputs, cot, chunk_size, l2, False, True, monkeypatch)
    compare(chunked, token, tol, f"{case}, {dtype}")
    assert torch.equal(chunked["dv"], token["dv"]) == (inputs["v"].shape[-1] > 128), case
    mixed = _op_grads(inputs, cot, chunk_size, l2, True, False, monkeypatch)
    compare(mixed, token, tol, f"{case}, {dtype}: chunked forward, token backward")
    if inputs["q"].shape[1] <= 300:
        monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1")
        ours = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, l2,
                                chunk_size=chunk_size)
        ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64), cot,
                               l2)
        compare(ours, ref, TOL[dtype], f"{case}, {dtype} vs float64 reference")
