"""rlx::codebook_matmul and its backward on CUDA: the CPU tests' inputs and references
(tests/test_codebook.py), moved to the GPU, plus the CUDA kernels' own paths (16-byte x loads,
batch tiles, the dense cuBLAS path above 16 rows). Skips without a CUDA device."""

import pytest
import torch
from test_codebook import (
    BAD_INPUTS,
    SHAPES,
    make_inputs,
    reference_in_float64,
    tolerances,
)
from test_codebook_16bit import TOL as TOL16
from test_codebook_16bit import make as make16
from test_codebook_16bit import reference as reference16
from test_codebook_linear import structured_linear

import rlx_torch
from rlx_torch.nn import CodebookLinear
from rlx_torch.ops import reference

HAS_CUDA_KERNEL = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
    "rlx::codebook_matmul", "CUDA"
)
pytestmark = pytest.mark.skipif(
    not HAS_CUDA_KERNEL, reason="needs a CUDA device and an rlx_torch built with CUDA"
)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# CUDA's own paths on top of the CPU shapes: batch tiles of 1, 4 and 8 rows (16 rows = two
# tiles of 8), D = 8 with 16-byte loads of x and 2 codebooks, E < 256, many groups (lanes
# striding over K), N not a multiple of the rows per block, and batches above 16 rows (dense).
CUDA_SHAPES = [
    # rows, N, K/D, D, E, M
    (1, 67, 64, 8, 256, 1),
    (3, 50, 96, 8, 256, 2),
    (16, 33, 40, 8, 200, 1),
    (9, 130, 17, 5, 256, 3),
    (17, 45, 33, 8, 256, 2),
    (64, 96, 24, 4, 64, 1),
    (4, 19, 10, 24, 16, 1),
    # the tensor-core forward with more K windows (16 groups) than warps, the last one half full
    (2, 41, 264, 8, 256, 1),
    # K > 4096: blocks of 4 row tiles (16 warps up to 8 rows, 8 warps above), the last block
    # ragged, a ragged last window
    (3, 70, 520, 8, 256, 2),
    (11, 70, 520, 8, 256, 1),
    # the tensor-core forward at 1-4 rows with codes that are not whole 16-byte vectors, E < 256
    (1, 77, 45, 8, 256, 1),
    (2, 300, 40, 8, 256, 1),
    (4, 90, 37, 8, 100, 2),
    # the one-row forward (16-bit x, one codebook or two): K > 4096 (5 parts of 128 groups on
    # 4 part warps, the last ragged), codes read byte by byte (G not a multiple of 4), 9 parts
    # with two codebooks, E < 256, and N past the rows per block rule's 32 (ragged last block)
    (1, 520, 4240, 8, 256, 1),
    (1, 70, 4105, 8, 256, 1),
    (1, 300, 1100, 8, 256, 2),
    (1, 45, 257, 8, 37, 2),
    (1, 4100, 1024, 8, 256, 1),
    # the tensor-core forward with one n8 tile of x (5-8 rows)
    (6, 45, 72, 8, 256, 2),
    (8, 70, 520, 8, 256, 1),
]
ALL_SHAPES = SHAPES + CUDA_SHAPES


def cuda(*tensors):
    return [t.cuda() if t is not None else None for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ALL_SHAPES, ids=str)
