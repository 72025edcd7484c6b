"""The codebook Metal kernels (csrc/mps/kernels/codebook.metal), run by the CPU emulator
through the launch plans of rlx/mps_codebook_plan.h, against the plain-PyTorch reference:
forward and backward, float32/float16/bfloat16, shapes that are not multiples of the
simdgroup, tile or threadgroup sizes, both the matrix-vector and the tiled paths, staged and
unstaged codebooks, and every thread-scheduling order.

`run_forward` / `run_backward` do what csrc/mps/codebook.mm does, step for step."""

import pytest
import torch

from rlx_torch.ops import reference
from tests.metal_emu import call_plan, compile_cpp, load

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ORDERS = ["forward", "reverse", "shuffle"]


@pytest.fixture(scope="module")
def emu():
    # (codebook.metal, the plan wrappers, codebook_sorted.metal: 16-bit grad_codebook)
    return (load("csrc/mps/kernels/codebook.metal"),
            compile_cpp("tests/metal_emu/plans/codebook_plans.cpp"),
            load("csrc/mps/kernels/codebook_sorted.metal"))


def _shape_args(x2, indices, codebook, scales, bias):
    n, groups, m = indices.shape
    return [x2.shape[0], x2.shape[1], n, groups, m, codebook.shape[1], codebook.shape[2],
            int(scales is not None), int(bias is not None), DTYPES[x2.dtype],
            1 if indices.dtype == torch.uint8 else 2]


def _normalize(x, indices, codebook):
    # the host code's view of the inputs: contiguous, 2-d x, 3-d indices and codebook
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if indices.dim() == 2:
        indices, codebook = indices.unsqueeze(-1), codebook.unsqueeze(0)
    return x2, indices.contiguous(), codebook.contiguous()


def _run(lib, plan, buffers, order, seed=0):
    if all(plan.threadgroups):  # the host code skips empty grids
        lib.run_plan(plan, buffers, order=order, seed=seed)


def run_forward(emu, x, indices, codebook, scales=None, bias=None, order="forward",
                float_out=False):
    lib, plans = emu[:2]
    x2, idx, cb = _normalize(x, indices, codebook)
    args = _shape_args(x2, idx, cb, scales, bias)
    plan = call_plan(plans.plan_codebook_forward, *args, int(float_out))
    out = torch.empty(x2.shape[0], idx.shape[0], dtype=torch.float32 if float_out else x.dtype)
    dummy = x2 if x2.numel() else cb
    _run(lib, plan, {0: x2, 1: idx, 2: cb, 3: scales if scales is not None else dummy,
                     4: bias if bias is not None else dummy, 5: out}, order)
    return out.reshape(*x.shape[:-1], idx.shape[0]), plan


def run_backward(emu, grad_out, x, indices, codebook, scales, mask, order="forward", seed=0):
    lib, plans = emu[:2]
    x2, idx, cb = _normalize(x, indices, codebook)
    g2 = grad_out.reshape(-1, idx.shape[0]).contiguous()
    args = _shape_args(x2, idx, cb, scales, None)
    s_buf = scales if scales is not None else cb
    empty = x.new_empty(0)
    gx = gc = gs = gb = empty
    if mask[0]:
        gx = torch.empty_like(x2)
        _run(lib, call_plan(plans.plan_codebook_dx, *args),
             {0: g2, 1: idx, 2: cb, 3: s_buf, 4: gx}, order, seed)
        gx = gx.reshape(x.shape)
    if mask[1] and idx.dtype != torch.uint8:
        gc = _sorted_dcodebook(emu, g2, x2, idx, cb, scales, args, order, seed)
        gc = gc.reshape(codebook.shape)
    elif mask[1]:
        partials = torch.empty(plans.codebook_partials(_c_args(args), len(args)))
        gc = torch.empty_like(cb)
        _run(lib, call_plan(plans.plan_codebook_dcodebook_partial, *args),
             {0: g2, 1: x2 if x2.numel() else cb, 2: idx, 3: s_buf, 4: partials}, order, seed)
        _run(lib, call_plan(plans.plan_codebook_dcodebook_reduce, *args),
             {0: partials, 1: gc}, order, seed)
        gc = gc.reshape(codebook.shape)
    if mask[2] or mask[3]:
        y = torch.empty(1)
        if mask[2]:
            y = run_forward(emu, x, indices, codebook, order=order, float_out=True)[0]
            y = y.reshape(-1, idx.shape[0]).contiguous()
        gs_buf = torch.empty(idx.shape[0], dtype=x.dtype) if mask[2] else empty
        gb_buf = torch.empty(idx.shape[0], dtype=x.dtype) if mask[3] else empty
        plan = call_plan(plans.plan_codebook_dscale_dbias, *args, int(mask[2]), int(mask[3]))
        _run(lib, plan, {0: g2 if g2.numel() else cb, 1: y if y.numel() else cb,
                         2: gs_buf if mask[2] else cb, 3: gb_buf if mask[3] else cb}, order, seed)
        gs, gb = (gs_buf if mask[2] else empty), (gb_buf if mask[3] else empty)
    return gx, gc, gs, gb


