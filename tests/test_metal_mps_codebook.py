"""The codebook matmul on a real Apple GPU (device="mps") against the CPU op: forward and
backward over the emulator tests' shapes and every dtype, views with storage offsets, the
autograd entry point, opcheck, determinism and errors. Skipped where MPS is unavailable (Linux,
and GitHub's hosted macOS runners, whose MPS device is unusable: set RLX_SKIP_MPS=1 there)."""

import os

import pytest
import torch

import rlx_torch  # noqa: F401
from rlx_torch.ops.codebook import codebook_matmul
from tests.test_metal_codebook_emulator import CASES, CASES16, make_inputs, make_inputs16

pytestmark = pytest.mark.skipif(
    not torch.backends.mps.is_available() or os.environ.get("RLX_SKIP_MPS") == "1",
    reason="needs an Apple GPU (torch.backends.mps.is_available())",
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def mps(*ts):
    return [None if t is None else t.to("mps") for t in ts]


def assert_close(got, want, tol, what):
    got, want = got.cpu().double(), want.cpu().double()
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = tol * max(1.0, want.abs().max().item() if want.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def _ids(c):
    return "b{}_n{}_g{}_d{}_m{}_e{}".format(*c)


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_cpu(case, dtype):
    b, n, groups, d, m, e = case
    args = make_inputs(b, n, groups, d, m, e, dtype, seed=b + n)
    want = torch.ops.rlx.codebook_matmul(*args)
    got = torch.ops.rlx.codebook_matmul(*mps(*args))
    assert got.device.type == "mps" and got.dtype == dtype
    assert_close(got, want, TOL[dtype], "out")


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_matches_cpu(case, dtype):
    b, n, groups, d, m, e = case
    x, indices, codebook, scales, _ = make_inputs(b, n, groups, d, m, e, dtype, seed=b * n)
    grad_out = torch.randn(b, n).to(dtype)
    mask = [True, True, True, True]
    want = torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)
    got = torch.ops.rlx.codebook_matmul_backward(*mps(grad_out, x, indices, codebook, scales),
                                                 mask)
    for name, g, w in zip(["grad_x", "grad_codebook", "grad_scales", "grad_bias"], got, want,
                          strict=True):
        assert_close(g, w, TOL[dtype], name)
    again = torch.ops.rlx.codebook_matmul_backward(*mps(grad_out, x, indices, codebook, scales),
                                                   mask)
    for g0, g1 in zip(got, again, strict=True):  # deterministic: bitwise identical
        assert torch.equal(g0.cpu(), g1.cpu())


@pytest.mark.parametrize("offset", [0, 1, 3, 17])
def test_views_bind_at_their_storage_offset(offset):
    x, indices, codebook, scales, bias = make_inputs(4, 9, 5, 8, 2, 16, torch.float32)
    big = torch.randn(4 * 40 + offset)
    xv = big[offset : offset + 4 * 40].view(4, 40)  # a view starting at element `offset`
    want = torch.ops.rlx.codebook_matmul(xv, indices, codebook, scales, bias)
    big_m = big.to("mps")
    xv_m = big_m[offset : offset + 4 * 40].view(4, 40)
    got = torch.ops.rlx.codebook_matmul(xv_m, *mps(indices, codebook, scales, bias))
    assert_close(got, want, 1e-4, "out")
    # non-contiguous input (a transposed view) too
    xt = torch.randn(40, 4)
    assert_close(torch.ops.rlx.codebook_matmul(xt.to("mps").t(), *mps(indices, codebook), None,
                                               None),
                 torch.ops.rlx.codebook_matmul(xt.t(), indices, codebook, None, None), 1e-4,
                 "transposed")


def test_autograd_entry_point():
    x, indices, codebook, scales, bias = make_inputs(3, 21, 6, 8, 1, 256, torch.float32)
    leaves_cpu = [t.clone().requires_grad_() for t in (x, codebook, scales, bias)]
    leaves_mps = [t.to("mps").requires_grad_() for t in (x, codebook, scales, bias)]
    outs = []
    for (xx, cc, ss, bb), idx in [(leaves_cpu, indices), (leaves_mps, indices.to("mps"))]:
        out = codebook_matmul(xx, idx, cc, ss, bb)
        out.square().sum().backward()
        outs.append(out)
    assert_close(outs[1], outs[0], 1e-4, "out")
    for a, b in zip(leaves_mps, leaves_cpu, strict=True):
        assert_close(a.grad, b.grad, 1e-4, "grad")


def test_opcheck_on_mps():
    x, indices, codebook, scales, bias = mps(*make_inputs(5, 13, 4, 8, 2, 32, torch.float32))
    torch.library.opcheck(torch.ops.rlx.codebook_matmul.default, (x, indices, codebook, scales,
                                                                  bias))
    grad_out = torch.randn(5, 13, device="mps")
    torch.library.opcheck(torch.ops.rlx.codebook_matmul_backward.default,
                          (grad_out, x, indices, codebook, scales, [True, True, True, True]))


def test_empty_batch_and_errors():
    x, indices, codebook, scales, bias = mps(*make_inputs(0, 5, 3, 4, 1, 8, torch.float32))
    assert torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias).shape == (0, 5)
    with pytest.raises(ValueError, match="x must be float32"):
        xi, ii, ci = make_inputs(2, 5, 3, 4, 1, 8, torch.float32)[:3]
        # the shared checks (rlx/codebook.h) reject an int x on every device
        torch.ops.rlx.codebook_matmul(*mps(xi.int(), ii, ci.int()), None, None)
    with pytest.raises(ValueError, match="indices must be on x's device"):
        torch.ops.rlx.codebook_matmul(x, indices.cpu(), codebook, None, None)


@pytest.mark.parametrize("case", CASES16, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_16bit_forward_and_backward_match_cpu(case, dtype):
    b, n, groups, d, m, e = case
    x, indices, codebook, scales, bias = make_inputs16(b, n, groups, d, m, e, dtype, seed=b + n)
    want = torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
    got = torch.ops.rlx.codebook_matmul(*mps(x, indices, codebook, scales, bias))
    assert_close(got, want, TOL[dtype], "out")
    grad_out = torch.randn(b, n).to(dtype)
    want = torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales,
                                                  [True] * 4)
    got = torch.ops.rlx.codebook_matmul_backward(*mps(grad_out, x, indices, codebook, scales),
                                                 [True] * 4)
    for name, g, w in zip(["grad_x", "grad_codebook", "grad_scales", "grad_bias"], got, want,
                          strict=True):
        assert_close(g, w, TOL[dtype], name)
