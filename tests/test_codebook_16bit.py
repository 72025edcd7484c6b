"""rlx::codebook_matmul with 16-bit indices (E up to 65536: AQLM's 1x16 and 2x16 schemes), on
the gather path (small batches) and the dense path (large batches), against a float64
reference written here from the definition."""

import pytest
import torch

import rlx_torch

INDEX_DTYPES = [torch.int16, torch.uint16]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def codes_as_long(indices):
    """Codes read as 16-bit patterns: int16 values modulo 2**16."""
    return indices.to(torch.int64) % 65536


def reference(x, indices, codebook, scales=None, bias=None):
    """float64: out[..., j] = s_j * sum_{g,m} x[..., g*D:(g+1)*D] . C[m, I[j,g,m]] + b_j."""
    idx = codes_as_long(indices)
    if idx.dim() == 2:
        idx, codebook = idx.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, m = idx.shape
    cb = codebook.double()
    weight = torch.zeros(n, groups, cb.shape[-1], dtype=torch.float64)
    for k in range(m):
        weight += cb[k][idx[:, :, k]]
    out = x.double() @ weight.reshape(n, -1).T
    if scales is not None:
        out = out * scales.double()
    if bias is not None:
        out = out + bias.double()
    return out


def make(rows, n, groups, d=8, e=65536, m=1, dtype=torch.float32, index_dtype=torch.int16,
         seed=0, scales=True, bias=True):
    gen = torch.Generator().manual_seed(seed)
    lead = rows if isinstance(rows, tuple) else (rows,)
    x = torch.randn(*lead, groups * d, generator=gen).to(dtype)
    shape = (n, groups, m) if m > 1 else (n, groups)
    codes = torch.randint(0, e, shape, generator=gen, dtype=torch.int64)
    # int16 holds codes >= 2**15 as negative numbers (AQLM's layout); uint16 holds them as is.
    indices = (codes - 65536 * (codes >= 32768)).to(torch.int16)
    if index_dtype == torch.uint16:
        indices = indices.view(torch.uint16)
    cb_shape = (m, e, d) if m > 1 else (e, d)
    codebook = (torch.randn(cb_shape, generator=gen) / (groups * m) ** 0.5).to(dtype)
    s = (torch.rand(n, generator=gen) + 0.5).to(dtype) if scales else None
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, indices, codebook, s, b


# rows (1, 2, 3-4, 5-16: the gather tile shapes; 40: the dense path), N, K/D, D, E, M
SHAPES = [
    (1, 37, 5, 8, 65536, 1),
    (2, 9, 3, 4, 300, 2),
    (3, 33, 7, 16, 5000, 1),
    (5, 21, 9, 3, 1000, 1),  # D = 3: the any-D loops
    (16, 40, 6, 8, 65536, 2),
    (13, 70, 7, 8, 65536, 1),  # a padded batch tile; 64-row items split into 3-row steps
    (4, 13, 5, 8, 700, 3),  # M = 3: the codebook count known only at run time
    (40, 17, 6, 8, 40000, 1),
    ((2, 3, 2), 15, 4, 8, 257, 1),
]


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_backward_match_reference(shape, dtype, index_dtype):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make(rows, n, groups, d, e, m, dtype, index_dtype, seed=n + groups)
    assert (codes_as_long(idx) >= 32768).any() == (e > 32768)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.dtype == dtype and out.shape == (*x.shape[:-1], n)
    tol = TOL[dtype]
    want = reference(x, idx, cb, s, b)
    torch.testing.assert_close(out.double(), want, atol=tol * 10, rtol=tol)

    leaves = [t.clone().requires_grad_() for t in (x, cb, s, b)]
    grad_out = torch.randn(out.shape).to(dtype)
    got = torch.autograd.grad(rlx_torch.codebook_matmul(leaves[0], idx, *leaves[1:]), leaves,
                              grad_out)
    up = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(reference(up[0], idx, *up[1:]), up, grad_out.double())
    for name, g, w in zip(["x", "codebook", "scales", "bias"], got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        scale = w.abs().max().clamp_min(1)
        torch.testing.assert_close(g.double() / scale, w / scale, atol=tol * 10, rtol=tol,
                                   msg=name)


def test_int16_and_uint16_give_the_same_bits():
    x, idx, cb, s, b = make(3, 20, 6, e=65536)
    assert (idx < 0).any()
    a = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert torch.equal(a, rlx_torch.codebook_matmul(x, idx.view(torch.uint16), cb, s, b))


@pytest.mark.parametrize("rows,m", [(1, 1), (3, 2), (20, 1)])
def test_gradcheck(rows, m):
    x, idx, cb, s, b = make(rows, 7, 3, d=4, e=300, m=m, dtype=torch.float64)
    args = [t.requires_grad_() for t in (x, cb, s, b)]
    assert torch.autograd.gradcheck(lambda *a: rlx_torch.codebook_matmul(a[0], idx, *a[1:]), args)


def test_opcheck():
    x, idx, cb, s, b = make(5, 9, 3, d=4, e=700, m=2)
    for ix in (idx, idx.view(torch.uint16)):
        torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, ix, cb, s, b))
        torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x[0], ix, cb, None, None))
        for mask in ([True] * 4, [True, False, False, True], [False, True, False, False]):
            torch.library.opcheck(torch.ops.rlx.codebook_matmul_backward.default,
                                  (torch.randn(5, 9), x, ix, cb, s, mask))


