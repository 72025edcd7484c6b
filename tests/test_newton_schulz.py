"""rlx_torch.optim.newton_schulz: the batched iteration against a per-matrix float64 oracle,
coefficient schedules and presets, and the Gram form (restarts, accuracy in bf16)."""

import importlib
import math

import pytest
import torch
from torch import nn

from rlx_torch.optim import Muon, newton_schulz, resolve_schedule
from tests.ns_reference import KELLER, reference_ns

# The package re-exports the function `newton_schulz` under its module's name.
ns_module = importlib.import_module("rlx_torch.optim.newton_schulz")

# ---- Newton–Schulz ----


@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (3, 5), (17, 17), (2, 9, 4), (0, 4, 4)])
def test_batched_newton_schulz_matches_per_matrix_reference(shape):
    G = torch.randn(*shape, dtype=torch.float64)
    steps = resolve_schedule("keller", 5)
    out = newton_schulz(G, steps, 1e-7, torch.float64)
    assert out.shape == G.shape and out.dtype == torch.float64
    mats = G.reshape(-1, *shape[-2:])
    for i, m in enumerate(mats):
        torch.testing.assert_close(out.reshape(-1, *shape[-2:])[i], reference_ns(m, [KELLER] * 5))


@pytest.mark.parametrize("preset, low, high", [("keller", 0.6, 1.2), ("polar_express", 0.8, 1.2)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_newton_schulz_orthogonalizes(preset, low, high, dtype):
    G = torch.randn(4, 24, 40)
    sv = torch.linalg.svdvals(newton_schulz(G, resolve_schedule(preset, 5), 1e-7, dtype).double())
    assert low < sv.min() and sv.max() < high, (sv.min(), sv.max())


def test_coefficient_schedules():
    assert resolve_schedule("keller", 3).coefficients == (KELLER,) * 3
    pe = resolve_schedule("polar_express", 7)
    assert len(pe.coefficients) == 7 and pe.safety == 1.02
    assert pe.coefficients[5] == pe.coefficients[6] == pe.coefficients[4]
    assert pe.coefficients[0] == (8.156554524902461, -22.48329292557795, 15.878769915207462)
    custom = resolve_schedule([(3.0, -3.0, 1.0), (2.0, -1.5, 0.5)], 3)
    assert custom.coefficients == ((3.0, -3.0, 1.0), (2.0, -1.5, 0.5), (2.0, -1.5, 0.5))
    assert resolve_schedule((1.5, -0.5, 0.0), 2).coefficients == ((1.5, -0.5, 0.0),) * 2
    assert resolve_schedule("polar_express", 2).coefficients == pe.coefficients[:2]


def test_polar_express_step_matches_reference_with_safety_factor():
    p = nn.Parameter(torch.randn(6, 10, dtype=torch.float64))
    start = p.detach().clone()
    p.grad = torch.randn_like(p)
    Muon([p], lr=0.1, ns_coefficients="polar_express", nesterov=False, momentum=0.0).step()
    expected = reference_ns(p.grad, resolve_schedule("polar_express", 5).coefficients,
                            safety=1.02)
    torch.testing.assert_close(p.detach(), start - 0.1 * expected)


# ---- Gram Newton–Schulz (CPU, aspect ratio >= 2) ----


def test_gram_restart_schedule():
    def restarts(preset, steps):
        return ns_module.gram_restarts(resolve_schedule(preset, steps).coefficients)

    assert restarts("keller", 3) == ()
    assert restarts("keller", 5) == (3,)
    assert restarts("keller", 8) == (3, 5, 7)
    assert restarts("polar_express", 5) == (2, 4)


def test_gram_form_is_chosen_per_shape_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ns_module.uses_gram((256, 1024), cpu) and ns_module.uses_gram((3, 1024, 256), cpu)
    assert not ns_module.uses_gram((256, 256), cpu)
    assert not ns_module.uses_gram((300, 512), cpu)  # aspect < 2: the standard form is cheaper
    assert not ns_module.uses_gram((256, 1024), cuda)  # CUDA keeps the standard iteration
    assert ns_module.uses_gram((8, 8), cpu, "gram")
    assert not ns_module.uses_gram((8, 64), cpu, "standard")
    with pytest.raises(ValueError, match="method"):
        ns_module.uses_gram((8, 64), cpu, "fast")
    for dtype in (torch.bfloat16, torch.float16):  # 16-bit dtypes: the standard iteration
        assert not ns_module.uses_gram((256, 1024), cpu, dtype=dtype)
    assert ns_module.uses_gram((256, 1024), cpu, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(3, 8, 40), (3, 40, 8), (2, 16, 33), (1, 5, 5)])
@pytest.mark.parametrize("preset, steps", [("keller", 5), ("polar_express", 5), ("keller", 8)])
def test_gram_form_equals_standard_iteration_in_float64(shape, preset, steps):
    G = torch.randn(*shape, dtype=torch.float64)
    schedule = resolve_schedule(preset, steps)
    gram = newton_schulz(G, schedule, 1e-7, torch.float64, method="gram")
    standard = newton_schulz(G, schedule, 1e-7, torch.float64, method="standard")
    assert gram.shape == G.shape
    torch.testing.assert_close(gram, standard, rtol=1e-9, atol=1e-9)


def hard_gradients(m, n, count=4):
    """Random and gradient-like inputs: decaying spectra, near low rank, one dominant direction."""
    gen = torch.Generator().manual_seed(0)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(count, m, k, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(count, n, k, generator=gen))[0]
    i = torch.arange(1, k + 1, dtype=torch.float32)
    low = torch.randn(count, m, 4, generator=gen) @ torch.randn(count, 4, n, generator=gen)
    spike = torch.randn(count, m, 1, generator=gen) @ torch.randn(count, 1, n, generator=gen)
    return {
        "gaussian": torch.randn(count, m, n, generator=gen),
        "power law": u @ torch.diag_embed(i**-1.5) @ v.mT,
        "exponential": u @ torch.diag_embed(torch.exp(-i / 10)) @ v.mT,
        "rank 4 + noise": low + 1e-3 * low.std() * torch.randn(count, m, n, generator=gen),
        "rank-1 dominant": 100 * spike + torch.randn(count, m, n, generator=gen),
    }


def decaying_spectra(count=16):
    """Small wide and tall matrices (2 to 16 rows, aspect 2 to 4) with log-spaced singular
    values from 1 down to 0.12 .. 0.01: the inputs on which a 16-bit Gram form blows up."""
    gen = torch.Generator().manual_seed(0)
    for m in (2, 3, 4, 8, 16):
        for aspect in (2, 3, 4):
            u = torch.linalg.qr(torch.randn(count, m, m, generator=gen, dtype=torch.float64))[0]
            v = torch.linalg.qr(torch.randn(count, aspect * m, m, generator=gen,
                                            dtype=torch.float64))[0]
            for smallest in (0.12, 0.08, 0.05, 0.03, 0.01):
                s = torch.exp(torch.linspace(0.0, math.log(smallest), m, dtype=torch.float64))
                G = ((u * s) @ v.mT).float()
                yield G
                yield G.mT


def largest_singular_value(schedule, dtype, iterate):
    worst = 0.0
    for G in decaying_spectra():
        out = iterate(G, schedule, dtype).double()
        if not torch.isfinite(out).all():
            return math.inf
        worst = max(worst, torch.linalg.svdvals(out).max().item())
    return worst


SCHEDULES = [("keller", 5), ("polar_express", 5), ("keller", 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("preset, steps", SCHEDULES)
def test_iteration_stays_bounded_on_decaying_spectra(preset, steps, dtype):
    # What Muon runs (method "auto"): the singular values of the result stay below about 1.2
    # (the top of Keller's oscillation); 1.3 leaves room for bf16 noise.
    worst = largest_singular_value(resolve_schedule(preset, steps), dtype,
                                   lambda G, sch, dt: newton_schulz(G, sch, 1e-7, dt))
    assert worst < 1.3, worst


def test_16_bit_gram_form_blows_up_and_is_refused():
    # Shows the check above can fail: the Gram form run in bf16 (which `uses_gram` never picks
    # and refuses when asked) blows the small singular values of these inputs up.
    def gram_in_bf16(G, sch, dt):
        X = ns_module._normalize(G, sch.safety, 1e-7, dt)
        return ns_module._gram_iterations(X, sch, X.size(-2) > X.size(-1),
                                          ns_module._Products.for_batch(X, dt))

    schedule = resolve_schedule("keller", 5)
    assert largest_singular_value(schedule, torch.bfloat16, gram_in_bf16) > 10.0
    with pytest.raises(ValueError, match="float32 or float64"):
        newton_schulz(torch.randn(4, 8), schedule, 1e-7, torch.bfloat16, method="gram")


@pytest.mark.parametrize("preset, steps", SCHEDULES)
def test_float32_gram_form_matches_the_standard_iteration_on_decaying_spectra(preset, steps):
    schedule = resolve_schedule(preset, steps)
    for G in decaying_spectra():
        gram = newton_schulz(G, schedule, 1e-7, torch.float32, method="gram")
        standard = newton_schulz(G, schedule, 1e-7, torch.float32, method="standard")
        torch.testing.assert_close(gram, standard, rtol=0, atol=1e-3)


def gram_failures(shape, schedule):
    """Inputs where the float32 Gram form is clearly worse than the standard iteration."""
    failures = []
    for name, G in hard_gradients(*shape).items():
        exact = torch.stack(
            [reference_ns(g, schedule.coefficients, safety=schedule.safety) for g in G])
        result = {}
        for method in ("standard", "gram"):
            out = newton_schulz(G, schedule, 1e-7, torch.float32, method=method).double()
            error = ((out - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).max().item()
            result[method] = error if math.isfinite(error) else math.inf
        if not result["gram"] <= 2 * result["standard"] + 1e-3:
            failures.append((name, result))
    return failures


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
@pytest.mark.parametrize("preset, steps", SCHEDULES)
def test_float32_gram_form_is_as_accurate_as_the_standard_iteration(shape, preset, steps):
    assert gram_failures(shape, resolve_schedule(preset, steps)) == []


def test_gram_form_fails_the_accuracy_check_without_restarts(monkeypatch):
    # Shows the check above can fail: without restarts rounding makes R indefinite and the
    # iteration drifts away (float32, Keller's coefficients, 8 steps).
    monkeypatch.setattr(ns_module, "gram_restarts", lambda coefficients: ())
    assert gram_failures((64, 256), resolve_schedule("keller", 8)) != []


# ---- Workspace: the CPU iteration's buffers kept between calls ----


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_workspace_gives_the_same_results_bit_for_bit(dtype):
    # Shapes that grow, shrink and change role (tall, wide, square), through one workspace:
    # each result equals the one computed with new tensors, and stays valid until the
    # workspace's next use.
    workspace = ns_module.Workspace()
    schedule = resolve_schedule("keller", 5)
    g = torch.Generator().manual_seed(0)
    for shape in [(3, 40, 40), (2, 96, 33), (2, 33, 96), (5, 40, 40), (1, 7, 7), (0, 8, 8),
                  (2, 96, 33)]:
        G = torch.randn(*shape, generator=g)
        expected = newton_schulz(G, schedule, 1e-7, dtype)
        got = newton_schulz(G, schedule, 1e-7, dtype, workspace=workspace)
        assert got.shape == expected.shape and got.dtype == dtype
        assert torch.equal(got, expected), shape


def test_workspace_buffers_are_reused_not_reallocated():
    workspace = ns_module.Workspace()
    schedule = resolve_schedule("keller", 5)
    G = torch.randn(4, 64, 48)
    newton_schulz(G, schedule, 1e-7, torch.bfloat16, workspace=workspace)
    ptrs = {role: t.data_ptr() for role, t in workspace._buffers.items()}
    assert {"gram", "iterate0", "iterate1"} <= set(ptrs)
    newton_schulz(G[:3], schedule, 1e-7, torch.bfloat16, workspace=workspace)  # smaller: reused
    assert {role: t.data_ptr() for role, t in workspace._buffers.items()} == ptrs


def test_muon_keeps_its_newton_schulz_buffers_between_steps():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(64, 48)) for _ in range(3)] + [
        nn.Parameter(torch.randn(32, 96))]
    opt = Muon(params, lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    ptrs = {role: t.data_ptr() for role, t in opt._ns_workspace._buffers.items()}
    assert ptrs
    opt.step()
    assert {role: t.data_ptr() for role, t in opt._ns_workspace._buffers.items()} == ptrs
    assert "_ns_workspace" not in opt.state_dict()