def _sorted_dcodebook(emu, g2, x2, idx, cb, scales, args, order, seed):
    # the host's steps (csrc/mps/codebook.mm sorted_dcodebook_dispatch): keys m*E + code, or
    # M*E for a code >= E, sorted stably with their positions
    _, plans, sorted_lib = emu
    m, e = cb.shape[0], cb.shape[1]
    codes = idx.view(torch.int16).to(torch.int32) & 0xFFFF
    offsets = torch.arange(m, dtype=torch.int32) * e
    keys = torch.where(codes < e, codes + offsets, torch.tensor(m * e, dtype=torch.int32))
    sorted_keys, positions = torch.sort(keys.reshape(-1), stable=True)
    gc = torch.empty_like(cb)
    dummy = cb
    buffers = {0: g2 if g2.numel() else dummy, 1: x2 if x2.numel() else dummy,
               2: sorted_keys if sorted_keys.numel() else dummy,
               3: positions.to(torch.int32) if positions.numel() else dummy,
               4: scales if scales is not None else dummy, 5: gc}
    _run(sorted_lib, call_plan(plans.plan_codebook_dcodebook_sorted, *args), buffers, order,
         seed)
    return gc


def _c_args(args):
    import ctypes

    return (ctypes.c_int64 * len(args))(*args)


