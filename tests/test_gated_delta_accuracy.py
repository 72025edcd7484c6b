"""Float32 accuracy of the gated delta rule's gate gradients (dg, and through it a Gated
DeltaNet layer's A_log and dt_bias), against a float64 reference, held at or below that of a
plain-PyTorch float32 implementation differentiated by autograd: the chunked (WY) form that
such layers fall back to when no kernel is available (transformers' Qwen3-Next fallback
computes this form), written out below from the math.

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
    # The gate's own arithmetic and the chain rule to A_log and dt_bias run in float64 for
    # every implementation (a float32 sum over tokens there adds the same rounding to all of
    # them); what differs is the gated delta rule's dg, in the implementation's dtype.
    A_log, dt_bias = A_log.requires_grad_(), dt_bias.requires_grad_()
    g64 = -A_log.exp() * F.softplus(a + dt_bias)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    g = g64.detach().to(dtype).requires_grad_()
    o = fn(q, k, v, g, b.sigmoid().to(dtype))
    (o * go.to(dtype)).sum().backward()
    dA_log, ddt_bias = torch.autograd.grad(g64, (A_log, dt_bias), g.grad.double())
    return {"dg": g.grad, "A_log": dA_log, "dt_bias": ddt_bias, "dg time sum": g.grad.sum(1)}


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def chunked_fallback(q, k, v, g, beta, chunk=64):
    """The gated delta rule in chunked form, plain PyTorch (autograd differentiates it). Per
    chunk, with G the within-chunk cumulative log decay and M[i][j] = exp(G_i - G_j) (j <= i):
    W = (I - A)^-1 with A = -(diag(beta) K K^T) * M strictly lower, U = W diag(beta) V,
    Wk = W diag(beta exp(G)) K; then from the state S before the chunk:
    V' = U - Wk S, O = diag(exp G) Q S + ((Q K^T) * M, incl. diagonal) V',
    S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T V'."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k = _l2norm(q) * K ** -0.5, _l2norm(k)
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // chunk

    def heads_first(t):  # [B, T, H, ...] -> [B, H, n, C, ...]
        return t.transpose(1, 2).reshape(B, H, n, chunk, *t.shape[3:])

    q, k, v, g, beta = (heads_first(t) for t in (q, k, v, g, beta))
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    M = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (-(kb @ k.transpose(-1, -2)) * M).masked_fill(~lower.tril(-1), 0)  # strictly lower
    rows = []
    for i in range(chunk):  # W = I + A W, row by row
        row = F.one_hot(torch.tensor(i), chunk).to(q.dtype).expand(B, H, n, chunk)
        if i:
            row = row + (A[..., i, :i, None] * torch.stack(rows, -2)).sum(-2)
        rows.append(row)
    W = torch.stack(rows, -2)
    U = W @ (v * beta[..., None])
    Wk = W @ (kb * G.exp()[..., None])
    S = q.new_zeros(B, H, K, V)
    outs = []
    for c in range(n):
        v_new = U[:, :, c] - Wk[:, :, c] @ S
        inter = (q[:, :, c] * G[:, :, c, :, None].exp()) @ S
        intra = ((q[:, :, c] @ k[:, :, c].transpose(-1, -2)) * M[:, :, c]) @ v_new
        outs.append(inter + intra)
        last = G[:, :, c, -1]
        S = S * last.exp()[..., None, None] + (
            k[:, :, c] * (last[..., None] - G[:, :, c]).exp()[..., None]).transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, H, n * chunk, V).transpose(1, 2)
    return o[:, :T]


def rlx(q, k, v, g, beta):
    return rlx_torch.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


def recurrence(q, k, v, g, beta):
    return reference.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


def test_chunked_fallback_is_the_recurrence():
    """The baseline below is a faithful implementation (float64, T not a multiple of C)."""
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 2, 37, 2, 5, 3
    q, k, v = (torch.randn(B, T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(chunked_fallback(q, k, v, g, beta, chunk=16),
                               recurrence(q, k, v, g, beta), rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("recurrent", [False, True], ids=["chunked", "token_by_token"])
def test_gate_gradients_in_float32_are_as_accurate_as_a_plain_pytorch_fallback(
        recurrent, monkeypatch):
    if recurrent:  # the token-by-token backward (a gate per channel, or any g > 0, runs it)
        monkeypatch.setenv("RLX_GDN_RECURRENT_BACKWARD", "1")
    size = dict(B=2, T=256, H=2, K=64, V=64, seed=0)
    exact = gate_gradients(torch.float64, recurrence, **size)
    ours = gate_gradients(torch.float32, rlx, **size)
    theirs = gate_gradients(torch.float32, chunked_fallback, **size)
    report = {name: (relative_rms(ours[name], exact[name]),
                     relative_rms(theirs[name], exact[name])) for name in exact}
    for name, (err_ours, err_theirs) in report.items():
        assert err_ours <= err_theirs, f"{name}: rlx {err_ours:.2e} vs fallback " \
                                       f"{err_theirs:.2e} ({report})"


@pytest.mark.slow
def test_chunked_backward_gate_gradients_are_as_accurate_as_the_token_by_token_one(monkeypatch):
    """The chunked (WY) backward's gate gradients against the token-by-token backward's, on the
    same inputs: both are ours, so the comparison does not depend on the machine's matmul.
    Eight heads spread A_log over fla's range (the strongly decaying heads are where a
    recursion for dg over the tokens of a sub-chunk, cancelling terms of the size of go . o,
    was several times less accurate), and three seeds pooled give the figures enough samples
    to be stable (the time sums are 16 numbers a seed: one seed's figure moved by 1.6x between
    two summation orders of equal accuracy)."""
    def pooled(dtype, fn):
        runs = [gate_gradients(dtype, fn, B=2, T=256, H=8, K=64, V=64, seed=seed)
                for seed in range(3)]
        return {name: torch.cat([run[name].detach().double().flatten() for run in runs])
                for name in runs[0]}

    exact = pooled(torch.float64, recurrence)
    chunked = pooled(torch.float32, rlx)
    monkeypatch.setenv("RLX_GDN_RECURRENT_BACKWARD", "1")
    token_by_token = pooled(torch.float32, rlx)
    report = {name: (relative_rms(chunked[name], exact[name]),
                     relative_rms(token_by_token[name], exact[name])) for name in exact}
    for name, (err_chunked, err_token_by_token) in report.items():
        assert err_chunked <= 1.1 * err_token_by_token, \
            f"{name}: chunked {err_chunked:.2e} vs token-by-token " \
            f"{err_token_by_token:.2e} ({report})"
