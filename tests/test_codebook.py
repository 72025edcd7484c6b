"""rlx::codebook_matmul and its backward against the plain-PyTorch reference."""

import pytest
import torch

import rlx_torch
from rlx_torch.ops import reference

HALF_TOL = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def make_inputs(
    rows, n, groups, d=8, e=256, m=1, dtype=torch.float32, scales=True, bias=True, seed=0
):
    gen = torch.Generator().manual_seed(seed)
    lead = rows if isinstance(rows, tuple) else (rows,)
    x = torch.randn(*lead, groups * d, generator=gen).to(dtype)
    shape = (n, groups, m) if m > 1 else (n, groups)
    indices = torch.randint(0, e, shape, generator=gen, dtype=torch.uint8)
    cb_shape = (m, e, d) if m > 1 else (e, d)
    codebook = torch.randn(cb_shape, generator=gen).to(dtype)
    s = (torch.rand(n, generator=gen) + 0.5).to(dtype) if scales else None
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, indices, codebook, s, b


def tolerances(dtype):
    if dtype == torch.float64:
        return 1e-10, 1e-10
    if dtype == torch.float32:
        return 1e-4, 1e-4
    return HALF_TOL[dtype]


def reference_in_float64(x, indices, codebook, s, b):
    up = [t.double() if t is not None else None for t in (x, codebook, s, b)]
    return reference.codebook_matmul(up[0], indices, up[1], up[2], up[3])