def test_forward_matches_reference(shape, dtype):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make_inputs(rows, n, groups, d, e, m, dtype)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    assert out.is_cuda and out.dtype == dtype and out.shape == (*x.shape[:-1], n)
    atol, rtol = tolerances(dtype)
    want = reference_in_float64(x, idx, cb, s, b)
    torch.testing.assert_close(out.cpu().double(), want, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("groups,m", [(4000, 1), (2000, 2)])
def test_forward_codes_beyond_shared_memory(groups, m):
    # a block's 64 rows of codes (K > 4096: 4 row tiles) take over 250 KiB, more than a block's
    # shared memory: the tensor-core forward steps aside for the direct forward
    x, idx, cb, s, b = make_inputs(2, 20, groups, 8, 256, m, torch.float16)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    atol, rtol = tolerances(torch.float16)
    want = reference_in_float64(x, idx, cb, s, b)
    torch.testing.assert_close(out.cpu().double(), want, atol=atol * 10, rtol=rtol)


def test_forward_agrees_with_cpu_kernel():
    x, idx, cb, s, b = make_inputs(5, 70, 48, 8, 256, 2)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    want = rlx_torch.codebook_matmul(x, idx, cb, s, b)  # another summation order
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("scales,bias", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rows", [4, 40])
def test_optional_scales_and_bias(scales, bias, rows):
    x, idx, cb, s, b = make_inputs(rows, 11, 5, scales=scales, bias=bias)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    torch.testing.assert_close(out.cpu(), reference.codebook_matmul(x, idx, cb, s, b))


@pytest.mark.parametrize("rows", [6, 32])
def test_non_contiguous_and_misaligned_inputs(rows):
    _, idx, cb, s, b = make_inputs(rows, 13, 4, m=2)
    base = torch.randn(rows * 32 + 1)
    candidates = [
        torch.randn(32, rows).t(),  # transposed
        torch.randn(2, rows, 64)[:, :, ::2].reshape(-1, 32)[:rows],  # strided
        base[1:].view(rows, 32),  # contiguous, 4 bytes past a 16-byte boundary
        torch.randn(1, 32).expand(rows, 32),  # stride 0
    ]
    idx_nc = idx.transpose(0, 1).contiguous().transpose(0, 1)
    cb_nc = cb.transpose(1, 2).contiguous().transpose(1, 2)
    s_nc = torch.stack([s, s], 1)[:, 0]
    for x in candidates:
        want = reference.codebook_matmul(x, idx, cb, s, b)
        got = rlx_torch.codebook_matmul(*cuda(x, idx_nc, cb_nc, s_nc, b))
        torch.testing.assert_close(got.cpu(), want)
    # The same misalignment on the device itself (a view into a CUDA buffer).
    xg = base.cuda()[1:].view(rows, 32)
    got = rlx_torch.codebook_matmul(xg, *cuda(idx, cb, s, b))
    torch.testing.assert_close(got.cpu(), reference.codebook_matmul(xg.cpu(), idx, cb, s, b))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_row_misaligned_and_batched(dtype, m):
    # the one-row forward: x 2 bytes past a 16-byte boundary (copied), codes 1 byte past one
    # (read byte by byte), x with leading dimensions (1, 1)
    x, idx, cb, s, b = make_inputs(1, 90, 136, m=m, dtype=dtype)
    want = reference_in_float64(x, idx, cb, s, b)
    atol, rtol = tolerances(dtype)
    xbuf = torch.zeros(x.numel() + 8, dtype=dtype, device="cuda")
    xg = xbuf[1:1 + x.numel()].view_as(x).copy_(x)
    ibuf = torch.zeros(idx.numel() + 16, dtype=torch.uint8, device="cuda")
    ig = ibuf[1:1 + idx.numel()].view_as(idx).copy_(idx)
    cbg, sg, bg = cuda(cb, s, b)
    for xin, iin in ((xg, ig), (xg.view(1, 1, -1), idx.cuda())):
        out = rlx_torch.codebook_matmul(xin, iin, cbg, sg, bg)
        assert out.shape == (*xin.shape[:-1], 90)
        torch.testing.assert_close(out.reshape(1, 90).cpu().double(), want, atol=atol * 10,
                                   rtol=rtol)


@pytest.mark.parametrize("m", [1, 2])
def test_one_row_forward_refills_code_slots(m):
    # N = 5280 rows on 108-132 SMs: 40-56 rows a block, 5-7 passes of 8 rows; G = 1100: 9 parts
    # on 8 part warps. Warp 0 takes 2 parts x 3-4 passes, more items than its 4 code slots, so
    # slots are refilled while other passes are in flight; the last part is ragged.
    n, groups = 5280, 1100
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(1, groups * 8, device="cuda", generator=gen).half()
    idx = torch.randint(0, 256, (n, groups, m), device="cuda", dtype=torch.uint8, generator=gen)
    cb = (torch.randn(m, 256, 8, device="cuda", generator=gen) / (groups * 8 * m) ** 0.5).half()
    s = (torch.rand(n, device="cuda", generator=gen) + 0.5).half()
    b = torch.randn(n, device="cuda", generator=gen).half()
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    w = sum(cb[i].double()[idx[:, :, i].long()] for i in range(m)).reshape(n, -1)
    want = (x.double() @ w.T) * s.double() + b.double()
    atol, rtol = tolerances(torch.float16)
    torch.testing.assert_close(out.double(), want, atol=atol * 10, rtol=rtol)
    assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), out)


