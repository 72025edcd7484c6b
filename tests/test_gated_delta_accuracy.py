"""Float32 accuracy of the gated delta rule's gate gradients (dg, and through it a Gated
DeltaNet layer's A_log and dt_bias), against a float64 reference, held at or below that of a
plain-PyTorch float32 implementation differentiated by autograd (the fallback such layers
run when no kernel is available).

The setup is a Qwen3-Next-like layer's gated delta rule at small size: K = V = 64, B = 2,
q and k L2-normalized in the op, ``g = -exp(A_log) softplus(a + dt_bias)`` with fla's
initialization ranges, ``beta = sigmoid(b)``."""

import math

import pytest
import torch
import torch.nn.functional as F

import rlx_torch
from rlx_torch.ops import reference


def relative_rms(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()


def gate_gradients(dtype, fn, B, T, H, K, V, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    a, b, go = rand(B, T, H), rand(B, T, H), rand(B, T, H, V)
    # fla's ranges: A_log = log U(0, 16), dt_bias = softplus^-1 of a log-uniform dt
    A_log = (16 * torch.rand(H, generator=gen, dtype=torch.float64)).log()
    dt = torch.exp(math.log(1e-3) + (math.log(1e-1) - math.log(1e-3))
                   * torch.rand(H, generator=gen, dtype=torch.float64))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, A_log, dt_bias)]
    q, k, v, A_log, dt_bias = leaves
    g = -A_log.exp() * F.softplus(a.to(dtype) + dt_bias)
    g.retain_grad()
    o = fn(q, k, v, g, b.to(dtype).sigmoid())
    (o * go.to(dtype)).sum().backward()
    return {"dg": g.grad, "A_log": A_log.grad, "dt_bias": dt_bias.grad,
            "dg time sum": g.grad.sum(1)}


def rlx(q, k, v, g, beta):
    return rlx_torch.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


def fallback(q, k, v, g, beta):
    return reference.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


@pytest.mark.slow
@pytest.mark.parametrize("recurrent", [False, True], ids=["chunked", "token_by_token"])
def test_gate_gradients_in_float32_are_as_accurate_as_a_plain_pytorch_fallback(
        recurrent, monkeypatch):
    if recurrent:  # the token-by-token backward (a gate per channel, or any g > 0, runs it)
        monkeypatch.setenv("RLX_GDN_RECURRENT_BACKWARD", "1")
    size = dict(B=2, T=256, H=2, K=64, V=64, seed=0)
    exact = gate_gradients(torch.float64, fallback, **size)
    ours = gate_gradients(torch.float32, rlx, **size)
    theirs = gate_gradients(torch.float32, fallback, **size)
    report = {name: (relative_rms(ours[name], exact[name]),
                     relative_rms(theirs[name], exact[name])) for name in exact}
    for name, (err_ours, err_theirs) in report.items():
        assert err_ours <= err_theirs, f"{name}: rlx {err_ours:.2e} vs fallback " \
                                       f"{err_theirs:.2e} ({report})"
