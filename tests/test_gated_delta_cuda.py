"""rlx_torch.gated_delta_rule on CUDA (csrc/cuda/gated_delta_*.cu): against the CPU kernel and a
float64 reference written from the math (rlx_torch.ops.reference, run on the CPU), for every
variant, dtype and T in {1, 63, 65, 1000}; varlen against per-sequence runs, GVA against repeated
q/k, gradcheck in float64, opcheck, torch.compile, determinism, the layer, the model and the demo;
fla's own kernels where fla can be imported. Needs a GPU: skips cleanly without one."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rlx_torch
from rlx_torch.ops import reference
from rlx_torch.ops.gated_delta import unpack_gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Relative RMS error against the float64 reference, per input dtype (outputs and gradients).
TOL = {torch.float64: 1e-10, torch.float32: 5e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def rel_rms(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    denom = expected.pow(2).mean().sqrt().clamp_min(1e-12)
    return ((actual - expected).pow(2).mean().sqrt() / denom).item()


def make_inputs(B=2, T=65, H=2, HV=2, K=8, V=8, per_channel=False, dtype=torch.float32,
                state=False, cu_seqlens=None, normalize_k=True, seed=0):
    """CPU inputs (rounded to dtype); g, beta and the state in the accumulation dtype."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if normalize_k:  # keeps the recurrence contractive, as l2norm does in practice
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g_shape = (B, T, HV, K) if per_channel else (B, T, HV)
    g = F.logsigmoid(torch.randn(g_shape, generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g, beta = g.to(acc), beta.to(acc)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, HV, K, V, dtype=acc, generator=gen) if state else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def to(inputs, device, dtype=None):
    out = {}
    for name, t in inputs.items():
        if t is None:
            out[name] = None
        elif dtype is not None and t.is_floating_point():
            out[name] = t.to(device=device, dtype=dtype)
        else:
            out[name] = t.to(device)
    return out


def forward_backward(fn, inputs, cot, use_qk_l2norm=False, grads=True, **kw):
    """(o, ht) and the gradients of <o, cot_o> + <ht, cot_h> for every floating input."""
    leaves = {n: (t.detach().clone().requires_grad_(grads and t.is_floating_point())
                  if t is not None else None) for n, t in inputs.items()}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["initial_state"], output_final_state=True,
               cu_seqlens=leaves["cu_seqlens"], use_qk_l2norm=use_qk_l2norm, **kw)
    out = {"o": o, "ht": ht}
    if grads:
        loss = (o.double() * cot[0].to(o.device)).sum() + (ht.double() * cot[1].to(o.device)).sum()
        names = [n for n in GRAD_NAMES if leaves[n] is not None]
        for n, gr in zip(names, torch.autograd.grad(loss, [leaves[n] for n in names]),
                         strict=True):
            out["d" + n] = gr
    return out