def test_empty_batch_and_empty_output():
    x, idx, cb, s, b = (t.requires_grad_() if t.is_floating_point() else t
                        for t in cuda(*make_inputs(0, 7, 3)))
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.shape == (0, 7) and out.is_cuda
    gx, gc, gs, gb = torch.autograd.grad(out.sum(), (x, cb, s, b))
    assert gx.shape == (0, 24)
    for g, like in ((gc, cb), (gs, s), (gb, b)):
        assert g.shape == like.shape and not g.any()
    x, idx, cb, s, b = cuda(*make_inputs(3, 0, 2))
    assert rlx_torch.codebook_matmul(x, idx, cb, s, b).shape == (3, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4] + SHAPES[5:] + CUDA_SHAPES, ids=str)
def test_backward_matches_reference(shape, dtype):
    rows, n, groups, d, e, m = shape
    inputs = make_inputs(rows, n, groups, d, e, m, dtype)
    x, idx, cb, s, b = (
        t.cuda().requires_grad_() if t.is_floating_point() else t.cuda() for t in inputs
    )
    grad_out = torch.randn(*x.shape[:-1], n).to(dtype)
    got = torch.autograd.grad(
        rlx_torch.codebook_matmul(x, idx, cb, s, b), (x, cb, s, b), grad_out.cuda()
    )
    up = [t.detach().cpu().double().requires_grad_() for t in (x, cb, s, b)]
    want_out = reference.codebook_matmul(up[0], idx.cpu(), up[1], up[2], up[3])
    want = torch.autograd.grad(want_out, up, grad_out.double())
    atol, rtol = tolerances(dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.is_cuda
        scale = w.abs().max().clamp_min(1)
        torch.testing.assert_close(g.cpu().double() / scale, w / scale, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("rows", [3, 40])
def test_backward_output_mask(rows):
    x, idx, cb, s, _ = cuda(*make_inputs(rows, 10, 4))
    grad_out = torch.randn(rows, 10, device="cuda")
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
    x, idx, cb, s, b = cuda(*make_inputs(rows, 7, 3, d=4, e=5, m=m, dtype=torch.float64))
    args = [t.requires_grad_() for t in (x, cb, s, b)]

    def fn(x, cb, s, b):
        return rlx_torch.codebook_matmul(x, idx, cb, s, b)

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("rows", [5, 20])
def test_opcheck(rows):
    x, idx, cb, s, b = cuda(*make_inputs(rows, 9, 3, d=4, e=7, m=2))
    torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, idx, cb, s, b))
    torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x[0], idx, cb, None, None))
    grad_out = torch.randn(rows, 9, device="cuda")
    for mask in ([True, True, True, True], [True, False, False, True]):
        torch.library.opcheck(
            torch.ops.rlx.codebook_matmul_backward.default, (grad_out, x, idx, cb, s, mask)
        )


