"""rlx_torch.optim.Muon under hostile input: weight decay on every dtype and path, huge
gradients, subnormal weight decay, load_state_dict validation, and the torch.optim.Muon API
(positional arguments, its state_dict)."""

import copy
import inspect
import math

import pytest
import torch
from torch import nn

from rlx_torch.optim import KELLER, Muon
from rlx_torch.optim import muon as muon_module

SHAPE = (16, 24)
SCALE = math.sqrt(max(1, SHAPE[0] / SHAPE[1]))  # "original" adjustment


def reference_ns(G, steps=5):
    """Keller's Newton–Schulz in float64, per matrix (the oracle)."""
    X = G.double()
    if X.shape[0] > X.shape[1]:
        return reference_ns(G.mT, steps).mT
    X = X / max(X.norm().item(), 1e-7)
    a, b, c = KELLER
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def make_param(start, dtype, contiguous):
    data = start.to(dtype, copy=True)
    if not contiguous:  # same values, transposed storage
        data = data.mT.contiguous().mT
    p = nn.Parameter(data)
    assert p.is_contiguous() == contiguous
    return p


def one_step(start, grad, dtype, contiguous, lr, wd, lr_kind, monkeypatch, **kw):
    p = make_param(start, dtype, contiguous)
    p.grad = grad.to(dtype)
    lr_value = torch.tensor(lr, dtype=torch.float64) if lr_kind != "float" else lr
    with monkeypatch.context() as m:
        if lr_kind == "device tensor":
            # What a CUDA/MPS tensor lr takes: the tensor arithmetic (no read-back), on CPU.
            m.setattr(muon_module, "_host_scalar", lambda value: value)
        Muon([p], lr=lr_value, weight_decay=wd, momentum=0.9, **kw).step()
    return p.detach()


DTYPE_PATHS = [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True),
               (torch.bfloat16, False), (torch.float16, True), (torch.float16, False),
               (torch.float64, True), (torch.float64, False)]


@pytest.mark.parametrize("dtype, contiguous", DTYPE_PATHS)
@pytest.mark.parametrize("lr_kind", ["float", "cpu tensor", "device tensor"])
def test_weight_decay_on_every_dtype_and_path_matches_the_closed_form(dtype, contiguous,
                                                                      lr_kind, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    start = (0.1 * torch.randn(SHAPE, generator=gen)).to(dtype).double()
    grad = torch.randn(SHAPE, generator=gen).to(dtype).double()
    lr, wd = 0.1, 2.0
    decayed = one_step(start, grad, dtype, contiguous, lr, wd, lr_kind, monkeypatch).double()
    plain = one_step(start, grad, dtype, contiguous, lr, 0.0, lr_kind, monkeypatch).double()
    # The orthogonalized update, as the run without decay applied it: the Newton–Schulz result
    # of the Nesterov input (float64 oracle), up to NS and param rounding.
    ortho = (start - plain) / (lr * SCALE)
    update = grad.lerp(0.1 * grad, 0.9)  # first step: buf = (1 - mu) g
    exact = reference_ns(update)
    assert ((ortho - exact).norm() / exact.norm()).item() < 0.05
    # p <- (1 - lr wd) p - lr s O, within a few roundings of the param dtype.
    expected = (1 - lr * wd) * start - lr * SCALE * ortho
    ulp = torch.finfo(dtype).eps
    tol = 4 * ulp * (start.abs() + (lr * SCALE * ortho).abs()) + 1e-30
    assert ((decayed - expected).abs() <= tol).all(), (decayed - expected).abs().max()
    # The decay itself (0.2 |p|) is far above that tolerance: the test sees it missing.
    assert ((plain - expected).abs() > tol).float().mean() > 0.9


HUGE_PATHS = [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True),
              (torch.bfloat16, False), (torch.float64, True)]