def cotangents(inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    v, q = inputs["v"], inputs["q"]
    N = q.shape[0] if inputs["cu_seqlens"] is None else len(inputs["cu_seqlens"]) - 1
    return (torch.randn(v.shape, generator=gen, dtype=torch.float64),
            torch.randn(N, v.shape[2], q.shape[3], v.shape[3], generator=gen,
                        dtype=torch.float64))


def compare(actual, expected, tol, what):
    """Relative RMS error per output; an expected zero (e.g. dg at T = 1 without an initial
    state, where the decayed state is zero) is checked absolutely instead, since its RMS is
    only rounding noise."""
    assert actual.keys() == expected.keys(), what
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.shape == e.shape, (what, name)
        assert torch.isfinite(a.double()).all(), (what, name)
        if e.numel() and e.double().pow(2).mean().sqrt().item() < 1e-6:
            worst = a.double().abs().max().item()
            assert worst <= 1e-5, f"{what}: {name} should be zero, max |.| {worst:.2e}"
            continue
        err = rel_rms(a, e)
        assert err <= tol, f"{what}: {name} rel RMS {err:.2e} > {tol:.1e}"


VARIANTS = {
    "per_head": dict(),
    "per_channel": dict(per_channel=True),
    "gva": dict(H=1, HV=3),
    "k_ne_v": dict(K=5, V=41),  # two column tiles, the second ragged
    "large_kv": dict(B=1, H=1, HV=1, K=256, V=200, state=True),
    "state": dict(state=True),
    "varlen": dict(B=1, cu_seqlens=[0, 20, 20, 65], state=True),
    "kda_gva_varlen": dict(B=1, H=2, HV=4, K=6, V=3, per_channel=True,
                           cu_seqlens=[0, 64, 65], state=True),
    "l2norm": dict(normalize_k=False, state=True, use_qk_l2norm=True),
    "kda_l2norm_k_ne_v": dict(K=40, V=70, per_channel=True, normalize_k=False,
                              use_qk_l2norm=True),
}


def _split(kw):
    kw = dict(kw)
    return kw.pop("use_qk_l2norm", False), kw


@pytest.mark.parametrize("T", [1, 63, 65, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_cpu_kernel_and_reference(variant, dtype, T):
    l2, kw = _split(VARIANTS[variant])
    if "cu_seqlens" in kw:  # the same sequence layout stretched to T tokens
        cu = kw["cu_seqlens"]
        kw["cu_seqlens"] = [c * T // cu[-1] for c in cu]
    if T == 1000 and variant == "large_kv":
        kw["K"], kw["V"] = 256, 256
    inputs = make_inputs(T=T, dtype=dtype, **kw)
    cot = cotangents(inputs)
    ours = forward_backward(rlx_torch.gated_delta_rule, to(inputs, CUDA), cot, l2)
    cpu = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, l2)
    tol = TOL[dtype]
    compare(ours, cpu, tol, f"cuda vs cpu kernel ({variant}, {dtype}, T={T})")
    if T <= 65 or (variant in ("per_head", "per_channel") and dtype == torch.float32):
        ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64),
                               cot, l2)
        compare(ours, ref, tol, f"cuda vs float64 reference ({variant}, {dtype}, T={T})")


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64, 100])
@pytest.mark.parametrize("per_channel", [False, True])
def test_chunk_size_does_not_change_results(chunk_size, per_channel):
    inputs = to(make_inputs(T=130, per_channel=per_channel, state=True), CUDA)
    cot = cotangents(inputs)
    base = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
    got = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, chunk_size=chunk_size)
    compare(got, base, 1e-5, f"chunk_size={chunk_size}")


@pytest.mark.parametrize("per_channel", [False, True])
def test_extreme_decay_long_sequence(per_channel):
    """g = -30 on every token and T = 65,536 (fla's safe-gate range): finite and as on the CPU."""
    inputs = make_inputs(B=1, T=65536, H=1, HV=1, K=16, V=16, per_channel=per_channel,
                         state=True)
    inputs["g"] = torch.full_like(inputs["g"], -30.0)
    inputs["g"][:, ::7] = 0.0  # and some tokens with no decay at all
    cot = cotangents(inputs)
    ours = forward_backward(rlx_torch.gated_delta_rule, to(inputs, CUDA), cot)
    cpu = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
    compare(ours, cpu, 1e-4, "g = -30")


CHUNKED_CASES = {  # per-head gate, 16-bit inputs: the chunked tensor-core forward applies
    "K128_state": dict(B=2, T=1000, H=2, HV=2, K=128, V=128, state=True),
    "gva_varlen": dict(B=1, T=700, H=1, HV=3, K=64, V=96, state=True,
                       cu_seqlens=[0, 64, 64, 65, 400, 700]),
    "odd_kv_l2norm": dict(B=1, T=200, H=2, HV=2, K=40, V=70, normalize_k=False,
                          use_qk_l2norm=True),
    "large_kv": dict(B=1, T=300, H=1, HV=1, K=256, V=256, state=True),
    "chunk128": dict(B=1, T=300, H=1, HV=1, K=32, V=32, state=True, chunk_size=128),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CHUNKED_CASES)