@pytest.mark.parametrize("rows", [1, 3, 12, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_across_calls(rows, dtype):
    # Codes drawn from 4 entries collide often, which is where a scatter could reorder sums.
    x, idx, cb, s, b = cuda(*make_inputs(rows, 300, 64, m=2, e=256, dtype=dtype))
    idx = idx % 4
    grad_out = torch.randn(rows, 300, device="cuda").to(dtype)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    grads = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
    for _ in range(3):
        assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), out)
        again = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
        for g, h in zip(again, grads, strict=True):
            assert torch.equal(g, h)


@pytest.mark.parametrize("rows", [5, 16])
def test_backward_non_finite_grad_out_propagates(rows):
    # An inf in batch row 1 and a NaN in row 3 of grad_out: the histogram backward (5 and 16
    # rows both take it) must give the float64 reference's infinities and NaNs in the same
    # places, and its finite values elsewhere.
    x, idx, cb, s, _ = make_inputs(rows, 70, 16, d=8, e=64)
    grad_out = torch.randn(rows, 70)
    grad_out[1, 7] = float("inf")
    grad_out[3, 50] = float("nan")
    got = torch.ops.rlx.codebook_matmul_backward(*cuda(grad_out, x, idx, cb, s), [True] * 4)
    up = [t.double().requires_grad_() for t in (x, cb, s)]
    want = torch.autograd.grad(reference.codebook_matmul(up[0], idx, up[1], up[2], None), up,
                               grad_out.double())
    for g, w in zip(got[:3], want, strict=True):
        assert torch.equal(g.cpu().isnan(), w.isnan()) and torch.equal(g.cpu().isinf(), w.isinf())
        scale = w[w.isfinite()].abs().max().clamp_min(1)
        torch.testing.assert_close(g.cpu().double() / scale, w / scale, atol=1e-5, rtol=1e-4,
                                   equal_nan=True)


@pytest.mark.parametrize("rows", [1, 2])
def test_half_inputs_accumulate_in_float32(rows):
    # 4096 products: float16 accumulation would be off by far more than one output rounding.
    x, idx, cb, s, b = make_inputs(rows, 8, 512, dtype=torch.float16)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b)).cpu().double()
    want = reference_in_float64(x, idx, cb, s, b)
    ulp = want.abs() * 2.0**-10 + 1e-3
    assert ((out - want).abs() <= ulp).all()