@pytest.mark.parametrize("dtype, contiguous", HUGE_PATHS)
@pytest.mark.parametrize("exponent", [64, 100, 120])
def test_huge_gradients_move_as_their_scaled_down_copies(dtype, contiguous, exponent,
                                                         monkeypatch):
    # Orthogonalization is scale-invariant, and scaling by a power of two is exact: a gradient
    # 2^exponent times larger (beyond ~1.8e19 the float32 sum of squares overflows) must give
    # bit for bit the same step.
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(SHAPE, generator=gen).to(dtype).double()
    grad = torch.randn(SHAPE, generator=gen).to(dtype).double()
    small = one_step(start, grad, dtype, contiguous, 0.1, 0.0, "float", monkeypatch)
    huge = one_step(start, grad * 2.0**exponent, dtype, contiguous, 0.1, 0.0, "float",
                    monkeypatch)
    assert not torch.equal(small, start.to(dtype))  # the step moved the param
    assert torch.equal(huge, small)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_of_huge_matrices_is_that_of_scaled_ones(ns_dtype):
    from rlx_torch.optim import newton_schulz, resolve_schedule

    G = torch.randn(3, 12, 20)
    schedule = resolve_schedule("keller", 5)
    out = newton_schulz(G, schedule, 1e-7, ns_dtype)
    for exponent in (64, 120):
        assert torch.equal(newton_schulz(G * 2.0**exponent, schedule, 1e-7, ns_dtype), out)
    # A tiny matrix stays below eps: its update is zero-ish, not blown up.
    assert newton_schulz(G * 1e-30, schedule, 1e-7, ns_dtype).abs().max() < 1e-15


@pytest.mark.parametrize("dtype, contiguous", DTYPE_PATHS)
@pytest.mark.parametrize("wd", [1e-40, 1e-310, 5e-324])
def test_subnormal_weight_decay_is_no_decay(dtype, contiguous, wd, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(SHAPE, generator=gen).to(dtype).double()
    grad = torch.randn(SHAPE, generator=gen).to(dtype).double()
    tiny = one_step(start, grad, dtype, contiguous, 0.1, wd, "float", monkeypatch)
    none = one_step(start, grad, dtype, contiguous, 0.1, 0.0, "float", monkeypatch)
    assert torch.isfinite(tiny).all()
    # Equal up to the rounding of the path taken (the decay factor is exactly 1 here).
    tol = 2 * torch.finfo(dtype).eps * none.double().abs()
    assert ((tiny.double() - none.double()).abs() <= tol).all()


# ---- load_state_dict ----


def two_group_optimizer():
    w = nn.Parameter(torch.randn(6, 5))
    b = nn.Parameter(torch.randn(5))
    opt = Muon([dict(params=[w]), dict(params=[b], use_muon=False, lr=1e-3)], lr=0.02)
    w.grad, b.grad = torch.randn(6, 5), torch.randn(5)
    opt.step()
    return opt


@pytest.mark.parametrize("key, value", [("momentum", 1.5), ("lr", -1.0), ("nesterov", "yes"),
                                        ("ns_steps", 0), ("adjust_lr_fn", "sqrt"),
                                        ("eps", 0.0)])
def test_load_state_dict_rejects_invalid_hyperparameters(key, value):
    state = two_group_optimizer().state_dict()
    state["param_groups"][0][key] = value
    opt = two_group_optimizer()
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=rf"param_groups\[0\].*{key}"):
        opt.load_state_dict(state)
    assert [dict(g) for g in opt.param_groups] == before  # nothing was loaded


def test_load_state_dict_rejects_a_muon_group_over_an_adamw_group():
    state = two_group_optimizer().state_dict()
    state["param_groups"].reverse()  # the Muon group now faces the AdamW group
    with pytest.raises(ValueError, match=r"param_groups\[0\] was saved as a AdamW"):
        two_group_optimizer().load_state_dict(state)
    only_muon = Muon([nn.Parameter(torch.randn(6, 5))]).state_dict()
    adamw = Muon([dict(params=[nn.Parameter(torch.randn(6, 5))], use_muon=False)])
    with pytest.raises(ValueError, match=r"saved as a Muon group but is a AdamW"):
        adamw.load_state_dict(only_muon)