def test_chunked_forward_matches_token_recurrence(case, dtype, monkeypatch):
    """The chunked forward and backward (16-bit products, float32 state;
    the default) against the token recurrence (float32 throughout;
    RLX_CUDA_GATED_DELTA_CHUNKED=0) on the same inputs."""
    l2, kw = _split(CHUNKED_CASES[case])
    chunk_size = kw.pop("chunk_size", 64)
    inputs = to(make_inputs(dtype=dtype, **kw), CUDA)
    cot = cotangents(inputs)
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "0")
    token = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, l2, chunk_size=chunk_size)
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1")
    chunked = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, l2, chunk_size=chunk_size)
    compare(chunked, token, 1e-2 if dtype == torch.bfloat16 else 2e-3, f"{case}, {dtype}")
    if kw.get("T", 0) <= 300:
        ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64), cot,
                               l2)
        compare(chunked, ref, TOL[dtype], f"{case}, {dtype} vs float64 reference")


def test_chunked_forward_extreme_decay_long_sequence(monkeypatch):
    """g = -30 per token (and 0 on every 7th), T = 65,536, bf16: exponents of cumulative gates
    inside a chunk would overflow; differences of them do not."""
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1")
    inputs = make_inputs(B=1, T=65536, H=1, HV=1, K=64, V=64, state=True, dtype=torch.bfloat16)
    inputs["g"] = torch.full_like(inputs["g"], -30.0)
    inputs["g"][:, ::7] = 0.0
    cot = cotangents(inputs)
    ours = forward_backward(rlx_torch.gated_delta_rule, to(inputs, CUDA), cot)
    cpu = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
    compare(ours, cpu, 1e-2, "g = -30, chunked")