# Row counts reach every batch-tile shape of the CPU kernel (1, 8, 16 and 32 rows per tile);
# 70 rows with N = 37 take the dense (dequantize + GEMM) path, 70 x 700 the lookup table;
# few rows with many groups split K into chunks.
SHAPES = [
    # rows, N, K/D, D, E, M
    (1, 37, 5, 8, 256, 1),
    (2, 9, 3, 4, 17, 2),
    (5, 33, 7, 8, 256, 2),
    (16, 21, 9, 3, 100, 1),
    (23, 40, 6, 8, 256, 1),
    (70, 37, 6, 8, 256, 2),
    (70, 700, 6, 8, 64, 1),
    ((2, 3, 7), 15, 4, 16, 31, 1),
    # K split into several group chunks (the last one short), reduced in chunk order.
    (3, 29, 70, 8, 256, 2),
    (1, 45, 300, 4, 40, 1),
    # Two batch tiles, each split into K chunks whose sums are added by several reduction
    # items (N over 512 output rows, not a multiple of 16).
    (20, 1100, 130, 8, 256, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_reference(shape, dtype):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make_inputs(rows, n, groups, d, e, m, dtype)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], n)
    want = reference_in_float64(x, idx, cb, s, b)
    atol, rtol = tolerances(dtype)
    torch.testing.assert_close(out.double(), want, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("scales,bias", [(False, False), (True, False), (False, True)])
def test_optional_scales_and_bias(scales, bias):
    x, idx, cb, s, b = make_inputs(4, 11, 5, scales=scales, bias=bias)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    torch.testing.assert_close(out, reference.codebook_matmul(x, idx, cb, s, b))


def test_non_contiguous_inputs():
    _, idx, cb, s, b = make_inputs(6, 13, 4, m=2)
    x_transposed = torch.randn(32, 6).t()
    x_strided = torch.randn(2, 6, 64)[:, :, ::2]
    idx_nc = idx.transpose(0, 1).contiguous().transpose(0, 1)
    cb_nc = cb.transpose(1, 2).contiguous().transpose(1, 2)
    s_nc = torch.stack([s, s], 1)[:, 0]
    for x in (x_transposed, x_strided):
        assert not x.is_contiguous()
        out = rlx_torch.codebook_matmul(x, idx_nc, cb_nc, s_nc, b)
        torch.testing.assert_close(out, reference.codebook_matmul(x, idx, cb, s, b))


def test_empty_batch_and_empty_output():
    x, idx, cb, s, b = make_inputs(0, 7, 3)
    x.requires_grad_()
    cb.requires_grad_()
    s.requires_grad_()
    b.requires_grad_()
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.shape == (0, 7)
    gx, gc, gs, gb = torch.autograd.grad(out.sum(), (x, cb, s, b))
    assert gx.shape == (0, 24)
    for g, like in ((gc, cb), (gs, s), (gb, b)):
        assert g.shape == like.shape and not g.any()
    x, idx, cb, s, b = make_inputs(3, 0, 2)
    assert rlx_torch.codebook_matmul(x, idx, cb, s, b).shape == (3, 0)


@pytest.mark.parametrize("rows", [1, 5, 20, 40])
def test_no_input_features_gives_the_bias(rows):
    # K = 0 (no groups): every sum is empty, whatever the kernels' buffers held from the call
    # before (the same tile shape, with data, runs first).
    rlx_torch.codebook_matmul(*make_inputs(rows, 9, 4))
    x, idx, cb, s, b = make_inputs(rows, 9, 0)
    assert x.shape == (rows, 0) and idx.shape == (9, 0)
    torch.testing.assert_close(rlx_torch.codebook_matmul(x, idx, cb, s, b),
                               b.expand(rows, 9), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[5:], ids=str)
def test_backward_matches_reference(shape, dtype):
    rows, n, groups, d, e, m = shape
    inputs = make_inputs(rows, n, groups, d, e, m, dtype)
    x, idx, cb, s, b = (t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs)
    grad_out = torch.randn(*x.shape[:-1], n).to(dtype)
    got = torch.autograd.grad(rlx_torch.codebook_matmul(x, idx, cb, s, b), (x, cb, s, b), grad_out)
    up = [t.detach().double().requires_grad_() for t in (x, cb, s, b)]
    want_out = reference.codebook_matmul(up[0], idx, up[1], up[2], up[3])
    want = torch.autograd.grad(want_out, up, grad_out.double())
    atol, rtol = tolerances(dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        scale = w.abs().max().clamp_min(1)
        torch.testing.assert_close(g.double() / scale, w / scale, atol=atol * 10, rtol=rtol)


def test_backward_output_mask():
    x, idx, cb, s, _ = make_inputs(3, 10, 4)
    grad_out = torch.randn(3, 10)
    full = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
    for bit in range(4):
        mask = [i == bit for i in range(4)]
        part = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
        for i, g in enumerate(part):
            if i == bit:
                assert torch.equal(g, full[i])
            else:
                assert g.shape == (0,)


@pytest.mark.parametrize("rows,m", [(3, 1), (18, 2)])
def test_gradcheck(rows, m):
    x, idx, cb, s, b = make_inputs(rows, 7, 3, d=4, e=5, m=m, dtype=torch.float64)
    args = [t.requires_grad_() for t in (x, cb, s, b)]

    def fn(x, cb, s, b):
        return rlx_torch.codebook_matmul(x, idx, cb, s, b)

    assert torch.autograd.gradcheck(fn, args)


def test_opcheck():
    x, idx, cb, s, b = make_inputs(5, 9, 3, d=4, e=7, m=2)
    torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, idx, cb, s, b))
    torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x[0], idx, cb, None, None))
    grad_out = torch.randn(5, 9)
    for mask in ([True, True, True, True], [True, False, False, True]):
        torch.library.opcheck(
            torch.ops.rlx.codebook_matmul_backward.default, (grad_out, x, idx, cb, s, mask)
        )


@pytest.mark.parametrize("rows,n,groups,m", [(40, 300, 24, 2), (20, 1100, 130, 1)])
def test_deterministic_across_calls_and_thread_counts(rows, n, groups, m):
    x, idx, cb, s, b = make_inputs(rows, n, groups, m=m)
    grad_out = torch.randn(rows, n)
    mask = [True, True, False, False]
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    grads = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
    threads = torch.get_num_threads()
    try:
        for n in (1, max(threads, 2)):
            torch.set_num_threads(n)
            assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), out)
            again = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
            for g, h in zip(again, grads, strict=True):
                assert torch.equal(g, h)
    finally:
        torch.set_num_threads(threads)


def test_half_inputs_accumulate_in_float32():
    # 4096 products: float16 accumulation would be off by far more than one output rounding.
    x, idx, cb, s, b = make_inputs(2, 8, 512, dtype=torch.float16)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b).double()
    want = reference_in_float64(x, idx, cb, s, b)
    ulp = want.abs() * 2.0**-10 + 1e-3
    assert ((out - want).abs() <= ulp).all()


