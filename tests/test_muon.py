"""rlx_torch.optim.Muon: parity with torch.optim.Muon, batching, shapes, AdamW side, edge cases.
(Newton–Schulz: tests/test_newton_schulz.py; param groups: tests/test_param_groups.py; the fused
CPU ops: tests/test_muon_update.py.)"""

import copy
import importlib
import io
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import rlx_torch
from rlx_torch.ops import reference
from rlx_torch.optim import Muon, muon_param_groups, resolve_schedule
from rlx_torch.optim import muon as muon_module
from tests.ns_reference import KELLER, reference_ns
from tests.test_param_groups import TinyLM

# The package re-exports the function `newton_schulz` under its module's name.
ns_module = importlib.import_module("rlx_torch.optim.newton_schulz")

def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32, bias=False),
        nn.Tanh(),
        nn.Linear(32, 24, bias=False),
        nn.Tanh(),
        nn.Linear(24, 8, bias=False),
    )


def train(net, opt, steps, x, y):
    for _ in range(steps):
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


# ---- parity with torch.optim.Muon ----


def reference_muon_trajectory(steps, x, y, lr, weight_decay, momentum, nesterov, ns_steps):
    """torch.optim.Muon's algorithm written from its definition, all in float64."""
    net = small_mlp().double()
    params = list(net.parameters())
    bufs = [torch.zeros_like(p) for p in params]
    for _ in range(steps):
        net.zero_grad()
        ((net(x.double()) - y.double()) ** 2).mean().backward()
        with torch.no_grad():
            for p, buf in zip(params, bufs, strict=True):
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if nesterov else buf
                ortho = reference_ns(update, [KELLER] * ns_steps)
                p.mul_(1 - lr * weight_decay)
                p.sub_(lr * math.sqrt(max(1, p.shape[0] / p.shape[1])) * ortho)
    return [p.detach().float() for p in params]


def test_trajectory_matches_torch_muon_within_bf16_tolerance():
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5)
    start = [p.detach().clone() for p in small_mlp().parameters()]
    exact = reference_muon_trajectory(20, x, y, **settings)

    net = small_mlp()
    theirs = train(net, torch.optim.Muon(net.parameters(), adjust_lr_fn="original",
                                         ns_coefficients=KELLER, **settings), 20, x, y)

    def ours(**overrides):
        net = small_mlp()
        kw = dict(settings, ns_dtype=torch.bfloat16, ns_coefficients="keller",
                  adjust_lr_fn="original")
        kw.update(overrides)
        return train(net, Muon(net.parameters(), **kw), 20, x, y)

    def max_rel_gap(a_params, b_params):
        """Largest difference, relative to each matrix's total displacement."""
        return max(
            ((a - b).abs().max() / (b - s).abs().max()).item()
            for a, b, s in zip(a_params, b_params, start, strict=True)
        )

    # The noise floor of bf16 Newton–Schulz on this platform: how far torch.optim.Muon's own
    # bf16 run ends from the exact trajectory after 20 steps (last-bit differences of its
    # matmuls, amplified by training; it differs between x86 and Arm).
    floor = max_rel_gap(theirs, exact)
    # Without bf16 rounding our step is the exact algorithm, far below that floor ...
    assert max_rel_gap(ours(ns_dtype=torch.float32), exact) < floor / 20
    # ... and with bf16 NS it is as close to exact as torch's bf16 run is, and so close to it.
    assert max_rel_gap(ours(), exact) < 2 * floor
    assert max_rel_gap(ours(), theirs) < 3 * floor
    # Real differences in the settings stand far out of the float32 bound.
    assert max_rel_gap(ours(nesterov=False, ns_dtype=torch.float32), exact) > floor
    assert max_rel_gap(ours(adjust_lr_fn="match_rms_adamw", ns_dtype=torch.float32),
                       exact) > floor