def _gradcheck(inputs, use_qk_l2norm=False, chunk_size=3):
    inputs = to(inputs, CUDA, torch.float64)
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    args = [inputs[n].clone().requires_grad_() for n in names]

    def fn(*xs):
        kw = dict(zip(names, xs, strict=True))
        return rlx_torch.gated_delta_rule(
            kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"],
            initial_state=kw.get("initial_state"), output_final_state=True,
            cu_seqlens=inputs["cu_seqlens"], use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_per_head_with_state():
    _gradcheck(make_inputs(B=2, T=7, K=3, V=4, dtype=torch.float64, state=True))


def test_gradcheck_per_channel_varlen_gva():
    _gradcheck(make_inputs(B=1, T=9, H=1, HV=2, K=4, V=3, per_channel=True,
                           dtype=torch.float64, cu_seqlens=[0, 4, 4, 9], state=True))


def test_gradcheck_l2norm_k_ne_v_two_tiles():
    _gradcheck(make_inputs(B=1, T=6, K=3, V=34, dtype=torch.float64, normalize_k=False,
                           state=True), use_qk_l2norm=True, chunk_size=4)


def test_varlen_equals_separate_sequences():
    lens = [5, 0, 70, 1, 33]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    packed = to(make_inputs(B=1, T=cu[-1], per_channel=True, state=True, cu_seqlens=cu), CUDA)
    cot = cotangents(packed)
    whole = forward_backward(rlx_torch.gated_delta_rule, packed, cot)
    for n in range(len(lens)):
        if lens[n] == 0:
            continue
        s, e = cu[n], cu[n + 1]
        one = {name: packed[name][:, s:e] for name in ("q", "k", "v", "g", "beta")}
        one["initial_state"] = packed["initial_state"][n:n + 1]
        one["cu_seqlens"] = None
        got = forward_backward(rlx_torch.gated_delta_rule, one,
                               (cot[0][:, s:e], cot[1][n:n + 1]))
        for name in ("o", "dq", "dk", "dv", "dg", "dbeta"):
            torch.testing.assert_close(got[name], whole[name][:, s:e], rtol=1e-5, atol=1e-5)
        for name in ("ht", "dinitial_state"):
            torch.testing.assert_close(got[name], whole[name][n:n + 1], rtol=1e-5, atol=1e-5)
    # the empty sequence: its state passes through, and so does its gradient
    torch.testing.assert_close(whole["ht"][1], packed["initial_state"][1])
    torch.testing.assert_close(whole["dinitial_state"][1], cot[1][1].float().to(CUDA))


@pytest.mark.parametrize("per_channel", [False, True])
def test_gva_equals_repeated_qk(per_channel):
    inputs = to(make_inputs(B=2, T=40, H=2, HV=6, K=8, V=8, per_channel=per_channel,
                            state=True), CUDA)
    cot = cotangents(inputs)
    gva = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
    rep = dict(inputs)
    rep["q"] = inputs["q"].repeat_interleave(3, dim=2)
    rep["k"] = inputs["k"].repeat_interleave(3, dim=2)
    full = forward_backward(rlx_torch.gated_delta_rule, rep, cot)
    for name in ("o", "ht", "dv", "dg", "dbeta", "dinitial_state"):
        torch.testing.assert_close(gva[name], full[name], rtol=1e-5, atol=1e-5)
    for name in ("dq", "dk"):
        summed = full[name].view(2, 40, 2, 3, 8).sum(3)
        torch.testing.assert_close(gva[name], summed, rtol=1e-5, atol=1e-5)


def test_noncontiguous_empty_and_cpu_cu_seqlens():
    base = to(make_inputs(B=2, T=30, K=8, V=8, state=True), CUDA)
    cot = cotangents(base)
    expected = forward_backward(rlx_torch.gated_delta_rule, base, cot)
    strided = dict(base)
    strided["q"] = base["q"].transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous
    strided["v"] = torch.cat([base["v"], base["v"]], dim=-1)[..., :8]
    got = forward_backward(rlx_torch.gated_delta_rule, strided, cot)
    compare(got, expected, 1e-6, "strided")
    # stride-0 beta (expanded)
    expanded = dict(base)
    expanded["beta"] = torch.full((1, 1, 1), 0.5, device=CUDA).expand(2, 30, 2)
    got = forward_backward(rlx_torch.gated_delta_rule, expanded, cot, grads=False)
    want = forward_backward(rlx_torch.gated_delta_rule, {**base, "beta": expanded["beta"]
                                                        .contiguous()}, cot, grads=False)
    compare(got, want, 0, "stride-0 beta")
    # T = 0 and B = 0
    for B, T in ((2, 0), (0, 5)):
        empty = to(make_inputs(B=B, T=T, state=True), CUDA)
        out = forward_backward(rlx_torch.gated_delta_rule, empty, cotangents(empty))
        assert out["o"].shape == (B, T, 2, 8) and out["dq"].shape == (B, T, 2, 8)
        if B:
            torch.testing.assert_close(out["ht"], empty["initial_state"])
    # cu_seqlens given on the CPU with CUDA tensors
    inputs = make_inputs(B=1, T=30, cu_seqlens=[0, 10, 30], state=True)
    on_gpu = to(inputs, CUDA)
    on_gpu_cpu_cu = dict(on_gpu, cu_seqlens=inputs["cu_seqlens"])
    cot = cotangents(inputs)
    compare(forward_backward(rlx_torch.gated_delta_rule, on_gpu_cpu_cu, cot),
            forward_backward(rlx_torch.gated_delta_rule, on_gpu, cot), 0, "cu on cpu")


@pytest.mark.parametrize(("per_channel", "chunked"), [(False, False), (False, True),
                                                     (True, False), (True, True)])
def test_deterministic_bitwise(per_channel, chunked, monkeypatch):
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1" if chunked else "0")
    inputs = to(make_inputs(B=2, T=300, H=2, HV=4, K=64, V=96, per_channel=per_channel,
                            state=True, dtype=torch.bfloat16), CUDA)
    cot = cotangents(inputs)
    first = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
    for _ in range(2):
        again = forward_backward(rlx_torch.gated_delta_rule, inputs, cot)
        for name in first:
            assert torch.equal(first[name], again[name]), name


def _op_args(inputs, scale=0.4, chunk_size=4, l2norm_eps=None):
    return (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale,
            inputs["initial_state"], inputs["cu_seqlens"], chunk_size, l2norm_eps)


@pytest.mark.parametrize("case", ["per_head_state", "kda_varlen_l2norm"])
def test_opcheck_ops(case):
    if case == "per_head_state":
        inputs, eps = to(make_inputs(B=2, T=9, K=4, V=5, state=True), CUDA), None
    else:
        inputs = to(make_inputs(B=1, T=9, K=4, V=5, per_channel=True, state=True,
                                cu_seqlens=[0, 3, 9], normalize_k=False), CUDA)
        eps = 1e-6
    args = _op_args(inputs, l2norm_eps=eps)
    torch.library.opcheck(torch.ops.rlx.gated_delta_fwd.default, args)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*args)
    # vw as on the CPU (rlx::gdn_keeps_vw): kept with checkpoints and one gate per head
    assert vw.shape == (inputs["v"].shape if inputs["g"].dim() == 3 else (0,))
    bwd_args = args[:8] + (ckpt, torch.randn_like(o), torch.randn_like(ht), 4, eps, vw)
    torch.library.opcheck(torch.ops.rlx.gated_delta_bwd.default, bwd_args)
    x = torch.randn(3, 5, 7, device=CUDA, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(torch.ops.rlx.gated_delta_l2norm_fwd.default, (x, 1e-6))
    y, r = torch.ops.rlx.gated_delta_l2norm_fwd(x, 1e-6)
    yc, rc = torch.ops.rlx.gated_delta_l2norm_fwd(x.detach().cpu(), 1e-6)
    torch.testing.assert_close(y.cpu(), yc)
    torch.testing.assert_close(r.cpu(), rc)
    dy = torch.randn_like(y)
    dx = torch.ops.rlx.gated_delta_l2norm_bwd(dy, x.detach(), r)
    torch.testing.assert_close(dx.cpu(), torch.ops.rlx.gated_delta_l2norm_bwd(
        dy.cpu(), x.detach().cpu(), rc))
    torch.library.opcheck(torch.ops.rlx.gated_delta_l2norm_bwd.default, (dy, x.detach(), r))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_l2norm_ops_match_the_definition(dtype):
    """The fused l2norm kernels (csrc/cuda/gated_delta_l2norm.cuh) against fla's l2norm in
    float64: a non-contiguous x with K over two lanes' worth, a zero row, and no rows."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4, 70, 9, generator=gen, dtype=torch.float64) * 2
    base[0, :, 0] = 0
    x = base.to(dtype).to(CUDA).transpose(1, 2)  # [4, 9, 70], last dim not contiguous
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dtype).to(CUDA)
    y, r = torch.ops.rlx.gated_delta_l2norm_fwd(x, 1e-6)
    dx = torch.ops.rlx.gated_delta_l2norm_bwd(dy, x, r)
    xd = x.double().cpu().requires_grad_()
    r_want = (xd.square().sum(-1, keepdim=True) + 1e-6).rsqrt()
    y_want = xd * r_want
    (dx_want,) = torch.autograd.grad((y_want * dy.double().cpu()).sum(), xd)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert y.dtype == dtype and dx.dtype == dtype and r.dtype == acc
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}
    torch.testing.assert_close(y.double().cpu(), y_want.detach(), rtol=tol[dtype], atol=tol[dtype])
    torch.testing.assert_close(r.double().cpu(), r_want.squeeze(-1).detach(), rtol=1e-5, atol=0)
    torch.testing.assert_close(dx.double().cpu(), dx_want, rtol=tol[dtype], atol=tol[dtype])
    empty = torch.empty(0, 3, 70, device=CUDA, dtype=dtype)
    ye, re = torch.ops.rlx.gated_delta_l2norm_fwd(empty, 1e-6)
    assert ye.shape == empty.shape and re.shape == (0, 3)
    assert torch.ops.rlx.gated_delta_l2norm_bwd(empty, empty, re).shape == empty.shape

def test_packed_backward_layout_matches_cpu():
    inputs = make_inputs(B=1, T=20, H=1, HV=2, K=4, V=6, per_channel=True, state=True,
                         cu_seqlens=[0, 7, 20])
    packed = {}
    for dev in ("cpu", "cuda"):
        x = to(inputs, dev)
        o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*_op_args(x))
        gen = torch.Generator().manual_seed(3)
        do = torch.randn(o.shape, generator=gen).to(dev)
        dh = torch.randn(ht.shape, generator=gen).to(dev)
        packed[dev] = torch.ops.rlx.gated_delta_bwd(*_op_args(x)[:8], ckpt, do, dh, 4, None, vw)
        unpack_gradients(packed[dev], x["q"], x["v"], x["g"], x["initial_state"],
                         x["cu_seqlens"])
    torch.testing.assert_close(packed["cuda"].cpu(), packed["cpu"], rtol=1e-5, atol=1e-5)


def test_checkpoints_of_another_forward_raise():
    inputs = to(make_inputs(B=1, T=128, state=True), CUDA)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*_op_args(inputs, chunk_size=64))
    args = _op_args(inputs, chunk_size=65)[:8]
    with pytest.raises(RuntimeError, match="tag differs"):
        torch.ops.rlx.gated_delta_bwd(*args, ckpt, torch.randn_like(o), None, 65, None, vw)
    with pytest.raises(RuntimeError, match="chunk_size must be >= 1"):
        torch.ops.rlx.gated_delta_bwd(*args, ckpt, torch.randn_like(o), None, 0, None, vw)


def test_bad_inputs_raise_with_the_argument_named():
    inputs = to(make_inputs(B=1, T=8), CUDA)
    with pytest.raises(RuntimeError, match="beta must be"):
        torch.ops.rlx.gated_delta_fwd(*_op_args({**inputs, "beta": inputs["beta"][..., :1]}))
    with pytest.raises(RuntimeError, match="all inputs must be on q's device"):
        torch.ops.rlx.gated_delta_fwd(*_op_args({**inputs, "g": inputs["g"].cpu()}))
    with pytest.raises(RuntimeError, match="cu_seqlens must end at T"):
        torch.ops.rlx.gated_delta_fwd(*_op_args(
            {**inputs, "cu_seqlens": torch.tensor([0, 5], device=CUDA)}))


def test_torch_compile_fullgraph():
    inputs = to(make_inputs(B=2, T=33, K=16, V=16, per_channel=True, state=True), CUDA)

    def f(q, k, v, g, beta, h0):
        o, ht = rlx_torch.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, use_qk_l2norm=True)
        return (o * o).sum() + ht.sum()

    names = ("q", "k", "v", "g", "beta", "initial_state")
    eager_args = [inputs[n].clone().requires_grad_() for n in names]
    compiled_args = [inputs[n].clone().requires_grad_() for n in names]
    eager = f(*eager_args)
    eager.backward()
    compiled = torch.compile(f, fullgraph=True)(*compiled_args)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_args, eager_args, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gated_deltanet_layer_on_cuda_matches_cpu(gate):
    from rlx_torch.nn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16, num_v_heads=4, gate=gate)
    x = torch.randn(2, 50, 64)
    gpu = GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=16, num_v_heads=4, gate=gate)
    gpu.load_state_dict(layer.state_dict())
    gpu.to(CUDA)
    xc, xg = x.clone().requires_grad_(), x.to(CUDA).requires_grad_()
    yc, yg = layer(xc), gpu(xg)
    yc = yc[0] if isinstance(yc, tuple) else yc
    yg = yg[0] if isinstance(yg, tuple) else yg
    torch.testing.assert_close(yg.cpu(), yc, rtol=1e-4, atol=1e-4)
    (yc * yc).sum().backward()
    (yg * yg).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-3, atol=1e-3)
    for (n, pc), pg in zip(layer.named_parameters(), gpu.parameters(), strict=True):
        torch.testing.assert_close(pg.grad.cpu(), pc.grad, rtol=1e-3, atol=1e-3, msg=n)


def test_demo_runs_on_cuda(tmp_path):
    from rlx_torch import demo

    summary = demo.main(["--steps", "40", "--finetune-steps", "4", "--batch-size", "8",
                         "--seq-len", "32", "--hidden-size", "64", "--layers", "1",
                         "--eval-bytes", "2048", "--sample-bytes", "24", "--lr", "0.03",
                         "--adam-lr", "0.01", "--eval-every", "10", "--no-progress",
                         "--device", "cuda", "--out", str(tmp_path / "run")])
    assert summary["device"] == "cuda"
    assert summary["last_train_bpb"] < summary["first_train_bpb"]


# ---- fla's kernels (where fla imports: fla-core carried as a wheel) ----

def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 (fla or its Triton may refuse this device)
        pytest.skip(f"fla is not importable here: {e}")
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # noqa: BLE001 (older fla: no KDA)
        chunk_kda = None
    return chunk_gated_delta_rule, chunk_kda


# fla's own tolerances (tests/ops/test_gated_delta.py): relative RMS error
FLA_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008,
           "dinitial_state": 0.008, "dbeta": 0.02, "dg": 0.02}


@pytest.mark.parametrize(("per_channel", "chunked"), [(False, False), (False, True),
                                                     (True, False), (True, True)])
def test_matches_fla(per_channel, chunked, monkeypatch, tmp_path):
    monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", "1" if chunked else "0")
    chunk_gdn, chunk_kda = _fla()
    if per_channel and chunk_kda is None:
        pytest.skip("this fla has no KDA kernel")
    B, T, H, K, V = 2, 1000, 4, 128, 128
    inputs = make_inputs(B=B, T=T, H=H, HV=H, K=K, V=V, per_channel=per_channel,
                         dtype=torch.bfloat16, state=True, normalize_k=False)
    cot = cotangents(inputs)
    ours = forward_backward(rlx_torch.gated_delta_rule, to(inputs, CUDA), cot, use_qk_l2norm=True)
    ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64), cot,
                           use_qk_l2norm=True)
    theirs, crash = _fla_in_subprocess(per_channel, inputs, cot, tmp_path)
    if crash is not None:
        # ours is still held to fla's tolerances against the float64 reference
        for name, tol in FLA_TOL.items():
            err = rel_rms(ours[name], ref[name])
            assert err <= tol, f"{name}: rel RMS {err:.4f} against float64 > {tol}"
        pytest.skip(f"fla's kernel crashed or refused to run on this GPU, so only the float64 "
                    f"reference was compared: {crash}")
    # every error first, so that a failure shows the whole picture
    errs = {name: (rel_rms(ours[name], ref[name]), rel_rms(theirs[name], ref[name]),
                   rel_rms(ours[name], theirs[name])) for name in FLA_TOL}
    table = "; ".join(f"{n}: ours {o:.2e}, fla {f:.2e}, ours-fla {d:.2e}"
                      for n, (o, f, d) in errs.items())
    # streamed as well (seen with -s), so that a run stopped by a time limit still shows it
    import fla

    print(f"test_matches_fla[per_channel={per_channel}, chunked={chunked}], fla "
          f"{getattr(fla, '__version__', '?')}: {table}", flush=True)
    for name, tol in FLA_TOL.items():
        ours_err, fla_err, err = errs[name]
        assert ours_err <= tol, f"{name}: rel RMS {ours_err:.4f} against float64 > {tol} ({table})"
        # against fla: within fla's tolerance on top of fla's own error
        assert err <= tol + fla_err, (
            f"{name}: rel RMS {err:.4f} against fla > {tol} + {fla_err:.4f} ({table})")


def _fla_in_subprocess(per_channel, inputs, cot, tmp_path):
    """fla's outputs and gradients, computed in a child process: an illegal memory access in
    one of fla's kernels (seen with fla 0.4.2's chunk_kda backward on an H200, Triton 3.6)
    leaves a process's CUDA context unusable. Returns (results, None), or (None, the last line)
    when the child died of a CUDA error or fla refused this GPU with its Triton (fla 0.5.2's
    per-head backward on Hopper under Triton < 3.7.1); any other failure fails the test."""
    src, dst = tmp_path / "fla_inputs.pt", tmp_path / "fla_outputs.pt"
    torch.save({"inputs": inputs, "cot": cot}, src)
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import test_gated_delta_cuda as m; "
            "m._fla_child(sys.argv[3], sys.argv[4], sys.argv[5] == '1')")
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent), str(src),
                           str(dst), "1" if per_channel else "0"],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        if any("CUDA" in ln and ("illegal" in ln or "misaligned" in ln) for ln in lines):
            return None, lines[-1][:300]
        if lines and _fla_refuses(lines[-1]):
            return None, lines[-1][:300]
        pytest.fail(f"fla's side failed:\n{proc.stderr[-3000:]}")
    return torch.load(dst), None


def _fla_refuses(last_line):
    """Whether a child's last line is fla declining this GPU with its Triton (fla 0.5.2:
    "RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for
    gated chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1 or install tilelang")."""
    return last_line.startswith("RuntimeError: Triton") and "upgrade Triton" in last_line