def test_load_state_dict_rejects_state_of_the_wrong_shape_or_kind():
    state = two_group_optimizer().state_dict()
    state["state"][0]["momentum_buffer"] = torch.zeros(5, 6)
    with pytest.raises(ValueError, match="momentum_buffer.*shape"):
        two_group_optimizer().load_state_dict(state)
    state = two_group_optimizer().state_dict()
    del state["state"][1]["exp_avg_sq"]
    with pytest.raises(ValueError, match="exp_avg_sq"):
        two_group_optimizer().load_state_dict(state)


def test_reads_torch_optim_muon_state_dict_and_continues_like_it():
    gen = torch.Generator().manual_seed(11)
    start = [torch.randn(s, generator=gen) for s in ((12, 8), (8, 20))]
    grads = [[torch.randn(s.shape, generator=gen) for s in start] for _ in range(4)]
    theirs = [nn.Parameter(s.clone()) for s in start]
    torch_opt = torch.optim.Muon(theirs, lr=0.03, weight_decay=0.05, momentum=0.9)
    for step in range(3):
        for p, g in zip(theirs, grads[step], strict=True):
            p.grad = g.clone()
        torch_opt.step()
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt = Muon(ours, ns_dtype=torch.bfloat16)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as if read from a file
    group = opt.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.03, 0.05, 0.9)
    assert group["adjust_lr_fn"] is None and group["use_muon"] is True
    assert group["ns_dtype"] is torch.bfloat16  # our key, kept from this optimizer
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], torch_opt.state[q]["momentum_buffer"])
    for p, q, g in zip(ours, theirs, grads[3], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    torch_opt.step()
    for p, q, s in zip(ours, theirs, start, strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   torch_opt.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-7)
        # Same step up to bf16 Newton–Schulz rounding.
        assert ((p - q).abs().max() / (q.detach() - s).abs().max()).item() < 0.03
    # And the other way: torch.optim.Muon reads our state_dict.
    back = torch.optim.Muon([nn.Parameter(p.detach().clone()) for p in ours])
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert back.param_groups[0]["lr"] == 0.03


# ---- the torch.optim.Muon API ----


def test_positional_arguments_are_torch_optim_muons():
    ours = inspect.signature(Muon.__init__).parameters
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in list(ours.items())[len(theirs):]:
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
    for name in theirs:
        if name in ("self", "params"):
            continue
        assert ours[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
    # The same positional call means the same thing in both.
    args = (0.01, 0.2, 0.8, False, (3.0, -3.2, 1.2), 1e-6, 4, "match_rms_adamw")
    w = nn.Parameter(torch.randn(4, 6))
    ours_group = Muon([w], *args).param_groups[0]
    theirs_group = torch.optim.Muon([w], *args).param_groups[0]
    for key, value in theirs_group.items():
        if key != "params":
            assert ours_group[key] == value, key
    assert Muon([w]).param_groups[0]["ns_coefficients"] == torch.optim.Muon(
        [w]).param_groups[0]["ns_coefficients"]


def test_adjust_lr_fn_means_what_torch_means(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    start, grad = torch.randn(20, 8, generator=gen), torch.randn(20, 8, generator=gen)

    def moved(adjust):
        return (start - one_step(start.double(), grad.double(), torch.float64, True, 0.1, 0.0,
                                 "float", monkeypatch, adjust_lr_fn=adjust)).norm().item()

    original = moved("original")
    assert moved(None) == original  # None is "original", as in torch.optim.Muon
    assert moved("identity") == pytest.approx(original / math.sqrt(20 / 8), rel=1e-12)
    assert moved("match_rms_adamw") == pytest.approx(original * 0.2 * 20 / math.sqrt(20 / 8)
                                                     / math.sqrt(20), rel=1e-12)
