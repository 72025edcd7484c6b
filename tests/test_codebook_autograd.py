"""Autograd-mode contract of rlx::codebook_matmul: every mode gives the derivative of the
math (checked against plain-PyTorch float64 code written here) or a clear error, never
zeros. Both the public function and the raw op are covered."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import rlx_torch


def dense(x, indices, codebook, scales=None, bias=None):
    """The op written with differentiable torch ops (uint8 or 16-bit codes)."""
    idx = indices.to(torch.int64) % (256 if indices.dtype == torch.uint8 else 65536)
    if idx.dim() == 2:
        idx, codebook = idx.unsqueeze(-1), codebook.unsqueeze(0)
    weight = sum(codebook[m][idx[:, :, m]] for m in range(idx.shape[-1]))
    out = x @ weight.reshape(idx.shape[0], -1).T
    if scales is not None:
        out = out * scales
    return out + bias if bias is not None else out


def public(x, indices, codebook, scales=None, bias=None):
    return rlx_torch.codebook_matmul(x, indices, codebook, scales, bias)


def raw(x, indices, codebook, scales=None, bias=None):
    return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)


ENTRY_POINTS = {"public": public, "raw_op": raw}


def inputs(index_dtype=torch.uint8, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = 6  # int16 codes take the gather path whatever E is
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    idx = torch.randint(0, e, (5, 2, 2), generator=g).to(index_dtype)
    cb = torch.randn(2, e, 4, generator=g, dtype=torch.float64)
    s = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(5, generator=g, dtype=torch.float64)
    return x, idx, cb, s, b


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert b.abs().max() > 1e-3  # a meaningful comparison: the expected value is not ~0


@pytest.fixture(params=[torch.uint8, torch.int16], ids=["u8", "i16"])
def case(request):
    return inputs(request.param)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_gradcheck_forward_and_reverse_and_gradgradcheck(entry, case):
    f, (x, idx, cb, s, b) = ENTRY_POINTS[entry], case
    leaves = [t.clone().requires_grad_() for t in (x, cb, s, b)]

    def fn(x, cb, s, b):
        return f(x, idx, cb, s, b)

    assert torch.autograd.gradcheck(fn, leaves, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_forward_ad_dual_tensors(entry, case):
    f, (x, idx, cb, s, b) = ENTRY_POINTS[entry], case
    tangents = [torch.randn_like(t) for t in (x, cb, s, b)]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip((x, cb, s, b), tangents, strict=True)]
        got = fwAD.unpack_dual(f(duals[0], idx, *duals[1:])).tangent
    _, want = jvp(lambda *a: dense(a[0], idx, *a[1:]), (x, cb, s, b), tuple(tangents))
    close(got, want)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_torch_func_jvp_jacfwd_grad_vmap(entry, case):
    f, (x, idx, cb, s, b) = ENTRY_POINTS[entry], case
    args = (x, cb, s, b)
    ours = lambda *a: f(a[0], idx, *a[1:])  # noqa: E731
    ref = lambda *a: dense(a[0], idx, *a[1:])  # noqa: E731
    tangents = tuple(torch.randn_like(t) for t in args)
    close(jvp(ours, args, tangents)[1], jvp(ref, args, tangents)[1])
    if entry == "public":
        for got, want in zip(jacfwd(ours, argnums=(0, 1, 2, 3))(*args),
                             jacfwd(ref, argnums=(0, 1, 2, 3))(*args), strict=True):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    else:  # jacfwd is vmap over jvp: two transform levels
        with pytest.raises(RuntimeError, match="nested torch.func transforms"):
            jacfwd(ours, argnums=(0, 1, 2, 3))(*args)
    loss = lambda *a: (ours(*a) ** 3).sum()  # noqa: E731
    loss_ref = lambda *a: (ref(*a) ** 3).sum()  # noqa: E731
    for i in range(4):
        close(grad(loss, argnums=i)(*args), grad(loss_ref, argnums=i)(*args))
    xs = torch.randn(4, *x.shape, dtype=x.dtype)
    bs = torch.randn(4, *b.shape, dtype=b.dtype)
    close(vmap(ours, in_dims=(0, None, None, 0))(xs, cb, s, bs),
          vmap(ref, in_dims=(0, None, None, 0))(xs, cb, s, bs))


def test_gradient_penalty_through_grad_x(case):
    # d/dtheta of |dL/dx|^2 with L = y.sum(): the first-order backward must itself be
    # differentiable (a once_differentiable backward silently drops this).
    x, idx, cb, s, b = case
    results = []
    for f in (public, raw, dense):
        leaves = [t.clone().requires_grad_() for t in (x, cb, s, b)]
        (gx,) = torch.autograd.grad(f(leaves[0], idx, *leaves[1:]).sum(), leaves[0],
                                    create_graph=True)
        results.append(torch.autograd.grad((gx**2).sum(), leaves[1:3]))
    for got in results[:2]:
        for g, w in zip(got, results[2], strict=True):
            close(g, w)


def test_nested_torch_func_on_the_public_function(case):
    x, idx, cb, s, b = case
    f = lambda x: (public(x, idx, cb, s, b) ** 2).sum()  # noqa: E731
    fr = lambda x: (dense(x, idx, cb, s, b) ** 2).sum()  # noqa: E731
    close(jacrev(jacrev(f))(x), jacrev(jacrev(fr))(x))
    t = torch.randn_like(x)
    close(jvp(grad(f), (x,), (t,))[1], jvp(grad(fr), (x,), (t,))[1])
    close(grad(lambda x: grad(f)(x).sum())(x), grad(lambda x: grad(fr)(x).sum())(x))


def test_nested_torch_func_on_the_raw_op_is_a_clear_error(case):
    x, idx, cb, s, b = case
    f = lambda x: (raw(x, idx, cb, s, b) ** 2).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="nested torch.func transforms"):
        grad(lambda x: grad(f)(x).sum())(x)


def test_backward_op_is_differentiable_in_every_input(case):
    x, idx, cb, s, _ = case
    g = torch.randn(3, 5, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (g, x, cb, s)]

    def bw(g, x, cb, s):
        return torch.ops.rlx.codebook_matmul_backward(g, x, idx, cb, s, [True] * 4)

    assert torch.autograd.gradcheck(bw, leaves, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(bw, leaves)