def test_adamw_side_matches_torch_adamw_exactly():
    torch.manual_seed(0)
    params = [torch.randn(7), torch.randn(3, 5), torch.randn(())]
    mine = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    opt = Muon([dict(params=mine, use_muon=False, lr=3e-3, weight_decay=0.05)],
               adamw_betas=(0.8, 0.97), adamw_eps=1e-6)
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.8, 0.97), eps=1e-6, weight_decay=0.05,
                            foreach=True)
    for step in range(8):
        grads = [torch.randn_like(p) * (step + 1) for p in params]
        for ps, o in ((mine, opt), (theirs, ref)):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            o.step()
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def record_newton_schulz_batches(monkeypatch):
    """Returns a list that collects the shape of every batch Muon hands to newton_schulz."""
    seen = []
    real = muon_module.newton_schulz

    def spy(G, *args, **kwargs):
        seen.append(tuple(G.shape))
        return real(G, *args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", spy)
    return seen


def test_same_shape_matrices_are_orthogonalized_in_one_batch(monkeypatch):
    seen = record_newton_schulz_batches(monkeypatch)
    shapes = [(8, 8), (16, 8), (8, 8), (3, 8, 8), (16, 8), (8, 8)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    Muon(params).step()
    # Tall matrices reach newton_schulz as their transposes where they are iterated wide
    # (bf16 NS through bmm: CPUs with AMX).
    ns_dtype = muon_module.default_ns_dtype(torch.device("cpu"), torch.float32)
    wide = muon_module.iterates_wide((16, 8), torch.device("cpu"), ns_dtype)
    assert sorted(seen) == [(2, 8, 16) if wide else (2, 16, 8), (6, 8, 8)]


def test_muon_step_takes_the_gram_form_for_wide_and_tall_params_on_cpu(monkeypatch):
    seen = []
    real = ns_module._gram_iterations

    def spy(X, schedule, tall, products):
        seen.append((tuple(X.shape), tall))
        return real(X, schedule, tall, products)

    monkeypatch.setattr(ns_module, "_gram_iterations", spy)
    params = [nn.Parameter(torch.randn(s)) for s in [(8, 32), (32, 8), (16, 16), (16, 24)]]
    for p in params:
        p.grad = torch.randn_like(p)
    Muon(params, ns_dtype=torch.float32).step()
    assert sorted(seen) == [((1, 8, 32), False), ((1, 32, 8), True)]
    seen.clear()  # bf16 NS (the default on CPUs with native bf16): never the Gram form
    Muon(params, ns_dtype=torch.bfloat16).step()
    assert seen == []


def test_cpu_batches_are_split_at_the_cpu_limit_with_the_same_result(monkeypatch):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 8)) for _ in range(5)]
    for p in params:
        p.grad = torch.randn_like(p)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins, strict=True):
        t.grad = p.grad.clone()
    Muon(params).step()
    seen = record_newton_schulz_batches(monkeypatch)
    monkeypatch.setattr(muon_module, "CPU_MAX_BATCH_ELEMENTS", 2 * 64)
    Muon(twins).step()
    assert seen == [(2, 8, 8), (2, 8, 8), (1, 8, 8)]
    for p, t in zip(params, twins, strict=True):
        torch.testing.assert_close(t, p)


# ---- one step against the plain formula ----


@pytest.mark.parametrize(
    "adjust, scale",
    [("original", lambda r, c: math.sqrt(max(1, r / c))),
     ("match_rms_adamw", lambda r, c: 0.2 * math.sqrt(max(r, c))),
     (None, lambda r, c: math.sqrt(max(1, r / c))),  # None means "original", as in torch
     ("identity", lambda r, c: 1.0)],
)
@pytest.mark.parametrize("shape", [(12, 5), (5, 12)])
def test_single_step_formula(adjust, scale, shape):
    lr, mu, wd = 0.05, 0.9, 0.2
    p = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    start = p.detach().clone()
    g = torch.randn(shape, dtype=torch.float64)
    p.grad = g.clone()
    Muon([p], lr=lr, momentum=mu, weight_decay=wd, adjust_lr_fn=adjust).step()
    buf = (1 - mu) * g
    update = reference_ns(g.lerp(buf, mu), [KELLER] * 5)
    expected = start * (1 - lr * wd) - lr * scale(*shape) * update
    torch.testing.assert_close(p.detach(), expected)