def test_compile_fullgraph():
    layer = rlx_torch.nn.CodebookLinear(32, 24, entry_dim=4, num_entries=16, num_codebooks=2)
    mlp = torch.nn.Sequential(layer, torch.nn.GELU(), torch.nn.Linear(24, 5))
    x = torch.randn(3, 7, 32)
    eager_out = mlp(x)
    eager_out.square().sum().backward()
    eager_grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager_out)
    for p, g in zip(mlp.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_compile_inductor_dynamic_batch():
    layer = rlx_torch.nn.CodebookLinear(16, 8, entry_dim=4, num_entries=8)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (2, 5):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), layer(x))


# ---- bad input ----


def bad(**changes):
    x, idx, cb, s, b = make_inputs(3, 10, 4, e=16)
    args = {"x": x, "indices": idx, "codebook": cb, "scales": s, "bias": b}
    args.update(changes)
    return args


BAD_INPUTS = [
    ("indices must be uint8", bad(indices=torch.zeros(10, 4, dtype=torch.int64))),
    ("indices must be uint8", bad(indices=torch.zeros(10, 4, dtype=torch.int8))),
    ("multiple of the codebook entry dim", bad(x=torch.randn(3, 30))),
    ("indices must have shape", bad(indices=torch.zeros(10, 5, dtype=torch.uint8))),
    ("1 to 256 entries", bad(codebook=torch.randn(257, 8))),
    ("indices must be < E=16", bad(indices=torch.full((10, 4), 16, dtype=torch.uint8))),
    (
        "codebook has 2 codebooks",
        bad(indices=torch.zeros(10, 4, 3, dtype=torch.uint8), codebook=torch.randn(2, 16, 8)),
    ),
    ("codebook must have shape", bad(codebook=torch.randn(1, 16, 8))),
    ("scales must have shape", bad(scales=torch.ones(11))),
    ("bias must have shape", bad(bias=torch.ones(10, 1))),
    ("codebook must have x's dtype", bad(codebook=torch.randn(16, 8, dtype=torch.float64))),
    ("scales must have x's dtype", bad(scales=torch.ones(10, dtype=torch.float16))),
    ("x must be float32", bad(x=torch.ones(3, 32, dtype=torch.int32))),
    ("bias must be on x's device", bad(bias=torch.ones(10, device="meta"))),
]