def make_inputs(b, n, groups, d, m, e, dtype, leading=None, three_d=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = groups * d
    shape = (*(leading or (b,)), k)
    x = torch.randn(shape, generator=g).to(dtype)
    if three_d:
        indices = torch.randint(0, e, (n, groups, m), generator=g, dtype=torch.uint8)
        codebook = (torch.randn(m, e, d, generator=g) / (groups * m) ** 0.5).to(dtype)
    else:
        indices = torch.randint(0, e, (n, groups), generator=g, dtype=torch.uint8)
        codebook = (torch.randn(e, d, generator=g) / groups**0.5).to(dtype)
    scales = (torch.rand(n, generator=g) + 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, indices, codebook, scales, bias


def _tol(dtype):
    return {torch.float32: (2e-5, 2e-5), torch.float16: (2e-2, 2e-2),
            torch.bfloat16: (4e-2, 4e-2)}[dtype]


def _reference_grads(x, indices, codebook, scales, bias, grad_out):
    leaves = [t.detach().double().requires_grad_(t is not None) for t in (x, codebook)]
    s = scales.detach().double().requires_grad_() if scales is not None else None
    bb = bias.detach().double().requires_grad_() if bias is not None else None
    out = reference.codebook_matmul(leaves[0], indices, leaves[1], s, bb)
    out.backward(grad_out.double())
    return out, leaves[0].grad, leaves[1].grad, s.grad if s is not None else None, \
        bb.grad if bb is not None else None


# (batch, N, groups, D, M, E): mat-vec (batch <= 16) and tiled (batch > 16) paths, D not a
# multiple of the 8-wide register chunk, N not a multiple of 4 rows x 4 simdgroups or 32,
# K not a multiple of 32, E up to 256, several codebooks, and a codebook too big to stage.
CASES = [
    (1, 37, 5, 8, 1, 256),
    (3, 7, 33, 3, 2, 16),
    (5, 50, 4, 12, 3, 5),
    (16, 17, 6, 8, 2, 256),
    (17, 33, 7, 8, 1, 64),
    (40, 70, 3, 5, 2, 9),
    (2, 9, 2, 12, 2, 256),  # 2 * 256 * 12 floats = 24 KiB: codebook read from device memory
    (33, 12, 9, 12, 2, 200),  # the same on the tiled path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_n{}_g{}_d{}_m{}_e{}".format(*c))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_forward_matches_reference(emu, case, dtype):
    b, n, groups, d, m, e = case
    x, indices, codebook, scales, bias = make_inputs(b, n, groups, d, m, e, dtype, seed=b + n)
    order = ORDERS[(b + n + DTYPES[dtype]) % 3]
    out, plan = run_forward(emu, x, indices, codebook, scales, bias, order=order)
    assert plan.kernel.startswith("codebook_mv" if b <= 16 else "codebook_mm")
    ref = reference.codebook_matmul(x.double(), indices, codebook.double(), scales.double(),
                                    bias.double())
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    assert out.dtype == dtype


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_n{}_g{}_d{}_m{}_e{}".format(*c))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_backward_matches_reference(emu, case, dtype):
    b, n, groups, d, m, e = case
    x, indices, codebook, scales, bias = make_inputs(b, n, groups, d, m, e, dtype, seed=b * n)
    grad_out = torch.randn(b, n).to(dtype)
    order = ORDERS[(b + n + DTYPES[dtype] + 1) % 3]
    got = run_backward(emu, grad_out, x, indices, codebook, scales, [True] * 4, order=order)
    _, *want = _reference_grads(x, indices, codebook, scales, bias, grad_out)
    rtol, atol = _tol(dtype)
    for name, g, w in zip(["grad_x", "grad_codebook", "grad_scales", "grad_bias"], got, want,
                          strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        scale = w.abs().max().item() + 1.0
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=name)


def test_leading_dims_two_d_indices_and_no_scales(emu):
    x, indices, codebook, _, bias = make_inputs(6, 11, 4, 8, 1, 32, torch.float32,
                                                leading=(2, 3), three_d=False)
    out, _ = run_forward(emu, x, indices, codebook, None, bias, order="shuffle")
    torch.testing.assert_close(out, reference.codebook_matmul(x, indices, codebook, None, bias),
                               rtol=1e-5, atol=1e-5)
    grad_out = torch.randn(2, 3, 11)
    gx, gc, gs, gb = run_backward(emu, grad_out, x, indices, codebook, None,
                                  [True, True, False, True])
    _, wx, wc, _, wb = _reference_grads(x, indices, codebook, None, bias, grad_out)
    assert gs.shape == (0,)
    for g, w in [(gx, wx), (gc, wc), (gb, wb)]:
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)


def test_backward_is_bitwise_independent_of_thread_order(emu):
    # dcodebook sums in a fixed order (lane-owned codes, ordered partials): no schedule changes it
    for b in (3, 40):  # per-row code scans, and per-row batch splits
        x, indices, codebook, scales, _ = make_inputs(b, 45, 6, 8, 2, 64, torch.float32, seed=b)
        grad_out = torch.randn(b, 45)
        runs = [run_backward(emu, grad_out, x, indices, codebook, scales, [True] * 4, order=o,
                             seed=s) for o, s in [("forward", 0), ("reverse", 0), ("shuffle", 9)]]
        for other in runs[1:]:
            for g0, g1 in zip(runs[0], other, strict=True):
                assert torch.equal(g0, g1)


def test_empty_batch(emu):
    x, indices, codebook, scales, bias = make_inputs(0, 5, 3, 4, 1, 8, torch.float32)
    out, _ = run_forward(emu, x, indices, codebook, scales, bias)
    assert out.shape == (0, 5)
    gx, gc, gs, gb = run_backward(emu, torch.zeros(0, 5), x, indices, codebook, scales,
                                  [True] * 4)
    assert gx.shape == (0, 12) and torch.equal(gc, torch.zeros_like(codebook))
    assert torch.equal(gs, torch.zeros(5)) and torch.equal(gb, torch.zeros(5))


@pytest.mark.parametrize("b", [2, 20])
def test_index_out_of_range_gives_nan_not_a_bad_read(emu, b):
    x, indices, codebook, scales, bias = make_inputs(b, 9, 4, 8, 1, 10, torch.float32)
    indices[3, 1, 0] = 200  # >= E = 10; the GPU cannot raise without a host sync
    out, _ = run_forward(emu, x, indices, codebook, scales, bias)
    assert out[:, 3].isnan().all()
    assert not out[:, [0, 1, 2, 4, 5, 6, 7, 8]].isnan().any()


def test_plans_reject_shapes_beyond_32_bit_indexing(emu):
    plans = emu[1]
    with pytest.raises(ValueError, match="rejected"):
        call_plan(plans.plan_codebook_forward, 1 << 20, 1 << 13, 8, 1024, 1, 256, 8, 0, 0, 0, 1,
                  0)


@pytest.mark.parametrize("seed", range(8))
def test_random_shapes(emu, seed):
    # seeded draws over batch (0 to 40, across the mat-vec/tiled and code-scan thresholds), odd
    # sizes, 2-d or 3-d indices, with or without scales/bias, every dtype and schedule order
    r = torch.Generator().manual_seed(1000 + seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=r))

    b, n, groups, d, m, e = draw(0, 40), draw(1, 45), draw(1, 9), draw(1, 13), draw(1, 3), \
        draw(1, 256)
    dtype = list(DTYPES)[draw(0, 2)]
    three_d = m > 1 or draw(0, 1) == 1
    x, indices, codebook, scales, bias = make_inputs(b, n, groups, d, m, e, dtype,
                                                     three_d=three_d, seed=seed)
    scales = scales if draw(0, 1) else None
    bias = bias if draw(0, 1) else None
    order = ORDERS[seed % 3]
    out, _ = run_forward(emu, x, indices, codebook, scales, bias, order=order)
    grad_out = torch.randn(b, n).to(dtype)
    mask = [True, True, scales is not None, bias is not None]
    got = run_backward(emu, grad_out, x, indices, codebook, scales, mask, order=order, seed=seed)
    ref_out, *want = _reference_grads(x, indices, codebook, scales, bias, grad_out)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=rtol, atol=atol)
    for name, g, w, on in zip(["grad_x", "grad_codebook", "grad_scales", "grad_bias"], got,
                              want, mask, strict=True):
        if not on:
            assert g.shape == (0,), name
            continue
        scale = w.abs().max().item() + 1.0 if w.numel() else 1.0
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=name)