def test_an_fla_refusal_is_told_apart_from_a_failure():
    refusal = ("RuntimeError: Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect "
               "results for gated chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= "
               "3.7.1 or install tilelang: `pip install tilelang`")
    assert _fla_refuses(refusal)
    assert not _fla_refuses("RuntimeError: shape mismatch")
    assert not _fla_refuses("AssertionError: Triton")


def _fla_child(src, dst, per_channel):
    chunk_gdn, chunk_kda = _fla()
    saved = torch.load(src)

    def fla_fn(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
        fn = chunk_kda if per_channel else chunk_gdn
        return fn(q, k, v, g, beta, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  use_qk_l2norm_in_kernel=use_qk_l2norm)

    out = forward_backward(fla_fn, to(saved["inputs"], CUDA), saved["cot"], use_qk_l2norm=True)
    torch.save({n: t.detach().cpu() for n, t in out.items()}, dst)


def test_chunked_kernels_are_the_default_and_the_token_path_is_selectable(monkeypatch):
    """With nothing set, 16-bit inputs with a per-head gate take the chunked kernels (bitwise
    equal to RLX_CUDA_GATED_DELTA_CHUNKED=1, not to the token recurrence that =0 selects); both
    paths match the float64 reference."""
    inputs = to(make_inputs(B=2, T=130, H=2, HV=2, K=64, V=48, state=True,
                            dtype=torch.bfloat16), CUDA)
    cot = cotangents(inputs)
    runs = {}
    for flag in (None, "1", "0"):
        if flag is None:
            monkeypatch.delenv("RLX_CUDA_GATED_DELTA_CHUNKED", raising=False)
        else:
            monkeypatch.setenv("RLX_CUDA_GATED_DELTA_CHUNKED", flag)
        runs[flag] = forward_backward(rlx_torch.gated_delta_rule, inputs, cot, True)
    for name, t in runs[None].items():
        assert torch.equal(t, runs["1"][name]), name
    assert not torch.equal(runs[None]["o"], runs["0"]["o"])
    assert not torch.equal(runs[None]["dk"], runs["0"]["dk"])
    ref = forward_backward(reference.gated_delta_rule, to(inputs, "cpu", torch.float64), cot, True)
    compare(runs[None], ref, TOL[torch.bfloat16], "default (chunked) path")
    compare(runs["0"], ref, TOL[torch.bfloat16], "token path")
