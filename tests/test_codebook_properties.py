"""Property-based tests of rlx::codebook_matmul (hypothesis, derandomized: the same bounded
set of examples on every run) against a float64 reference written here from the definition

    out[..., j] = s_j * sum_{g, m, t} x[..., g*D + t] * C[m, I[j, g, m], t] + b_j

(an einsum over gathered entries; independent of rlx_torch/ops/reference.py), over empty
dims, odd sizes, stride-0, offset and permuted inputs, every float dtype and index dtype, and
every requires_grad combination. Comparisons are overflow-aware: the tolerance scales with
sum |terms| (the rounding-error bound of a sum), and a float16/bfloat16 result whose exact
value is past the dtype's range must be an infinity of the right sign."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rlx_torch

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.float16: 2.0**-10,
       torch.bfloat16: 2.0**-7}
MAX_E = {torch.uint8: 256, torch.int16: 65536, torch.uint16: 65536}


def exact(x, indices, codebook, scales, bias):
    """(value, sum of |terms|) in float64 for x [..., K]."""
    idx = indices.to(torch.int64) % MAX_E[indices.dtype]
    if idx.dim() == 2:
        idx, codebook = idx.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, m = idx.shape
    d = codebook.shape[-1]
    cb = codebook.double()
    picked = cb[torch.arange(m).view(1, 1, m), idx]  # [N, G, M, D]
    xg = x.double().reshape(*x.shape[:-1], groups, d)
    s = scales.double() if scales is not None else torch.ones(n, dtype=torch.float64)
    b = bias.double() if bias is not None else torch.zeros(n, dtype=torch.float64)
    value = torch.einsum("...gt,jgmt->...j", xg, picked) * s + b
    size = torch.einsum("...gt,jgmt->...j", xg.abs(), picked.abs()) * s.abs() + b.abs()
    return value, size


def assert_matches(got, value, size, dtype, terms):
    got = got.double()
    big = torch.finfo(dtype).max
    over = value.abs() > big * (1 + EPS[dtype])
    if over.any():
        assert torch.equal(got[over], value[over].sign() * float("inf"))
    ok = ~over & (size < big / 2)
    # accumulation in float32 (float64 for float64) plus one rounding of the output
    acc_eps = EPS[torch.float64] if dtype == torch.float64 else EPS[torch.float32]
    bound = (terms + 2) * acc_eps * size + EPS[dtype] * value.abs() + 1e-30
    err = (got - value).abs()
    assert (err[ok] <= 2 * bound[ok]).all(), float((err[ok] / bound[ok]).max())


def layout(t, kind):
    """t with the same values in another memory layout."""
    if kind == "contiguous" or t.dim() == 0:
        return t
    if kind == "offset":  # a view that starts inside a larger storage
        big = torch.zeros(t.numel() + 7, dtype=t.dtype)
        return big[7:].view(t.shape).copy_(t)
    if kind == "permuted" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "strided":
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    return t


@st.composite
def problems(draw):
    index_dtype = draw(st.sampled_from(list(MAX_E)))
    dtype = draw(st.sampled_from(FLOATS))
    lead = draw(st.lists(st.integers(0, 5), min_size=0, max_size=2))
    rows = 1
    for v in lead:
        rows *= v
    if draw(st.booleans()):  # reach the batch tiles and the dense paths
        lead = [draw(st.sampled_from([0, 1, 2, 3, 7, 9, 17, 40, 70]))]
    n = draw(st.integers(0, 40))
    groups, d, m = draw(st.integers(0, 9)), draw(st.integers(1, 10)), draw(st.integers(1, 3))
    e = draw(st.integers(1, 256 if index_dtype == torch.uint8 else 3000))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1.0, 1.0, 300.0]))  # 300: float16 overflows
    three_d = m > 1 or draw(st.booleans())
    kinds = ["contiguous", "offset", "permuted", "strided", "stride0"]
    return dict(index_dtype=index_dtype, dtype=dtype, lead=lead, n=n, groups=groups, d=d, m=m,
                e=e, seed=seed, magnitude=magnitude, three_d=three_d,
                x_kind=draw(st.sampled_from(kinds)), other_kind=draw(st.sampled_from(kinds[:4])),
                scales=draw(st.booleans()), bias=draw(st.booleans()),
                grads=draw(st.lists(st.booleans(), min_size=4, max_size=4)))


def build(p):
    g = torch.Generator().manual_seed(p["seed"])
    dtype, k = p["dtype"], p["groups"] * p["d"]
    lead = p["lead"]
    if p["x_kind"] == "stride0" and lead and lead[0] > 0:  # every row the same: stride 0
        x = (torch.randn(1, *lead[1:], k, generator=g) * p["magnitude"]).to(dtype)
        x = x.expand(*lead, k)
    else:
        x = layout((torch.randn(*lead, k, generator=g) * p["magnitude"]).to(dtype), p["x_kind"])
    n, m, e = p["n"], p["m"], p["e"]
    codes = torch.randint(0, e, (n, p["groups"], m), generator=g)
    if p["index_dtype"] == torch.uint8:
        idx = codes.to(torch.uint8)
    else:
        idx = (codes - 65536 * (codes >= 32768)).to(torch.int16).view(p["index_dtype"])
    cb = (torch.randn(m, e, p["d"], generator=g) * p["magnitude"]).to(dtype)
    if not p["three_d"]:
        idx, cb = idx[:, :, 0], cb[0]
    idx, cb = layout(idx, p["other_kind"]), layout(cb, p["other_kind"])
    s = layout((torch.rand(n, generator=g) + 0.5).to(dtype), p["other_kind"]) if p["scales"] \
        else None
    b = layout(torch.randn(n, generator=g).to(dtype), p["other_kind"]) if p["bias"] else None
    return x, idx, cb, s, b


@settings(max_examples=120, derandomize=True, deadline=None, database=None)
@given(problems())
def test_forward_and_gradients_match_the_definition(p):
    x, idx, cb, s, b = build(p)
    dtype = p["dtype"]
    terms = p["groups"] * p["d"] * p["m"]
    flags = [p["grads"][0], p["grads"][1], p["grads"][2] and s is not None,
             p["grads"][3] and b is not None]
    leaves = [t.detach().clone().requires_grad_(f) if t is not None else None
              for t, f in zip((x, cb, s, b), flags, strict=True)]
    out = rlx_torch.codebook_matmul(leaves[0], idx, *leaves[1:])
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], p["n"])
    value, size = exact(x, idx, cb, s, b)
    assert_matches(out, value, size, dtype, terms)
    if not any(flags) or p["magnitude"] > 1:
        assert not out.requires_grad or any(flags)
        return
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    wanted = [t for t, f in zip(leaves, flags, strict=True) if f]
    got = torch.autograd.grad(out, wanted, grad_out)
    up = [t.detach().double().requires_grad_(f) if t is not None else None
          for t, f in zip((x, cb, s, b), flags, strict=True)]
    ref_out, _ = exact(up[0], idx, *up[1:])
    want = torch.autograd.grad(ref_out, [t for t, f in zip(up, flags, strict=True) if f],
                               grad_out.double())
    for gg, w in zip(got, want, strict=True):
        assert gg.dtype == dtype and gg.shape == w.shape
        scale = w.abs().max().item() + 1.0 if w.numel() else 1.0
        rows = max(1, out.numel() // max(p["n"], 1))
        tol = (terms + p["n"] + rows + 2) * (EPS[torch.float32] if dtype != torch.float64
                                             else EPS[torch.float64]) + 2 * EPS[dtype]
        torch.testing.assert_close(gg.double() / scale, w / scale, atol=4 * tol, rtol=0)


@settings(max_examples=40, derandomize=True, deadline=None, database=None)
@given(problems())
def test_eager_and_meta_agree_on_shapes_and_errors(p):
    x, idx, cb, s, b = build(p)
    args = (x, idx, cb, s, b)
    meta = [t.to("meta") if t is not None else None for t in args]
    out = torch.ops.rlx.codebook_matmul(*args)
    fake = torch.ops.rlx.codebook_matmul(*meta)
    assert fake.shape == out.shape and fake.dtype == out.dtype
    # a broken variant: K no longer a multiple of D (when D > 1) fails alike on both
    if p["d"] > 1 and x.shape[-1] > 0:
        bad_x = x[..., :-1]
        with pytest.raises(ValueError) as eager_err:
            torch.ops.rlx.codebook_matmul(bad_x, idx, cb, s, b)
        with pytest.raises(ValueError) as meta_err:
            torch.ops.rlx.codebook_matmul(bad_x.to("meta"), *meta[1:])
        assert str(meta_err.value).split(",")[0] in str(eager_err.value)