def test_non_contiguous_inputs():
    x, idx, cb, s, b = make(6, 13, 4, e=1000, m=2)
    x_strided = torch.randn(6, 64)[:, ::2]
    idx_nc = idx.transpose(0, 1).contiguous().transpose(0, 1)
    cb_nc = cb.transpose(1, 2).contiguous().transpose(1, 2)
    s_nc = torch.stack([s, s], 1)[:, 0]
    out = rlx_torch.codebook_matmul(x_strided, idx_nc, cb_nc, s_nc, b)
    torch.testing.assert_close(out.double(), reference(x_strided, idx, cb, s, b), atol=1e-4,
                               rtol=1e-4)


def test_empty_dims():
    x, idx, cb, s, b = make(0, 7, 3, e=500)
    leaves = [t.requires_grad_() for t in (x, cb, s, b)]
    out = rlx_torch.codebook_matmul(leaves[0], idx, *leaves[1:])
    assert out.shape == (0, 7)
    gx, gc, gs, gb = torch.autograd.grad(out.sum(), leaves)
    assert gx.shape == (0, 24) and not gc.any() and not gs.any() and not gb.any()
    x, idx, cb, s, b = make(3, 0, 2, e=500)
    assert rlx_torch.codebook_matmul(x, idx, cb, s, b).shape == (3, 0)


def test_deterministic_across_thread_counts():
    x, idx, cb, s, b = make(7, 300, 40, e=65536, m=2)
    grad_out = torch.randn(7, 300)
    mask = [True, True, True, True]
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    grads = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), out)
            again = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
            for g, h in zip(again, grads, strict=True):
                assert torch.equal(g, h)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 5, 40])  # gather tiles and the dense path
def test_out_of_range_index_raises(rows):
    x, idx, cb, s, b = make(rows, 9, 4, e=1000)
    idx[3, 1] = 1000
    with pytest.raises(ValueError, match="indices must be < E=1000"):
        rlx_torch.codebook_matmul(x, idx, cb, s, b)
    with pytest.raises(ValueError, match="indices must be < E=1000"):
        torch.ops.rlx.codebook_matmul_backward(torch.ones(rows, 9), x, idx, cb, s, [True] * 4)
    idx[3, 1] = -1  # 65535 as a 16-bit code
    with pytest.raises(ValueError, match="found 65535"):
        rlx_torch.codebook_matmul(x, idx, cb, s, b)


@pytest.mark.parametrize(
    "match,kwargs",
    [
        ("1 to 65536 entries E", {"codebook": torch.randn(65537, 8)}),
        ("1 to 256 entries E", {"indices": torch.zeros(10, 4, dtype=torch.uint8),
                                "codebook": torch.randn(300, 8)}),
        ("indices must be uint8, int16 or uint16", {"indices": torch.zeros(10, 4,
                                                                           dtype=torch.int32)}),
    ],
)
def test_bad_input(match, kwargs):
    x, idx, cb, s, b = make(3, 10, 4, e=500)
    args = {"x": x, "indices": idx, "codebook": cb, "scales": s, "bias": b, **kwargs}
    for device in ("cpu", "meta"):
        moved = {k: v.to(device) for k, v in args.items()}
        with pytest.raises(ValueError, match=match):
            torch.ops.rlx.codebook_matmul(*moved.values())


