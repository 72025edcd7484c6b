"""Property-based tests of rlx_torch.gated_delta_rule against an independent float64
reference written here from the closed form (not rlx_torch.ops.reference, which could share a
bug): per value head, with D_t = diag(exp g_t) (a scalar per head, or one per key channel),

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T,    o_t = scale S_t^T q_t,

q/k head ``hv // (HV // H)``, the state reset at every cu_seqlens boundary. Hypothesis draws
the shapes (empty batches and sequences, odd sizes), dtypes, memory layouts (permuted,
offset, stride-0), gates, packing and which inputs require grad; the comparison allows for
outputs that overflow the dtype. Bounded and derandomized: the same examples every run."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx_torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# error bound per dtype, relative to the largest in-range reference value of a tensor
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


def closed_form(q, k, v, g, beta, scale, h0, cu, l2norm):
    """The recurrence above in float64 with explicit K x K matrices."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    head = torch.arange(HV) // (HV // H)
    decay = (g if g.dim() == 4 else g[..., None].expand(B, T, HV, K)).exp()
    bounds = ([(b, 0, T) for b in range(B)] if cu is None
              else [(0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)])
    eye = torch.eye(K, dtype=torch.float64)
    rows, finals = [], []
    for n, (b, bos, eos) in enumerate(bounds):
        S = (torch.zeros(HV, K, V, dtype=torch.float64) if h0 is None else h0[n].double())
        for t in range(bos, eos):
            kt, qt = k[b, t, head], q[b, t, head]  # [HV, K]
            bt = beta[b, t][:, None, None]
            erase = eye - bt * kt[:, :, None] * kt[:, None, :]
            S = erase @ (decay[b, t][:, :, None] * S) + bt * kt[:, :, None] * v[b, t][:, None, :]
            rows.append((b, t, scale * torch.einsum("hkv,hk->hv", S, qt)))
        finals.append(S)
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    if rows:
        bs, ts, vals = zip(*rows, strict=True)
        o = o.index_put((torch.tensor(bs), torch.tensor(ts)), torch.stack(vals))
    ht = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, dtype=torch.float64)
    return o, ht


def with_layout(values, layout, dim_t):
    """A leaf and a tensor equal to ``values`` with the given memory layout made from it."""
    if layout == "permuted":
        leaf = values.permute(*reversed(range(values.dim()))).contiguous().requires_grad_()
        return leaf, lambda x: x.permute(*reversed(range(values.dim())))
    if layout == "offset":
        pad = torch.zeros_like(values.narrow(dim_t, 0, min(1, values.shape[dim_t])))
        leaf = torch.cat([pad, values, pad], dim_t).requires_grad_()
        return leaf, lambda x: x.narrow(dim_t, pad.shape[dim_t], values.shape[dim_t])
    if layout == "stride0" and values.shape[dim_t] > 0:  # constant along time
        first = values.narrow(dim_t, 0, 1).clone().requires_grad_()
        return first, lambda x: x.expand(values.shape)
    leaf = values.clone().requires_grad_()
    return leaf, lambda x: x