def _without_first(text, anchor, needle):
    """text with the first `needle` after `anchor` removed."""
    at = text.index(needle, text.index(anchor))
    return text[:at] + text[at + len(needle) :]


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


@pytest.mark.parametrize(
    "kernel,batch",
    [("kernel void codebook_mv(", 2), ("kernel void codebook_mm(", 40)],
)
def test_these_tests_catch_a_barrier_removed_from_the_real_kernel(emu, kernel, batch):
    from pathlib import Path

    from tests.metal_emu import REPO, load_source

    text = (Path(REPO) / "csrc/mps/kernels/codebook.metal").read_text()
    if kernel.endswith("codebook_mm("):  # the barrier between staging the tiles and using them
        anchor = text.index(BARRIER, text.index(kernel)) + len(BARRIER)
        broken = text[:anchor] + _without_first(text[anchor:], "", BARRIER)
    else:  # the barrier after staging the codebook
        broken = _without_first(text, kernel, BARRIER)
    assert broken != text
    lib = load_source(broken, "codebook_planted_" + kernel.split()[-1].rstrip("("))
    x, indices, codebook, scales, bias = make_inputs(batch, 37, 5, 8, 1, 256, torch.float32)
    want = reference.codebook_matmul(x, indices, codebook, scales, bias)
    good, _ = run_forward(emu, x, indices, codebook, scales, bias, order="forward")
    torch.testing.assert_close(good, want, rtol=2e-5, atol=2e-5)
    bad, plan = run_forward((lib, emu[1]), x, indices, codebook, scales, bias, order="forward")
    assert plan.kernel.startswith(kernel.split()[-1].rstrip("("))
    assert not torch.allclose(bad, want, rtol=1e-3, atol=1e-3, equal_nan=False)


# ---- 16-bit indices (E up to 65536): "_u16" kernels and codebook_sorted.metal ----------------