def reference_matrices(shape, nd_mode):
    """Plain restatement of how a param is seen as matrices (see docs/optim.md)."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if nd_mode == "flatten" or (nd_mode == "auto" and len(shape) >= 4):
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


SCALES = {"original": lambda r, c: math.sqrt(max(1, r / c)),
          "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
          None: lambda r, c: math.sqrt(max(1, r / c)), "identity": lambda r, c: 1.0}

shapes_2d = st.tuples(st.integers(1, 9), st.integers(1, 9))
shapes_nd = st.one_of(shapes_2d, st.tuples(st.integers(1, 3), st.integers(1, 6), st.integers(1, 6)),
                      st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3),
                                st.integers(1, 3)))


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(shapes_nd, min_size=1, max_size=5),
    lr=st.floats(0.0, 0.2), momentum=st.floats(0.0, 0.99), nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 1e-6, 0.1, 0.5]),
    adjust=st.sampled_from(["original", "match_rms_adamw", None, "identity"]),
    nd_mode=st.sampled_from(["auto", "flatten", "batch"]),
    preset=st.sampled_from(["keller", "polar_express"]), seed=st.integers(0, 2**16),
)
def test_steps_match_per_param_reference(shapes, lr, momentum, nesterov, weight_decay, adjust,
                                         nd_mode, preset, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(s, dtype=torch.float64, generator=gen)) for s in shapes]
    expected = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    opt = Muon(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
               adjust_lr_fn=adjust, nd_mode=nd_mode, ns_coefficients=preset)
    schedule = resolve_schedule(preset, 5)
    for _ in range(2):
        for i, p in enumerate(params):
            g = torch.randn(p.shape, dtype=torch.float64, generator=gen)
            p.grad = g
            bufs[i] = bufs[i].lerp(g, 1 - momentum)
            u = g.lerp(bufs[i], momentum) if nesterov else bufs[i]
            count, rows, cols = reference_matrices(p.shape, nd_mode)
            mats = u.reshape(count, rows, cols)
            ortho = torch.stack([reference_ns(m, schedule.coefficients, safety=schedule.safety)
                                 for m in mats]).reshape(p.shape)
            expected[i] = expected[i] * (1 - lr * weight_decay) - lr * SCALES[adjust](
                rows, cols) * ortho
        opt.step()
    for p, e, b in zip(params, expected, bufs, strict=True):
        torch.testing.assert_close(p.detach(), e)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b)


# ---- > 2-D params ----


def _one_step(shape, **kw):
    torch.manual_seed(3)
    p = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    p.grad = torch.randn_like(p)
    grad = p.grad.clone()
    Muon([p], lr=0.1, **kw).step()
    return p.detach(), grad


def test_conv_weight_is_flattened():
    conv, grad = _one_step((6, 3, 3, 3))
    torch.manual_seed(3)
    start = torch.randn((6, 3, 3, 3), dtype=torch.float64)
    # From a zero buffer the Nesterov update is a multiple of g; NS is scale-invariant.
    update = reference_ns(grad.reshape(6, 27), [KELLER] * 5).reshape(6, 3, 3, 3)
    torch.testing.assert_close(conv, start - 0.1 * update)  # 6 x 27 is wide: scale 1


@pytest.mark.parametrize("nd_mode", ["auto", "batch"])
def test_3d_param_is_a_batch_of_matrices(nd_mode):
    stacked, grad = _one_step((3, 10, 4), nd_mode=nd_mode)
    torch.manual_seed(3)
    start = torch.randn((3, 10, 4), dtype=torch.float64)
    for e in range(3):
        expected = start[e] - 0.1 * math.sqrt(10 / 4) * reference_ns(grad[e], [KELLER] * 5)
        torch.testing.assert_close(stacked[e], expected)


def test_3d_param_flatten_mode():
    flat, grad = _one_step((3, 10, 4), nd_mode="flatten")
    torch.manual_seed(3)
    start = torch.randn((3, 10, 4), dtype=torch.float64)
    update = reference_ns(grad.reshape(3, 40), [KELLER] * 5).reshape(3, 10, 4)
    torch.testing.assert_close(flat, start - 0.1 * update)


# Layout must not change the step. In float32 the fused and op-by-op paths agree to rounding;
# in bf16 their NS inputs (normalised in C++ / in PyTorch, norms summed in another order) may
# round a few entries one bf16 ulp apart, which moves the step by about lr·scale·2⁻⁷ at most.
LAYOUT_NS_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _layout_tolerance(ns_dtype, steps, lr=0.02, scale=1.0):
    return 1e-5 if ns_dtype == torch.float32 else steps * lr * scale * 2.0**-7


@pytest.mark.parametrize("ns_dtype", LAYOUT_NS_DTYPES)
def test_non_contiguous_and_channels_last_params_match_contiguous(ns_dtype):
    torch.manual_seed(0)
    base = torch.randn(8, 4, 3, 3)
    grads = [torch.randn(8, 4, 3, 3) for _ in range(3)]
    a = nn.Parameter(base.clone())
    b = nn.Parameter(base.clone().to(memory_format=torch.channels_last))
    t = nn.Parameter(torch.randn(5, 9).T.contiguous().T)  # transposed storage
    t_ref = nn.Parameter(t.detach().contiguous().clone())
    opt_a = Muon([a, t_ref], weight_decay=0.1, ns_dtype=ns_dtype)
    opt_b = Muon([b, t], weight_decay=0.1, ns_dtype=ns_dtype)
    for g in grads:
        tg = torch.randn(5, 9)
        a.grad, b.grad = g.clone(), g.clone().to(memory_format=torch.channels_last)
        t.grad, t_ref.grad = tg.clone(), tg.clone()
        opt_a.step()
        opt_b.step()
    assert b.is_contiguous(memory_format=torch.channels_last)
    # float32: assert_close's own float32 tolerances
    tol = {} if ns_dtype == torch.float32 else {
        "rtol": 0, "atol": _layout_tolerance(ns_dtype, len(grads), scale=(36 / 8) ** 0.5)}
    torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(t, t_ref, **tol)


# ---- safety properties ----


@pytest.mark.parametrize("nesterov", [True, False])
def test_step_never_writes_grad_nor_aliases_momentum(nesterov):
    # bf16 params with ns_dtype bf16: the case where `grad.bfloat16()` returns the buffer itself
    # and an in-place normalisation would corrupt it (pytorch PR #194664).
    p = nn.Parameter(torch.randn(6, 4).bfloat16())
    g = torch.randn(6, 4).bfloat16()
    p.grad = g.clone()
    opt = Muon([p], momentum=0.9, nesterov=nesterov, ns_dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(p.grad, g)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch.lerp(torch.zeros_like(g), g,
                                                                           0.1), rtol=0, atol=0)


def test_params_without_grad_and_zero_grads():
    a, b, c = (nn.Parameter(torch.randn(4, 4)) for _ in range(3))
    before = [t.detach().clone() for t in (a, b, c)]
    b.grad = torch.zeros(4, 4)
    c.grad = torch.zeros(4, 4)
    opt = Muon([dict(params=[a, b], weight_decay=0.5), dict(params=[c])], lr=0.1)
    opt.step()
    assert torch.equal(a, before[0]) and a not in opt.state  # no grad: untouched, no state
    torch.testing.assert_close(b.detach(), before[1] * (1 - 0.1 * 0.5))  # only weight decay
    assert torch.equal(c, before[2])


def test_non_finite_grad_spoils_only_its_own_param():
    torch.manual_seed(0)
    good = [torch.randn(5, 5) for _ in range(2)]
    grads = [torch.randn(5, 5) for _ in range(2)]
    alone = [nn.Parameter(t.clone()) for t in good]
    batched = [nn.Parameter(t.clone()) for t in good]
    bad = nn.Parameter(torch.randn(5, 5))
    bad_bias = nn.Parameter(torch.randn(5))
    ok_bias = nn.Parameter(torch.zeros(5))
    opt_alone = Muon(alone)
    opt_batched = Muon([dict(params=[batched[0], bad, batched[1]]),
                        dict(params=[bad_bias, ok_bias], use_muon=False, lr=1e-3)])
    for step in range(3):
        for ps in (alone, batched):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g * (step + 1)
        bad.grad = torch.full((5, 5), float("nan") if step == 1 else 1.0)
        bad.grad[0, 0] = float("inf")
        bad_bias.grad = torch.full((5,), float("inf"))
        ok_bias.grad = torch.ones(5)
        opt_alone.step()
        opt_batched.step()
    for x, y in zip(alone, batched, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.isfinite(ok_bias).all()
    assert not torch.isfinite(bad).any() and not torch.isfinite(bad_bias).all()


def test_lr_scheduler_and_cpu_tensor_lr():
    def run(lr, schedule):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(6, 5))
        q = nn.Parameter(torch.randn(5))
        opt = Muon([dict(params=[p]), dict(params=[q], use_muon=False)], lr=lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s) if schedule else None
        for step in range(4):
            torch.manual_seed(step)
            p.grad, q.grad = torch.randn(6, 5), torch.randn(5)
            opt.step()
            if sched:
                sched.step()
        return p.detach(), q.detach(), opt.param_groups[0]["lr"]

    p1, q1, lr1 = run(0.04, True)
    p2, q2, lr2 = run(torch.tensor(0.04), True)
    p3, _, _ = run(0.04, False)
    assert lr1 == pytest.approx(0.04 * 0.5**4) and float(lr2) == pytest.approx(lr1)
    torch.testing.assert_close(p1, p2)
    torch.testing.assert_close(q1, q2)
    assert (p1 - p3).abs().max() > 1e-3  # the schedule really changed the steps


def test_state_dict_resume_is_bit_identical():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.LayerNorm(12), nn.Linear(12, 3))
    x, y = torch.randn(16, 6), torch.randn(16, 3)

    def make_opt(m):
        return Muon(muon_param_groups(m, weight_decay=0.01, adamw_weight_decay=0.01,
                                      head_names=()), lr=0.02)

    def steps(m, opt, n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            ((m(x) - y) ** 2).mean().backward()
            opt.step()

    opt = make_opt(model)
    steps(model, opt, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    steps(model, opt, 4)

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(saved["model"])
    opt2 = make_opt(resumed)
    opt2.load_state_dict(saved["opt"])
    steps(resumed, opt2, 4)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_zero_grad_set_to_none_then_step_is_a_no_op():
    model = nn.Linear(4, 4)
    opt = Muon(muon_param_groups(model))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_closure_and_empty_params():
    p = nn.Parameter(torch.randn(3, 3))
    empty = nn.Parameter(torch.randn(0, 3))
    opt = Muon([p, empty])

    def closure():
        opt.zero_grad()
        loss = (p**2).sum() + empty.sum()
        loss.backward()
        return loss

    assert opt.step(closure) > 0
    assert empty.shape == (0, 3)


def test_bfloat16_params_on_cpu():
    p = nn.Parameter(torch.randn(8, 6).bfloat16())
    p.grad = torch.randn(8, 6).bfloat16()
    before = p.detach().clone()
    Muon([p]).step()
    assert p.dtype == torch.bfloat16 and torch.isfinite(p).all() and not torch.equal(p, before)


# ---- bad input ----


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(lr=-1.0), "lr"), (dict(momentum=-0.1), "momentum"), (dict(momentum=1.0), "momentum"),
     (dict(weight_decay=-0.01), "weight_decay"), (dict(ns_coefficients="fast"), "ns_coefficients"),
     (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"), (dict(ns_steps=0), "ns_steps"),
     (dict(ns_steps=2.5), "ns_steps"), (dict(adjust_lr_fn="sqrt"), "adjust_lr_fn"),
     (dict(eps=0.0), "eps"), (dict(ns_dtype=torch.int32), "ns_dtype"),
     (dict(nd_mode="split"), "nd_mode"), (dict(adamw_betas=(0.9, 1.5)), "adamw_betas"),
     (dict(lr=torch.tensor([0.1, 0.2])), "lr")],
)
def test_bad_hyperparameters_raise_naming_the_argument(kwargs, name):
    p = nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match=name):
        Muon([p], **kwargs)
    with pytest.raises(ValueError, match=name):  # the same checks guard a group's overrides
        Muon([dict(params=[p], **kwargs)])


def test_one_dim_param_in_muon_group_suggests_use_muon_false():
    with pytest.raises(ValueError, match="use_muon=False"):
        Muon([nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))])
    Muon([dict(params=[nn.Parameter(torch.randn(3))], use_muon=False)])  # fine on the AdamW side


def test_sparse_grad_raises():
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Muon([p]).step()


# ---- acceptance: a codebook layer trained with Muon ----


def _devices():
    devs = ["cpu"]
    # RLX_SKIP_MPS=1: CI machines (GitHub's hosted Macs) that report an MPS device that
    # cannot run kernels.
    if torch.backends.mps.is_available() and os.environ.get("RLX_SKIP_MPS") != "1":
        devs.append("mps")
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


def test_device_list_honours_rlx_skip_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setenv("RLX_SKIP_MPS", "1")
    assert "mps" not in _devices()
    monkeypatch.setenv("RLX_SKIP_MPS", "0")
    assert "mps" in _devices()


def _train_codebook_layer(codebook_matmul, device, ns_dtype=None):
    B, K, N, D, E = 8, 8, 6, 2, 4
    x = torch.sin(0.17 * torch.arange(B * K, dtype=torch.float32)).reshape(B, K).to(device)
    j = torch.arange(N)[:, None]
    kb = torch.arange(K // D)[None, :]
    indices = ((3 * (j * (K // D) + kb) + 1) % E).to(torch.uint8).to(device)
    true_codebook = (torch.cos(0.5 * torch.arange(E * D, dtype=torch.float32)) * 0.9)
    target = codebook_matmul(x, indices, true_codebook.reshape(E, D).to(device))
    codebook = nn.Parameter(torch.zeros(E, D, device=device))
    opt = Muon([codebook], lr=0.1, ns_dtype=ns_dtype)
    losses = torch.empty(200, device=device)  # stays on the device; read once at the end
    for step in range(200):
        opt.zero_grad(set_to_none=True)
        loss = ((codebook_matmul(x, indices, codebook) - target) ** 2).sum()
        loss.backward()
        opt.step()
        losses[step] = loss.detach()
    losses = losses.cpu()
    assert torch.isfinite(losses).all() and torch.isfinite(codebook.detach().cpu()).all()
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


@pytest.mark.parametrize("ns_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device", _devices())
def test_codebook_layer_trains_with_muon(device, ns_dtype):
    # ns_dtype None is bf16 on CPUs with native bf16 and float32 elsewhere: both are run on
    # every CPU. (A [4, 2] codebook's bf16 Gram-form iteration once blew a step up 10⁵-fold.)
    key = {"cpu": "CPU", "mps": "MPS", "cuda": "CUDA"}[device]
    if not torch._C._dispatch_has_kernel_for_dispatch_key("rlx::codebook_matmul", key):
        pytest.skip(f"rlx::codebook_matmul has no {key} kernel in this build")
    _train_codebook_layer(rlx_torch.codebook_matmul, device, ns_dtype)


@pytest.mark.parametrize("device", [d for d in _devices() if d != "cpu"] or [
    pytest.param("accelerator", marks=pytest.mark.skip(reason="needs CUDA or MPS"))])
def test_codebook_layer_trains_with_muon_on_device_with_reference_op(device):
    # Muon's side of the acceptance test on accelerators, whether or not the rlx op has a kernel
    # there: the same loop, all on the device, through the plain-PyTorch reference op.
    _train_codebook_layer(reference.codebook_matmul, device)


# ---- CUDA: no host-device synchronisation inside step() ----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_makes_no_host_device_sync_on_cuda():
    torch.manual_seed(0)
    model = TinyLM().cuda()
    model.frozen.requires_grad_(False)
    groups = muon_param_groups(model, weight_decay=0.01, adamw_weight_decay=0.01)
    opt_float = Muon(groups, ns_coefficients="polar_express")
    model2 = copy.deepcopy(model)
    groups2 = muon_param_groups(model2, weight_decay=0.01, adamw_weight_decay=0.01)
    for g, lr in zip(groups2, (0.02, 3e-4), strict=True):
        g["lr"] = torch.tensor(lr, device="cuda")  # device-resident lr: stays on the device
    opt_tensor = Muon(groups2)
    for m in (model, model2):
        for p in m.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt_float.step()
            opt_tensor.step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for m in (model, model2):
        assert all(torch.isfinite(p).all() for p in m.parameters())


# ---- the fused CPU elementwise ops (rlx::muon_ns_input, rlx::muon_apply_) ----


def fused_and_op_by_op_runs(monkeypatch, ns_dtype, nesterov, steps=3):
    torch.manual_seed(0)
    shapes = [(24, 40), (40, 24), (2, 24, 40), (24, 40)]
    start = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(steps)]
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(muon_module, "_fused_cpu_step", lambda *args: False)
        params = [nn.Parameter(t.clone()) for t in start]
        opt = Muon(params, lr=0.05, weight_decay=0.1, nesterov=nesterov, ns_dtype=ns_dtype)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append(([p.detach() for p in params],
                        [opt.state[p]["momentum_buffer"] for p in params]))
    return results


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_cpu_step_matches_the_op_by_op_step(monkeypatch, ns_dtype, nesterov):
    (fused, fused_bufs), (plain, plain_bufs) = fused_and_op_by_op_runs(monkeypatch, ns_dtype,
                                                                       nesterov)
    for a, b in zip(fused_bufs, plain_bufs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # same lerp arithmetic
    # Different rounding order of the norm and the update; bf16 NS amplifies it a little.
    tol = 1e-5 if ns_dtype == torch.float32 else 2e-3
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tol)


@pytest.mark.parametrize("ns_dtype", LAYOUT_NS_DTYPES)
def test_non_contiguous_params_and_grads_take_the_op_by_op_path(ns_dtype):
    torch.manual_seed(0)
    base = torch.randn(40, 24)
    p = nn.Parameter(base.t())  # a transposed (non-contiguous) param, contiguous grad
    p.grad = torch.randn(24, 40)
    q = nn.Parameter(torch.randn(24, 40))
    q.grad = torch.randn(40, 24).t()  # a non-contiguous grad
    twins = [nn.Parameter(t.detach().contiguous()) for t in (p, q)]
    for twin, orig in zip(twins, (p, q), strict=True):
        twin.grad = orig.grad.contiguous()
    Muon([p, q], weight_decay=0.1, ns_dtype=ns_dtype).step()
    Muon(twins, weight_decay=0.1, ns_dtype=ns_dtype).step()  # contiguous: the fused path
    for a, b in zip((p, q), twins, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0,
                                   atol=_layout_tolerance(ns_dtype, 1, scale=(40 / 24) ** 0.5))