def reference_backward(grad_out, x, indices, codebook, scales):
    """float64 dx and dcodebook from the definition: dx = gs @ W, dC[m, c] = sum over the
    (j, g) with I[j, g, m] = c of sum_b gs[b, j] x[b, g]."""
    idx = codes_as_long(indices)
    squeeze = idx.dim() == 2
    if squeeze:
        idx, codebook = idx.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, m = idx.shape
    cb = codebook.double()
    d = cb.shape[-1]
    gs = grad_out.double().reshape(-1, n)
    if scales is not None:
        gs = gs * scales.double()
    xg = x.double().reshape(-1, groups, d)
    weight = torch.zeros(n, groups, d, dtype=torch.float64)
    for k in range(m):
        weight += cb[k][idx[:, :, k]]
    dx = (gs @ weight.reshape(n, -1)).reshape(x.shape)
    per_code = torch.einsum("bj,bgt->jgt", gs, xg)  # [N, G, D]
    dc = torch.zeros_like(cb)
    for k in range(m):
        dc[k].index_add_(0, idx[:, :, k].reshape(-1), per_code.reshape(-1, d))
    return dx, dc.squeeze(0) if squeeze else dc


# rows covering the backward's batch tiles (1; 2-4; 5-16 in tiles of 8, padded), D = 4 and 8
# (the vector kernels) and 16 (the scalar loops), one and two codebooks.
@pytest.mark.parametrize("rows,d,m", [(1, 8, 1), (2, 4, 2), (4, 8, 1), (7, 8, 2), (9, 4, 1),
                                      (16, 8, 1), (13, 16, 1), ((3, 5), 8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
def test_backward_kernels_match_reference(rows, d, m, dtype):
    x, idx, cb, s, _ = make(rows, 53, 37, d=d, e=65536, m=m, dtype=dtype, seed=d + m)
    lead = x.shape[:-1]
    grad_out = torch.randn(*lead, 53).to(dtype)
    want_dx, want_dc = reference_backward(grad_out, x, idx, cb, s)
    tol = TOL[dtype]
    for mask in ([True, True, False, False], [True, False, False, False],
                 [False, True, False, False]):
        dx, dc, _, _ = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, mask)
        for on, got, want, name in ((mask[0], dx, want_dx, "dx"), (mask[1], dc, want_dc, "dc")):
            if not on:
                assert got.numel() == 0, name
                continue
            assert got.dtype == dtype and got.shape == want.shape, name
            scale = want.abs().max().clamp_min(1)
            torch.testing.assert_close(got.double() / scale, want / scale, atol=tol * 10,
                                       rtol=tol, msg=name)


def test_backward_non_contiguous_and_stride0_inputs():
    x, idx, cb, s, _ = make(5, 19, 6, e=40000)
    x_nc = torch.randn(5, 96)[:, ::2]
    g_nc = torch.randn(19, 5).t()
    g_zero = torch.randn(1, 19).expand(5, 19)  # stride 0 over the batch
    for g in (g_nc, g_zero):
        dx, dc, _, _ = torch.ops.rlx.codebook_matmul_backward(g, x_nc, idx, cb, s,
                                                              [True, True, False, False])
        want_dx, want_dc = reference_backward(g, x_nc, idx, cb, s)
        torch.testing.assert_close(dx.double(), want_dx, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dc.double(), want_dc, atol=1e-4, rtol=1e-4)


# float32 x with a float16/bfloat16 codebook (AQLM's checkpoints): rows 1-16 read the half
# entries in the gather kernels (D = 8) or convert them (other D); 40 rows take the dense path.
@pytest.mark.parametrize("cb_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,n,groups,d,e,m", [(1, 37, 5, 8, 65536, 1), (2, 19, 7, 8, 300, 2),
                                                 (5, 33, 4, 8, 65536, 1), (16, 21, 6, 8, 40000, 1),
                                                 (3, 9, 3, 4, 1000, 1), (40, 17, 6, 8, 5000, 1),
                                                 ((2, 3), 11, 4, 8, 65536, 1),
                                                 (1, 23, 5, 8, 900, 3),
                                                 # odd group counts on padded 8-row tiles
                                                 (7, 30, 5, 8, 65536, 1),
                                                 (11, 26, 9, 8, 3000, 2)])
def test_half_codebook_with_float32_x(cb_dtype, rows, n, groups, d, e, m):
    x, idx, cb, s, b = make(rows, n, groups, d, e, m, seed=n * groups)
    cb = cb.to(cb_dtype)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.dtype == torch.float32
    # The half entries are exact in float64: the only error left is float32 accumulation.
    torch.testing.assert_close(out.double(), reference(x, idx, cb, s, b), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, rlx_torch.codebook_matmul(x, idx, cb.float(), s, b),
                               atol=2e-6, rtol=2e-6)
    leaves = [t.clone().requires_grad_() for t in (x, cb, s, b)]
    grad_out = torch.randn(out.shape)
    got = torch.autograd.grad(rlx_torch.codebook_matmul(leaves[0], idx, *leaves[1:]), leaves,
                              grad_out)
    up = [t.detach().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(reference(up[0], idx, *up[1:]), up, grad_out.double())
    tols = {"codebook": 1e-2 if cb_dtype == torch.bfloat16 else 2e-3}
    for name, g, w, leaf in zip(["x", "codebook", "scales", "bias"], got, want, leaves,
                                strict=True):
        assert g.dtype == leaf.dtype and g.shape == w.shape, name
        scale = w.abs().max().clamp_min(1)
        tol = tols.get(name, 2e-5)
        torch.testing.assert_close(g.double() / scale, w / scale, atol=tol, rtol=tol, msg=name)


def test_half_codebook_opcheck_and_empty_batch():
    x, idx, cb, s, b = make(3, 9, 3, d=8, e=700)
    for c in (cb.half(), cb.bfloat16()):
        torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, idx, c, s, b))
        torch.library.opcheck(torch.ops.rlx.codebook_matmul_backward.default,
                              (torch.randn(3, 9), x, idx, c, s, [True] * 4))
        dx, dc, _, _ = torch.ops.rlx.codebook_matmul_backward(
            torch.randn(0, 9), x[:0], idx, c, s, [True, True, False, False])
        assert dx.shape == (0, 24) and dc.dtype == c.dtype and not dc.any()
        assert rlx_torch.codebook_matmul(x[:0], idx, c, s, b).shape == (0, 9)


@pytest.mark.parametrize("rows", [1, 3, 7])  # the one-row kernel and the batch tiles
@pytest.mark.parametrize("group", [1, 4])  # a pair of groups, the odd last group
def test_half_codebook_out_of_range_index_raises(rows, group):
    x, idx, cb, s, b = make(rows, 9, 5, e=1000)
    idx[3, group] = 1000
    for c in (cb.half(), cb.bfloat16()):
        with pytest.raises(ValueError, match="indices must be < E=1000"):
            rlx_torch.codebook_matmul(x, idx, c, s, b)


@pytest.mark.parametrize("x_dtype,cb_dtype,index_dtype", [
    (torch.float64, torch.float16, torch.int16),    # only float32 x takes a half codebook
    (torch.float16, torch.bfloat16, torch.int16),
    (torch.float32, torch.float16, torch.uint8),    # only 16-bit indices
])
def test_half_codebook_bad_dtypes(x_dtype, cb_dtype, index_dtype):
    x, idx, cb, s, b = make(2, 10, 4, e=200)
    x, s, b, cb = x.to(x_dtype), s.to(x_dtype), b.to(x_dtype), cb.to(cb_dtype)
    if index_dtype == torch.uint8:
        idx = idx.to(torch.uint8)
    for device in ("cpu", "meta"):
        args = [t.to(device) for t in (x, idx, cb, s, b)]
        with pytest.raises(ValueError, match="codebook must have x's dtype"):
            torch.ops.rlx.codebook_matmul(*args)


def test_half_codebook_forward_ad_and_double_backward():
    x, idx, cb, s, _ = make(2, 13, 5, e=65536)
    cb = cb.half()
    tc = torch.randn_like(cb, dtype=torch.float32).half()
    _, tangent = torch.func.jvp(lambda c: rlx_torch.codebook_matmul(x, idx, c, s), (cb,), (tc,))
    torch.testing.assert_close(tangent.double(), reference(x, idx, tc, s), atol=2e-5, rtol=2e-5)
    xr = x.clone().requires_grad_()
    cr = cb.clone().requires_grad_()
    (gx,) = torch.autograd.grad(rlx_torch.codebook_matmul(xr, idx, cr, s).square().sum(), xr,
                                create_graph=True)
    (gc,) = torch.autograd.grad(gx.sum(), cr)
    xd = x.double().requires_grad_()
    cd = cb.double().requires_grad_()
    (gxd,) = torch.autograd.grad(reference(xd, idx, cd, s).square().sum(), xd, create_graph=True)
    (gcd,) = torch.autograd.grad(gxd.sum(), cd)
    assert gc.dtype == torch.float16
    scale = gcd.abs().max()
    torch.testing.assert_close(gc.double() / scale, gcd / scale, atol=3e-3, rtol=3e-3)
