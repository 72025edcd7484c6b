"""Autograd modes of the gated delta rule: every mode is either right (checked against
plain autograd or a loop) or raises a clear error; none returns zeros.

- reverse mode: torch.autograd, torch.func.grad / vjp / jacrev, vmap (alone and over grad);
- forward mode (torch.autograd.forward_ad, torch.func.jvp / jacfwd): a clear error;
- double backward (create_graph=True, gradgradcheck, hessian, jacrev of jacrev): a clear error.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import rlx_torch
from rlx_torch.nn import GatedDeltaNet
from rlx_torch.ops.gated_delta import l2norm

FORWARD_AD = "does not support forward-mode AD"
DOUBLE_BACKWARD = "does not support double backward"


def inputs(per_channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 7, 2, 4, 3
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, *((K,) if per_channel else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0


def loss_fn(q, k, v, g, beta, h0, l2=False):
    o, ht = rlx_torch.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True, use_qk_l2norm=l2)
    return o.square().sum() + (ht * ht.detach().sign()).sum()


def autograd_grads(args, l2=False):
    leaves = [a.clone().requires_grad_() for a in args]
    return torch.autograd.grad(loss_fn(*leaves, l2=l2), leaves)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("l2", [False, True])
def test_func_grad_vjp_jacrev_match_autograd(per_channel, l2):
    args = inputs(per_channel)
    want = autograd_grads(args, l2)
    argnums = tuple(range(6))
    got = torch.func.grad(lambda *a: loss_fn(*a, l2=l2), argnums=argnums)(*args)
    _, vjp_fn = torch.func.vjp(lambda *a: loss_fn(*a, l2=l2), *args)
    got_vjp = vjp_fn(torch.tensor(1.0, dtype=torch.float64))
    got_jacrev = torch.func.jacrev(lambda *a: loss_fn(*a, l2=l2), argnums=argnums)(*args)
    for w, a, b, c in zip(want, got, got_vjp, got_jacrev, strict=True):
        assert w.abs().max() > 0
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b, w, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c, w, rtol=1e-10, atol=1e-12)


def test_vmap_and_vmap_of_grad_match_a_loop():
    q, k, v, g, beta, h0 = inputs()
    qs = torch.randn(3, *q.shape, dtype=q.dtype)

    def out(x):
        return rlx_torch.gated_delta_rule(x, k, v, g, beta, initial_state=h0)[0]

    torch.testing.assert_close(torch.func.vmap(out)(qs), torch.stack([out(x) for x in qs]),
                               rtol=0, atol=0)
    grad = torch.func.grad(lambda x: out(x).square().sum())
    looped = []
    for x in qs:
        leaf = x.clone().requires_grad_()
        out(leaf).square().sum().backward()
        looped.append(leaf.grad)
    torch.testing.assert_close(torch.func.vmap(grad)(qs), torch.stack(looped), rtol=1e-12,
                               atol=1e-12)


def test_func_grad_of_the_layer_parameters():
    torch.manual_seed(0)
    layer = GatedDeltaNet(8, num_heads=2, head_dim=4, num_v_heads=2, expand_v=1).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    got = torch.func.grad(
        lambda p: torch.func.functional_call(layer, p, (x,))[0].square().sum())(params)
    layer(x)[0].square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("which", ["q", "g", "initial_state"])
def test_forward_ad_raises(which):
    args = list(inputs())
    index = {"q": 0, "g": 3, "initial_state": 5}[which]
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=FORWARD_AD + f".*{which}"):
        args[index] = fwAD.make_dual(args[index], torch.randn_like(args[index]))
        loss_fn(*args)


def test_func_jvp_and_jacfwd_raise():
    q, k, v, g, beta, h0 = inputs()

    def f(x):
        return rlx_torch.gated_delta_rule(x, k, v, g, beta, initial_state=h0)[0]

    with pytest.raises(RuntimeError, match=FORWARD_AD):
        torch.func.jvp(f, (q,), (torch.randn_like(q),))
    with pytest.raises(RuntimeError, match=FORWARD_AD):
        torch.func.jacfwd(f)(q)


def test_l2norm_forward_ad_is_right():
    """The public l2norm takes plain PyTorch ops under forward AD (the native op has no
    forward formula) instead of returning zero tangents."""
    x = torch.randn(3, 5, dtype=torch.float64)
    t = torch.randn_like(x)
    _, got = torch.func.jvp(l2norm, (x,), (t,))
    _, want = torch.func.jvp(lambda y: y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6),
                             (x,), (t,))
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
def test_double_backward_raises(per_channel):
    """A gradient penalty through dL/dq of ``o.sum()`` (grad_o does not require grad) used
    to come back as zeros."""
    leaves = [a.clone().requires_grad_() for a in inputs(per_channel)]
    o, _ = rlx_torch.gated_delta_rule(*leaves[:5], initial_state=leaves[5])
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(o.sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.gradgradcheck(
            lambda q: rlx_torch.gated_delta_rule(q, *[t.detach() for t in leaves[1:5]])[0],
            (leaves[0],))
    # first-order gradients with create_graph=False are unaffected
    o, _ = rlx_torch.gated_delta_rule(*leaves[:5], initial_state=leaves[5])
    assert torch.autograd.grad(o.sum(), leaves[0])[0].abs().max() > 0


def test_higher_order_func_transforms_raise():
    q, k, v, g, beta, h0 = inputs()

    def f(x):
        return rlx_torch.gated_delta_rule(x, k, v, g, beta, initial_state=h0)[0].square().sum()

    with pytest.raises(RuntimeError, match=f"{DOUBLE_BACKWARD}|{FORWARD_AD}"):
        torch.func.hessian(f)(q)  # jacfwd(jacrev)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.func.jacrev(torch.func.jacrev(f))(q)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.func.grad(lambda x: torch.func.grad(f)(x).sum())(q)


RAW_FWD = "rlx::gated_delta_fwd " + FORWARD_AD
RAW_BWD = "rlx::gated_delta_bwd " + FORWARD_AD


def raw_forward(q, k, v, g, beta, h0, chunk=4):
    return torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, 0.5, h0, None, chunk)


def raw_backward_args(per_channel=False):
    q, k, v, g, beta, h0 = inputs(per_channel)
    o, ht, ckpt, vw = raw_forward(q, k, v, g, beta, h0)
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    return [q, k, v, g, beta, 0.5, h0, None, ckpt, go, gh, 4, None, vw]


@pytest.mark.parametrize("which", ["q", "k", "v", "g", "beta", "initial_state"])
def test_raw_forward_op_rejects_tangents(which):
    """torch.ops.rlx.gated_delta_fwd called directly with dual tensors raises (outputs
    without tangents would be zeros to torch.func.jvp, a silent wrong answer)."""
    args = list(inputs())
    index = ("q", "k", "v", "g", "beta", "initial_state").index(which)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=f"{RAW_FWD}.*inputs {which} "):
        args[index] = fwAD.make_dual(args[index], torch.randn_like(args[index]))
        raw_forward(*args)

    fixed = inputs()

    def f(x):
        a = list(fixed)
        a[index] = x
        return raw_forward(*a)[0]

    x = fixed[index]
    with pytest.raises(RuntimeError, match=RAW_FWD):
        torch.func.jvp(f, (x,), (torch.randn_like(x),))
    with pytest.raises(RuntimeError, match=RAW_FWD):
        torch.func.jacfwd(f)(x)


@pytest.mark.parametrize("which", ["q", "g", "checkpoints", "grad_o", "grad_final_state"])
def test_raw_backward_op_rejects_tangents(which):
    args = raw_backward_args()
    index = {"q": 0, "g": 3, "checkpoints": 8, "grad_o": 9, "grad_final_state": 10}[which]
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=f"{RAW_BWD}.*inputs {which} "):
        args[index] = fwAD.make_dual(args[index], torch.randn_like(args[index]))
        torch.ops.rlx.gated_delta_bwd(*args)

    fixed = raw_backward_args()

    def f(x):
        a = list(fixed)
        a[index] = x
        return torch.ops.rlx.gated_delta_bwd(*a)

    x = fixed[index]
    with pytest.raises(RuntimeError, match=RAW_BWD):
        torch.func.jvp(f, (x,), (torch.randn_like(x),))


@pytest.mark.parametrize("per_channel", [False, True])
def test_raw_forward_op_is_differentiable(per_channel):
    """Reverse mode through the op itself gives the public function's gradients (the same
    backward op); gradcheck in float64 and torch.func.grad over the op agree."""
    args = inputs(per_channel)
    leaves = [a.clone().requires_grad_() for a in args]
    o, ht, _, _ = raw_forward(*leaves, chunk=64)
    got = torch.autograd.grad(o.square().sum() + (ht * ht.detach().sign()).sum(), leaves)
    want = autograd_grads(args)  # scale K ** -0.5 = 0.5 and chunk 64, as here
    for a, w in zip(got, want, strict=True):
        assert w.abs().max() > 0
        torch.testing.assert_close(a, w, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda *a: raw_forward(*a)[:2], leaves)
    got_func = torch.func.grad(
        lambda x: raw_forward(x, *args[1:], chunk=64)[0].square().sum())(args[0])
    torch.testing.assert_close(got_func, want[0], rtol=0, atol=0)  # (the state skips q)


def test_raw_ops_double_backward_raises():
    leaves = [a.clone().requires_grad_() for a in inputs()]
    o, _, _, _ = raw_forward(*leaves)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        torch.autograd.grad(o.sum(), leaves[0], create_graph=True)
    # The backward op's output is not differentiable: differentiating it raises (rather than
    # treating it as a constant, a silently wrong second derivative).
    args = raw_backward_args()
    args[9] = args[9].requires_grad_()  # grad_o
    packed = torch.ops.rlx.gated_delta_bwd(*args)
    with pytest.raises(RuntimeError, match="rlx::gated_delta_bwd " + DOUBLE_BACKWARD +
                       ".*grad_o requiring grad"):
        packed.sum().backward()
    with torch.no_grad():  # without gradients: the plain op, no graph
        assert torch.ops.rlx.gated_delta_bwd(*args).grad_fn is None


def test_raw_forward_op_opcheck_with_gradients():
    """opcheck's autograd-registration and AOT-dispatch checks with inputs that require
    grad (they need an autograd kernel on the op)."""
    leaves = [a.clone().requires_grad_() for a in inputs(per_channel=True)]
    torch.library.opcheck(torch.ops.rlx.gated_delta_fwd.default,
                          (*leaves[:5], 0.5, leaves[5], None, 4, None))
