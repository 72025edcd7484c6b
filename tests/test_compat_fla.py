"""rlx_torch.compat.fla: fla's functional gated-delta-rule API on our kernels."""

import pytest
import torch
import torch.nn.functional as F

from rlx_torch.compat.fla import (
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_rule,
)
from rlx_torch.ops import reference


def inputs(B=1, T=37, H=2, HV=4, K=6, V=5, per_channel=False, dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = F.logsigmoid(torch.randn((B, T, HV, K) if per_channel else (B, T, HV)))
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(B, HV, K, V)
    return q, k, v, g.to(torch.float64) if dtype == torch.float64 else g, beta, h0


def test_chunk_gated_delta_rule_matches_reference():
    q, k, v, g, beta, h0 = inputs(B=1, T=40)
    h0 = h0.repeat(3, 1, 1, 1)
    cu = torch.tensor([0, 10, 25, 40])
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.2, initial_state=h0,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=cu)
    ro, rht = reference.gated_delta_rule(q, k, v, g, beta, scale=0.2, initial_state=h0,
                                         output_final_state=True, cu_seqlens=cu,
                                         use_qk_l2norm=True)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ht, rht, atol=1e-5, rtol=1e-4)
    o2, ht2 = chunk_gated_delta_rule(q, k, v, g, beta)  # fla's defaults
    assert ht2 is None and o2.shape == v.shape


def test_fused_gate_and_beta_sigmoid():
    q, k, v, a, b, h0 = inputs(B=2)
    HV = v.shape[2]
    A_log = torch.rand(HV) * 2
    dt_bias = torch.randn(HV)
    o, ht = chunk_gated_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True,
                                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                   use_qk_l2norm_in_kernel=True)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    ro, rht = reference.gated_delta_rule(q, k, v, g, 2 * b.sigmoid(), initial_state=h0,
                                         output_final_state=True, use_qk_l2norm=True)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ht, rht, atol=1e-5, rtol=1e-4)


def test_state_v_first_transposes_state():
    q, k, v, g, beta, h0 = inputs()
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.transpose(-1, -2),
                                   output_final_state=True, state_v_first=True)
    ro, rht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                     output_final_state=True)
    torch.testing.assert_close(o, ro)
    torch.testing.assert_close(ht, rht.transpose(-1, -2))


def test_fused_recurrent_and_chunk_kda_agree():
    q, k, v, gk, beta, h0 = inputs(B=2, per_channel=True)
    o1, ht1 = fused_recurrent_gated_delta_rule(q, k, v, gk=gk, beta=beta, initial_state=h0,
                                               output_final_state=True)
    o2, ht2 = chunk_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True)
    ro, rht = reference.gated_delta_rule(q, k, v, gk, beta, initial_state=h0,
                                         output_final_state=True)
    for a, b in ((o1, ro), (o2, ro), (ht1, rht), (ht2, rht)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # fla's defaults: no gate means no decay, beta defaults to ones.
    k = F.normalize(k, dim=-1)  # beta = 1 without decay is stable only for |k| <= 1
    o3, _ = fused_recurrent_gated_delta_rule(q, k, v)
    ro3, _ = reference.gated_delta_rule(q, k, v, torch.zeros(v.shape[:3]), torch.ones(v.shape[:3]))
    torch.testing.assert_close(o3, ro3, atol=1e-5, rtol=1e-4)


def test_chunk_kda_fused_gates_and_gradients():
    q, k, v, a, b, h0 = inputs(B=1, T=9, H=1, HV=2, K=3, V=2, per_channel=True,
                               dtype=torch.float64)
    HV, K = 2, 3
    A_log = torch.rand(HV, dtype=torch.float64).requires_grad_()
    dt_bias = torch.randn(HV * K, dtype=torch.float64).requires_grad_()
    h0 = h0.double()
    x = a + dt_bias.detach().view(HV, K)
    for safe in (False, True):
        o, _ = chunk_kda(q, k, v, a, b, initial_state=h0, use_gate_in_kernel=True, A_log=A_log,
                         dt_bias=dt_bias, safe_gate=safe, lower_bound=-5.0 if safe else None)
        A = A_log.detach().exp().view(HV, 1)
        g = -5.0 * torch.sigmoid(A * x) if safe else -A * F.softplus(x)
        ro, _ = reference.gated_delta_rule(q, k, v, g, b, initial_state=h0)
        torch.testing.assert_close(o, ro)

    def fn(A_log, dt_bias):
        return chunk_kda(q, k, v, a, b, initial_state=h0, use_gate_in_kernel=True,
                         A_log=A_log, dt_bias=dt_bias)[0]

    assert torch.autograd.gradcheck(fn, (A_log, dt_bias), eps=1e-6, atol=1e-6)


def test_unsupported_and_bad_arguments_raise():
    q, k, v, g, beta, h0 = inputs(B=2)
    with pytest.raises(ValueError, match="batch size is expected to be 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 37]))
    with pytest.raises(DeprecationWarning, match="head_first"):
        chunk_gated_delta_rule(q, k, v, g, beta, head_first=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        chunk_gated_delta_rule(q, k, v, g, beta, not_an_option=1)
    with pytest.raises(NotImplementedError, match="gv"):
        fused_recurrent_gated_delta_rule(q, k, v, gv=torch.zeros_like(v), beta=beta)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="g must be"):
        chunk_kda(q, k, v, g, beta)
    # Accepted no-ops: fla's tuning knobs.
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, cu_seqlens_cpu=None)
    assert o.shape == v.shape