def expected_close(name, got, want, dtype):
    """Where the float64 value is beyond the dtype's range, the result must overflow too;
    elsewhere it must be close, relative to the largest in-range value."""
    big = torch.finfo(dtype).max if got.dtype == dtype else torch.finfo(got.dtype).max
    got, want = got.double(), want.double()
    assert got.shape == want.shape, name
    beyond = want.abs() > big
    assert (got[beyond].abs() >= big / 2).all(), f"{name}: an overflowing value came back finite"
    inside = ~beyond & want.isfinite()
    if inside.any():
        scale = want[inside].abs().max().item() + 1e-30
        err = (got[inside] - want[inside]).abs().max().item()
        assert err <= TOL[dtype] * max(scale, 1.0), f"{name}: error {err:.3g} vs scale {scale:.3g}"


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(DTYPES))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.integers(1, 2))
    K, V = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    varlen = draw(st.booleans())
    if varlen:
        lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        B, T = 1, sum(lengths)
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
    else:
        B, T, cu = draw(st.integers(0, 2)), draw(st.integers(0, 8)), None
    return dict(
        dtype=dtype, B=B, T=T, H=H, HV=HV, K=K, V=V, cu=cu,
        per_channel=draw(st.booleans()), state=draw(st.booleans()),
        l2norm=draw(st.booleans()), chunk=draw(st.sampled_from([1, 2, 3, 64])),
        growth=draw(st.sampled_from([0.0, 0.5])),  # g up to this (> 0: the state grows)
        v_scale=draw(st.sampled_from([1.0, 1.0, 3e4])),  # 3e4: float16 outputs overflow
        scale=draw(st.one_of(st.none(), st.floats(0.1, 2.0))),
        layouts={n: draw(st.sampled_from(["contiguous", "permuted", "offset", "stride0"]))
                 for n in INPUTS},
        grads=draw(st.lists(st.sampled_from(INPUTS), unique=True, max_size=6)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_matches_closed_form(pb):
    dtype = pb["dtype"]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(pb["seed"])
    B, T, H, HV, K, V = (pb[n] for n in ("B", "T", "H", "HV", "K", "V"))
    N = B if pb["cu"] is None else len(pb["cu"]) - 1

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    k = rand(B, T, H, K)
    if not pb["l2norm"]:  # unit keys keep the recurrence contractive, as l2norm does
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-3)
    g_shape = (B, T, HV, K) if pb["per_channel"] else (B, T, HV)
    low = -3.0
    values = {
        "q": rand(B, T, H, K).to(dtype), "k": k.to(dtype),
        "v": (pb["v_scale"] * rand(B, T, HV, V)).to(dtype),
        "g": (low + (pb["growth"] - low) * torch.rand(*g_shape, generator=gen,
                                                      dtype=torch.float64)).to(acc),
        "beta": torch.rand(B, T, HV, generator=gen, dtype=torch.float64).to(acc),
        "initial_state": rand(N, HV, K, V).to(acc) if pb["state"] else None,
    }
    cu = None if pb["cu"] is None else torch.tensor(pb["cu"])
    leaves, made = {}, {}
    for name, val in values.items():
        if val is None:
            leaves[name] = made[name] = None
            continue
        leaf, view = with_layout(val, pb["layouts"][name], dim_t=1 if name != "initial_state"
                                 else 0)
        leaf.requires_grad_(name in pb["grads"])
        leaves[name], made[name] = leaf, view
    args = {n: (made[n](leaves[n]) if leaves[n] is not None else None) for n in INPUTS}
    o, ht = rlx_torch.gated_delta_rule(
        args["q"], args["k"], args["v"], args["g"], args["beta"], scale=pb["scale"],
        initial_state=args["initial_state"], output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm=pb["l2norm"], chunk_size=pb["chunk"])
    assert o.dtype == dtype and o.shape == (B, T, HV, V)
    assert ht.dtype == acc and ht.shape == (N, HV, K, V)

    ref_leaves = {n: (leaves[n].detach().double().requires_grad_(leaves[n].requires_grad)
                      if leaves[n] is not None else None) for n in INPUTS}
    ref_args = {n: (made[n](ref_leaves[n]) if ref_leaves[n] is not None else None)
                for n in INPUTS}
    scale = K ** -0.5 if pb["scale"] is None else pb["scale"]
    o_ref, ht_ref = closed_form(ref_args["q"], ref_args["k"], ref_args["v"], ref_args["g"],
                                ref_args["beta"], scale, ref_args["initial_state"], cu,
                                pb["l2norm"])
    expected_close("o", o, o_ref, dtype)
    expected_close("final_state", ht, ht_ref, dtype)

    wanted = [n for n in INPUTS if leaves[n] is not None and leaves[n].requires_grad]
    if not wanted or not (o_ref.isfinite().all() and (o_ref.abs() < 1e4).all()):
        return  # gradients of overflowing outputs are not compared
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    gh = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * go).sum() + (ht.double() * gh).sum()
    loss_ref = (o_ref * go).sum() + (ht_ref * gh).sum()
    grads = torch.autograd.grad(loss, [leaves[n] for n in wanted], allow_unused=True)
    grads_ref = (torch.autograd.grad(loss_ref, [ref_leaves[n] for n in wanted],
                                     allow_unused=True)
                 if loss_ref.requires_grad else [None] * len(wanted))  # (nothing to differentiate)
    for name, got, want in zip(wanted, grads, grads_ref, strict=True):
        if want is None:
            want = torch.zeros_like(ref_leaves[name])
        assert got is not None, f"d{name} missing"
        assert got.shape == leaves[name].shape and got.dtype == leaves[name].dtype, name
        expected_close("d" + name, got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_closed_form_is_the_recurrence(dtype):
    """The oracle itself against a hand-computed two-token case (K = V = 1)."""
    q = torch.tensor([[[[1.0]], [[2.0]]]], dtype=dtype)
    k = torch.ones(1, 2, 1, 1, dtype=dtype)
    v = torch.tensor([[[[3.0]], [[5.0]]]], dtype=dtype)
    g = torch.log(torch.tensor([[[0.5], [0.25]]], dtype=torch.float64))
    beta = torch.tensor([[[0.5], [1.0]]], dtype=torch.float64)
    o, ht = closed_form(q, k, v, g, beta, 1.0, None, None, False)
    s1 = 0.5 * 3.0  # (1 - 0.5) * 0.5 * 0 + 0.5 * 3
    s2 = (1 - 1.0) * 0.25 * s1 + 1.0 * 5.0
    assert math.isclose(o[0, 0, 0, 0].item(), s1) and math.isclose(o[0, 1, 0, 0].item(), 2 * s2)
    assert math.isclose(ht.item(), s2)