@pytest.mark.parametrize("match,args", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_input_raises_value_error(match, args):
    with pytest.raises(ValueError, match=match):
        torch.ops.rlx.codebook_matmul(*args.values())
    with pytest.raises(ValueError, match=match):
        rlx_torch.codebook_matmul(**args)


def test_bad_backward_arguments():
    x, idx, cb, s, _ = make_inputs(3, 10, 4)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        torch.ops.rlx.codebook_matmul_backward(torch.ones(3, 9), x, idx, cb, s, [True] * 4)
    with pytest.raises(ValueError, match="grad_out must have x's dtype"):
        torch.ops.rlx.codebook_matmul_backward(
            torch.ones(3, 10, dtype=torch.float64), x, idx, cb, s, [True] * 4
        )
    with pytest.raises(ValueError, match="needs scales"):
        torch.ops.rlx.codebook_matmul_backward(torch.ones(3, 10), x, idx, cb, None, [True] * 4)


def test_aqlm_layout_maps_onto_the_op():
    # AQLM stores codes as int8 (>= 128 wrapped negative), codebooks as
    # [M, 2**8, out_group=1, in_group=D] and scales as [N, 1, 1, 1] (docs/codebook.md).
    gen = torch.Generator().manual_seed(0)
    n, groups, m, d = 12, 5, 2, 8
    codes_u8 = torch.randint(0, 256, (n, groups, m), generator=gen, dtype=torch.uint8)
    codes = codes_u8.view(torch.int8)
    assert (codes < 0).any()
    codebooks = torch.randn(m, 256, 1, d, generator=gen)
    scales = torch.rand(n, 1, 1, 1, generator=gen)
    x = torch.randn(3, groups * d, generator=gen)
    # AQLM's dequantization: codes % 2**nbits index each codebook, entries summed, rows scaled.
    unwrapped = codes.long() % 256
    weight = sum(codebooks[i, unwrapped[:, :, i], 0, :] for i in range(m)).reshape(n, -1)
    want = x @ (weight * scales.reshape(n, 1)).T
    out = rlx_torch.codebook_matmul(
        x, codes.view(torch.uint8), codebooks[:, :, 0, :], scales.reshape(-1)
    )
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---- the fakes apply the kernels' rules: eager, meta and compiled calls fail alike ----

# Left out: a value check (eager only) and a device mix (all on meta is no mix).
VALUE_CHECKS = {"indices must be < E=16", "bias must be on x's device"}


@pytest.mark.parametrize("match,args", [(m, a) for m, a in BAD_INPUTS if m not in VALUE_CHECKS],
                         ids=[m for m, _ in BAD_INPUTS if m not in VALUE_CHECKS])
def test_bad_input_fails_alike_on_meta_and_compiled(match, args):
    meta = {k: v.to("meta") if v is not None else None for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        torch.ops.rlx.codebook_matmul(*meta.values())
    compiled = torch.compile(torch.ops.rlx.codebook_matmul, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        compiled(*args.values())


@pytest.mark.parametrize("which", ["x", "indices", "codebook", "scales", "bias", "grad_out"])
def test_mixed_devices_with_meta_are_rejected_on_every_path(which):
    x, idx, cb, s, b = make_inputs(3, 10, 4, e=16)
    g = torch.randn(3, 10)
    t = dict(x=x, indices=idx, codebook=cb, scales=s, bias=b, grad_out=g)
    t[which] = t[which].to("meta")
    if which != "grad_out":
        with pytest.raises(ValueError, match="device"):
            torch.ops.rlx.codebook_matmul(t["x"], t["indices"], t["codebook"], t["scales"],
                                          t["bias"])
        with pytest.raises(ValueError, match="device"):
            rlx_torch.codebook_matmul(t["x"].requires_grad_(t["x"].device.type == "cpu"),
                                      t["indices"], t["codebook"], t["scales"], t["bias"])
    if which != "bias":
        with pytest.raises(ValueError, match="device"):
            torch.ops.rlx.codebook_matmul_backward(t["grad_out"], t["x"].detach(), t["indices"],
                                                   t["codebook"], t["scales"], [True] * 4)


def test_entry_dim_zero_names_the_argument():
    x, idx, _, _, _ = make_inputs(3, 10, 4, e=16)
    for device in ("cpu", "meta"):
        with pytest.raises(ValueError, match="entry dim D must be >= 1"):
            torch.ops.rlx.codebook_matmul(x.to(device), idx.to(device),
                                          torch.ones(16, 0, device=device), None, None)


# ---- non-finite entries: the lookup-table and dense paths agree with the dense product ----


@pytest.mark.parametrize("rows", [1, 5, 20, 70])  # table tiles of 1, 8, 16 rows; dense path
def test_non_finite_unselected_codebook_entry_keeps_grad_x_finite(rows):
    x, idx, cb, s, b = make_inputs(rows, 37, 6, e=256, dtype=torch.float64)
    idx[idx == 7] = 8
    cb[7] = float("inf")  # no index selects entry 7
    cb[9, 2] = float("nan")
    xr, cbr = x.clone().requires_grad_(), cb.clone().requires_grad_()
    gx, gc = torch.autograd.grad(rlx_torch.codebook_matmul(xr, idx, cbr, s, b).sum(), (xr, cbr))
    xw, cbw = x.clone().requires_grad_(), cb.clone().requires_grad_()
    wx, wc = torch.autograd.grad(reference.codebook_matmul(xw, idx, cbw, s, b).sum(), (xw, cbw))
    torch.testing.assert_close(gx, wx, equal_nan=True)
    torch.testing.assert_close(gc, wc, equal_nan=True)
    assert gx[:, 8:16].isfinite().all() == wx[:, 8:16].isfinite().all()


@pytest.mark.parametrize("rows", [1, 5, 20, 70])
def test_non_finite_x_gives_no_gradient_to_unselected_entries(rows):
    x, idx, cb, s, b = make_inputs(rows, 37, 6, e=256, dtype=torch.float64)
    idx[idx == 7] = 8
    x[0, 3] = float("inf")
    gc_ours = torch.ops.rlx.codebook_matmul_backward(torch.ones(rows, 37, dtype=torch.float64),
                                                     x, idx, cb, s, [False, True, False, False])[1]
    cbw = cb.clone().requires_grad_()
    (wc,) = torch.autograd.grad(reference.codebook_matmul(x, idx, cbw, s, b).sum(), cbw)
    torch.testing.assert_close(gc_ours, wc, equal_nan=True)
    assert torch.equal(gc_ours[7], torch.zeros(8, dtype=torch.float64))