@pytest.mark.parametrize("match,args", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_bad_input_raises_value_error(match, args):
    moved = {k: (v if v.device.type == "meta" else v.cuda()) for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        torch.ops.rlx.codebook_matmul(*moved.values())
    with pytest.raises(ValueError, match=match):
        rlx_torch.codebook_matmul(**moved)


def test_mixed_devices_raise_value_error():
    x, idx, cb, s, b = make_inputs(3, 10, 4)
    for name, args in (
        ("indices", (x.cuda(), idx, cb.cuda(), s.cuda(), b.cuda())),
        ("codebook", (x.cuda(), idx.cuda(), cb, s.cuda(), b.cuda())),
        ("scales", (x.cuda(), idx.cuda(), cb.cuda(), s, b.cuda())),
    ):
        with pytest.raises(ValueError, match=f"{name} must be on x's device"):
            torch.ops.rlx.codebook_matmul(*args)


def test_bad_backward_arguments():
    x, idx, cb, s, _ = cuda(*make_inputs(3, 10, 4))
    with pytest.raises(ValueError, match="grad_out must have shape"):
        torch.ops.rlx.codebook_matmul_backward(
            torch.ones(3, 9, device="cuda"), x, idx, cb, s, [True] * 4
        )
    with pytest.raises(ValueError, match="needs scales"):
        torch.ops.rlx.codebook_matmul_backward(
            torch.ones(3, 10, device="cuda"), x, idx, cb, None, [True] * 4
        )
    with pytest.raises(ValueError, match="indices must be < E=16"):
        torch.ops.rlx.codebook_matmul_backward(
            torch.ones(3, 10, device="cuda"), x, torch.full_like(idx, 200), cb[:16], s, [True] * 4
        )


def test_compile_fullgraph():
    layer = CodebookLinear(32, 24, entry_dim=4, num_entries=16, num_codebooks=2).cuda()
    mlp = torch.nn.Sequential(layer, torch.nn.GELU(), torch.nn.Linear(24, 5)).cuda()
    x = torch.randn(3, 7, 32, device="cuda")
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


# ---- CodebookLinear on CUDA ----


@pytest.mark.parametrize("num_codebooks", [1, 2])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_codebook_linear_matches_its_dense_weight(num_codebooks, rows):
    layer = CodebookLinear(64, 48, entry_dim=8, num_entries=32, num_codebooks=num_codebooks)
    with torch.no_grad():
        layer.scales.uniform_(0.5, 2)
        layer.bias.normal_()
    layer = layer.cuda()
    x = torch.randn(rows, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(layer(x), layer.to_linear()(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer(x).cpu(), layer.cpu()(x.cpu()), atol=1e-5, rtol=1e-5)


def test_codebook_linear_half_on_cuda():
    layer = CodebookLinear(64, 40, entry_dim=8, num_entries=64).cuda().half()
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    want = reference.codebook_matmul(
        x.float(), layer.indices, layer.codebook.float(), layer.scales.float(), layer.bias.float()
    )
    torch.testing.assert_close(out.float(), want, atol=5e-3, rtol=5e-3)


def test_codebook_linear_fine_tuning_on_cuda_reduces_loss():
    # tests/test_codebook_linear.py's fine-tuning loop, on the GPU.
    torch.manual_seed(0)
    teacher = structured_linear()
    layer = CodebookLinear.from_linear(teacher, entry_dim=4, num_entries=16, iters=5)
    layer, teacher = layer.cuda(), teacher.cuda()
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    x = (torch.randn(64, 64) * torch.logspace(0, -1.5, 64)).cuda()
    target = teacher(x).detach()
    losses = torch.empty(40, device="cuda")
    for step in range(40):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.detach()
    losses = losses.cpu()
    assert layer.indices.grad is None
    assert losses[-1] < 0.9 * losses[0]


def test_codebook_layer_trains_with_muon_on_cuda():
    # The project's acceptance loop (tests/test_muon.py), resident on the GPU, through our op.
    from test_muon import _train_codebook_layer

    _train_codebook_layer(rlx_torch.codebook_matmul, "cuda")


# ---- 16-bit codes (AQLM's 1x16 / 2x16: int16 or uint16 indices, E up to 65536) ----
# csrc/cuda/codebook_codes16.cu: the small-batch forward up to 8 rows (dequantize + cuBLAS
# above), dC from x up to 16 rows (from dW above), dx through the dequantized weight.

# rows (1, 5: the small-batch forward; 16: the dense forward with dC from x; 40: dC from dW;
# (2, 3): leading dimensions), N, K/D, D, E, M
SHAPES16 = [
    (1, 37, 45, 8, 65536, 1),
    (5, 33, 40, 8, 65536, 2),
    (16, 21, 37, 8, 300, 1),
    (40, 17, 24, 8, 65536, 1),
    (1, 19, 13, 4, 300, 2),
    (5, 23, 9, 3, 1000, 1),  # D = 3: the run-time D loops
    (40, 29, 6, 12, 300, 2),
    ((2, 3), 15, 8, 8, 65536, 1),
]


def check_codes16_against_reference(x, idx, cb, s, b, tol):
    """Forward and all four gradients on the GPU against autograd through the float64
    reference of tests/test_codebook_16bit.py (inputs given on the CPU)."""
    leaves = [t.cuda().requires_grad_() for t in (x, cb, s, b)]
    out = rlx_torch.codebook_matmul(leaves[0], idx.cuda(), *leaves[1:])
    assert out.is_cuda and out.dtype == x.dtype and out.shape == (*x.shape[:-1], idx.shape[0])
    up = [t.double().requires_grad_() for t in (x, cb, s, b)]
    want_out = reference16(up[0], idx, *up[1:])
    torch.testing.assert_close(out.detach().cpu().double(), want_out.detach(), atol=tol * 10,
                               rtol=tol)
    grad_out = torch.randn(out.shape).to(x.dtype)
    got = torch.autograd.grad(out, leaves, grad_out.cuda())
    want = torch.autograd.grad(want_out, up, grad_out.double())
    for name, g, w in zip(["x", "codebook", "scales", "bias"], got, want, strict=True):
        assert g.is_cuda and g.dtype == x.dtype and g.shape == w.shape, name
        scale = w.abs().max().clamp_min(1)
        torch.testing.assert_close(g.cpu().double() / scale, w / scale, atol=tol * 10, rtol=tol,
                                   msg=name)


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.uint16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES16, ids=str)
def test_codes16_forward_and_backward_match_reference(shape, dtype, index_dtype):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make16(rows, n, groups, d, e, m, dtype, index_dtype, seed=n + groups)
    check_codes16_against_reference(x, idx, cb, s, b, TOL16[dtype])


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_codes16_layer_sized_forward(rows, dtype):
    # a 1x16 layer's shape (K = 2048, codes over the whole 16 bits), the small-batch forward
    x, idx, cb, s, b = make16(rows, 256, 256, 8, 65536, 1, dtype, seed=rows)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    torch.testing.assert_close(out.cpu().double(), reference16(x, idx, cb, s, b),
                               atol=TOL16[dtype] * 10, rtol=TOL16[dtype])


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_codes16_agrees_with_cpu_kernel(rows):
    x, idx, cb, s, b = make16(rows, 70, 48, 8, 65536, 2)
    grad_out = torch.randn(rows, 70)
    out = rlx_torch.codebook_matmul(*cuda(x, idx, cb, s, b))
    torch.testing.assert_close(out.cpu(), rlx_torch.codebook_matmul(x, idx, cb, s, b),
                               atol=1e-4, rtol=1e-5)
    got = torch.ops.rlx.codebook_matmul_backward(*cuda(grad_out, x, idx, cb, s), [True] * 4)
    want = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu(), w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [3, 40])
def test_codes16_non_contiguous_and_misaligned_inputs(rows):
    # x and the codebook 2 bytes past a 16-byte boundary (the element loads), transposed
    # indices and codebook, a strided scales vector
    dtype = torch.float16
    x, idx, cb, s, b = make16(rows, 13, 6, 8, 65536, 2, dtype)
    xbuf = torch.zeros(x.numel() + 8, dtype=dtype, device="cuda")
    xg = xbuf[1:1 + x.numel()].view_as(x).copy_(x)
    cbuf = torch.zeros(cb.numel() + 8, dtype=dtype, device="cuda")
    cbg = cbuf[1:1 + cb.numel()].view_as(cb).copy_(cb)
    idx_nc = idx.cuda().transpose(0, 1).contiguous().transpose(0, 1)
    cb_nc = cb.cuda().transpose(1, 2).contiguous().transpose(1, 2)
    s_nc = torch.stack([s, s], 1).cuda()[:, 0]
    want = reference16(x, idx, cb, s, b)
    tol = TOL16[dtype]
    for args in ((xg, idx.cuda(), cbg, s.cuda(), b.cuda()), (x.cuda(), idx_nc, cb_nc, s_nc,
                                                              b.cuda())):
        out = rlx_torch.codebook_matmul(*args)
        torch.testing.assert_close(out.cpu().double(), want, atol=tol * 10, rtol=tol)
    grad_out = torch.randn(rows, 13).to(dtype)
    a = torch.ops.rlx.codebook_matmul_backward(grad_out.cuda(), xg, idx.cuda(), cbg, s.cuda(),
                                               [True] * 4)
    c = torch.ops.rlx.codebook_matmul_backward(grad_out.cuda(), x.cuda(), idx_nc, cb_nc, s_nc,
                                               [True] * 4)
    for g, h in zip(a, c, strict=True):
        torch.testing.assert_close(g, h)


@pytest.mark.parametrize("rows,n,groups", [(0, 7, 3), (3, 0, 2), (3, 5, 0)])
def test_codes16_empty_dims(rows, n, groups):
    x, idx, cb, s, b = (t.requires_grad_() if t.is_floating_point() else t
                        for t in cuda(*make16(rows, n, groups, d=8, e=500)))
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.shape == (rows, n) and out.is_cuda
    if groups == 0:  # no products: the bias alone
        torch.testing.assert_close(out.detach(), b.detach().expand(rows, n))
    gx, gc, gs, gb = torch.autograd.grad(out.sum(), (x, cb, s, b))
    assert gx.shape == x.shape and not gx.any()
    assert gc.shape == cb.shape and not gc.any()
    assert gs.shape == s.shape and not gs.any()
    torch.testing.assert_close(gb, torch.full_like(b, rows))


@pytest.mark.parametrize("rows,m", [(3, 1), (3, 2), (20, 1)])
def test_codes16_gradcheck(rows, m):
    x, idx, cb, s, b = cuda(*make16(rows, 7, 3, d=4, e=300, m=m, dtype=torch.float64))
    args = [t.requires_grad_() for t in (x, cb, s, b)]
    assert torch.autograd.gradcheck(lambda *a: rlx_torch.codebook_matmul(a[0], idx, *a[1:]), args)


@pytest.mark.parametrize("rows", [5, 20])
def test_codes16_opcheck(rows):
    x, idx, cb, s, b = cuda(*make16(rows, 9, 3, d=4, e=700, m=2))
    grad_out = torch.randn(rows, 9, device="cuda")
    for ix in (idx, idx.view(torch.uint16)):
        torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, ix, cb, s, b))
        torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x[0], ix, cb, None, None))
        for mask in ([True] * 4, [True, False, False, True], [False, True, False, False]):
            torch.library.opcheck(torch.ops.rlx.codebook_matmul_backward.default,
                                  (grad_out, x, ix, cb, s, mask))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_codes16_out_of_range_index_raises(rows):
    x, idx, cb, s, b = make16(rows, 9, 4, e=1000)
    idx[3, 1] = 1000
    x, idx, cb, s, b = cuda(x, idx, cb, s, b)
    with pytest.raises(ValueError, match="indices must be < E=1000"):
        rlx_torch.codebook_matmul(x, idx, cb, s, b)
    with pytest.raises(ValueError, match="indices must be < E=1000"):
        torch.ops.rlx.codebook_matmul_backward(torch.ones(rows, 9, device="cuda"), x, idx, cb, s,
                                               [True] * 4)
    idx[3, 1] = -1  # 65535 as a 16-bit code
    for ix in (idx, idx.view(torch.uint16)):
        with pytest.raises(ValueError, match="found 65535"):
            rlx_torch.codebook_matmul(x, ix, cb, s, b)


@pytest.mark.parametrize("e", [65536, 300])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes16_deterministic_across_calls(rows, dtype, e):
    # codes from 4 entries: long segments in the dcodebook kernel
    x, idx, cb, s, b = cuda(*make16(rows, 300, 64, 8, e, 2, dtype))
    idx = (idx.long() % 4 + (e - 4)).to(torch.int32)
    idx = (idx - 65536 * (idx >= 32768)).to(torch.int16)
    grad_out = torch.randn(rows, 300, device="cuda").to(dtype)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    grads = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
    for _ in range(2):
        assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), out)
        again = torch.ops.rlx.codebook_matmul_backward(grad_out, x, idx, cb, s, [True] * 4)
        for g, h in zip(again, grads, strict=True):
            assert torch.equal(g, h)


def test_codes16_half_codebook_with_float32_x_stays_cpu_only():
    x, idx, cb, s, b = cuda(*make16(2, 10, 4, e=500))
    with pytest.raises(ValueError, match="codebook must have x's dtype"):
        rlx_torch.codebook_matmul(x, idx, cb.half(), s, b)