def make_inputs16(b, n, groups, d, m, e, dtype, index_dtype=torch.int16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, groups * d, generator=g).to(dtype)
    codes = torch.randint(0, e, (n, groups, m), generator=g)
    indices = (codes - 65536 * (codes >= 32768)).to(torch.int16)  # AQLM's signed layout
    if index_dtype == torch.uint16:
        indices = indices.view(torch.uint16)
    codebook = (torch.randn(m, e, d, generator=g) / (groups * m) ** 0.5).to(dtype)
    scales = (torch.rand(n, generator=g) + 0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, indices, codebook, scales, bias


def _reference16(x, indices, codebook, scales, bias, grad_out):
    wide = (indices.view(torch.int16).long() % 65536)
    return _reference_grads(x, wide, codebook, scales, bias, grad_out)


# (batch, N, groups, D, M, E): staged (E * D * M floats <= 16 KiB) and unstaged codebooks,
# mat-vec and tiled paths, E = 65536 with D = 8 (AQLM 1x16), two codebooks (2x16).
CASES16 = [
    (1, 37, 5, 8, 1, 65536),
    (3, 9, 4, 8, 2, 300),
    (2, 21, 3, 12, 1, 40000),
    (20, 17, 6, 8, 1, 500),
    (5, 6, 2, 3, 2, 65536),
]


@pytest.mark.parametrize("case", CASES16, ids=lambda c: "b{}_n{}_g{}_d{}_m{}_e{}".format(*c))
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_16bit_forward_and_backward_match_reference(emu, case, dtype):
    b, n, groups, d, m, e = case
    index_dtype = torch.uint16 if (b + n) % 2 else torch.int16
    x, indices, codebook, scales, bias = make_inputs16(b, n, groups, d, m, e, dtype, index_dtype,
                                                       seed=b + n)
    order = ORDERS[(b + n + DTYPES[dtype]) % 3]
    out, plan = run_forward(emu, x, indices, codebook, scales, bias, order=order)
    assert plan.kernel.startswith("codebook_mv_u16" if b <= 16 else "codebook_mm_u16")
    grad_out = torch.randn(b, n).to(dtype)
    got = run_backward(emu, grad_out, x, indices, codebook, scales, [True] * 4, order=order,
                       seed=b)
    ref_out, *want = _reference16(x, indices, codebook, scales, bias, grad_out)
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(out.double(), ref_out.detach(), rtol=rtol, atol=atol)
    for name, g, w in zip(["grad_x", "grad_codebook", "grad_scales", "grad_bias"], got, want,
                          strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        scale = w.abs().max().item() + 1.0
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=name)


def test_16bit_sorted_dcodebook_is_bitwise_independent_of_thread_order(emu):
    x, indices, codebook, scales, _ = make_inputs16(4, 40, 6, 8, 2, 700, torch.float32)
    grad_out = torch.randn(4, 40)
    mask = [False, True, False, False]
    runs = [run_backward(emu, grad_out, x, indices, codebook, scales, mask, order=o, seed=s)[1]
            for o, s in [("forward", 0), ("reverse", 0), ("shuffle", 5)]]
    for other in runs[1:]:
        assert torch.equal(runs[0], other)


def test_16bit_index_out_of_range_is_nan_and_never_summed(emu):
    x, indices, codebook, scales, bias = make_inputs16(2, 9, 4, 8, 1, 1000, torch.float32)
    indices[3, 1, 0] = -2  # 65534 >= E = 1000
    out, _ = run_forward(emu, x, indices, codebook, scales, bias)
    assert out[:, 3].isnan().all() and not out[:, [0, 1, 2, 4, 5, 6, 7, 8]].isnan().any()
    _, gc, _, _ = run_backward(emu, torch.randn(2, 9), x, indices, codebook, scales,
                               [False, True, False, False])
    assert gc.isfinite().all()


@pytest.mark.parametrize("kernel,batch", [("kernel void codebook_mv(", 2),
                                          ("kernel void codebook_mm(", 40)])
def test_barrier_mutants_of_the_16bit_kernels_are_caught(emu, kernel, batch):
    from pathlib import Path

    from tests.metal_emu import REPO, load_source

    text = (Path(REPO) / "csrc/mps/kernels/codebook.metal").read_text()
    if kernel.endswith("codebook_mm("):
        anchor = text.index(BARRIER, text.index(kernel)) + len(BARRIER)
        broken = text[:anchor] + _without_first(text[anchor:], "", BARRIER)
    else:
        broken = _without_first(text, kernel, BARRIER)
    lib = load_source(broken, "codebook_planted16_" + kernel.split()[-1].rstrip("("))
    # E * D = 300 * 8 floats: the codebook is staged, so the barrier after staging matters
    x, indices, codebook, scales, bias = make_inputs16(batch, 37, 5, 8, 1, 300, torch.float32)
    want, *_ = _reference16(x, indices, codebook, scales, bias, torch.zeros(batch, 37))
    good, _ = run_forward(emu, x, indices, codebook, scales, bias, order="forward")
    torch.testing.assert_close(good.double(), want.detach(), rtol=2e-5, atol=2e-5)
    bad, plan = run_forward((lib, emu[1]), x, indices, codebook, scales, bias, order="forward")
    assert plan.kernel.startswith(kernel.split()[-1].rstrip("(") + "_u16")
    assert not torch.allclose(bad.double(), want.detach(), rtol=1e-3, atol=1e-3)


def test_lut_scan_dcodebook_ignores_a_non_finite_x_for_unselected_codes(emu):
    # batch < 32 takes the per-row code scan; an entry no index selects must get no x term
    # (0 * inf), as in the dense product
    x, indices, codebook, scales, bias = make_inputs(3, 12, 4, 8, 1, 64, torch.float32)
    indices[indices == 5] = 6
    x[1, 0] = float("inf")
    _, gc, _, _ = run_backward(emu, torch.randn(3, 12), x, indices, codebook, scales,
                               [False, True, False, False])
    assert torch.equal(gc[0, 5], torch.zeros(8))
