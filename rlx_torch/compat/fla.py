"""fla's functional gated-delta-rule API on rlx_torch's native kernels.

``from rlx_torch.compat.fla import chunk_gated_delta_rule`` in place of
``from fla.ops.gated_delta_rule import chunk_gated_delta_rule``: same argument names, layouts
(``[B, T, H, D]``), defaults and return values ``(o, final_state)``. The fused gate/beta
options are applied with differentiable PyTorch ops before the kernel. Options that change
nothing here (``chunk_size``, ``cu_seqlens_cpu``, ``chunk_indices``) are accepted; options
this package does not implement raise ``NotImplementedError``.
"""

import torch
import torch.nn.functional as F

from ..ops.gated_delta import gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda"]

_IGNORED = {"chunk_size", "cu_seqlens_cpu", "chunk_indices", "transpose_state_layout"}


def _check_kwargs(fn, kwargs, extra=()):
    if kwargs.get("head_first"):
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in [B, T, H, ...] format.")
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError(f"{fn}: context parallelism (cp_context) is not supported")
    unknown = set(kwargs) - _IGNORED - {"head_first", "cp_context"} - set(extra)
    if unknown:
        raise TypeError(f"{fn}: unexpected keyword arguments {sorted(unknown)}")


def _f32(x):
    """At least float32 (float64 stays float64), as fla computes gates in float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, fn):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}: allow_neg_eigval requires use_beta_sigmoid_in_kernel=True")
    if use_beta_sigmoid_in_kernel:
        beta = _f32(beta).sigmoid()
        if allow_neg_eigval:
            beta = beta * 2
    return beta


def _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
         use_qk_l2norm_in_kernel, state_v_first):
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using "
            "`cu_seqlens`. Please flatten variable-length inputs before processing.")
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state = gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm_in_kernel)
    if state_v_first and final_state is not None:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False,
                           A_log=None, dt_bias=None, **kwargs):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule: g ``[B, T, HV]`` log decay (or the
    raw gate with ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)``)."""
    fn = "chunk_gated_delta_rule"
    _check_kwargs(fn, kwargs)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{fn}: use_gate_in_kernel=True requires A_log")
        g = _f32(g) + (_f32(dt_bias) if dt_bias is not None else 0.0)
        g = -_f32(A_log).exp() * F.softplus(g)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, fn)
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, state_v_first)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                     state_v_first=False, cu_seqlens=None, **kwargs):
    """fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule: g ``[B, T, HV]`` or gk
    ``[B, T, HV, K]``; beta defaults to ones. Unlike fla's, this one has a backward."""
    fn = "fused_recurrent_gated_delta_rule"
    _check_kwargs(fn, kwargs)
    if gv is not None:
        raise NotImplementedError(f"{fn}: per-value-channel decay gv is not supported")
    if g is not None and gk is not None:
        raise NotImplementedError(f"{fn}: pass either g or gk, not both")
    gate = g if g is not None else gk
    if gate is None:
        gate = q.new_zeros(v.shape[:3], dtype=torch.float32)
    if use_gate_in_kernel:
        raise NotImplementedError(f"{fn}: use_gate_in_kernel; apply the gate before the call")
    if beta is None:
        beta = q.new_ones(v.shape[:3], dtype=torch.float32)
    elif beta.dim() == 4:
        raise NotImplementedError(f"{fn}: per-value-channel beta [B, T, HV, V] is not supported")
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, fn)
    return _run(q, k, v, gate, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, state_v_first)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
              lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None,
              dt_bias=None, **kwargs):
    """fla.ops.kda.chunk_kda: per-key-channel log decay g ``[B, T, HV, K]``. With
    ``use_gate_in_kernel``: ``g = -exp(A_log) * softplus(g + dt_bias)`` or, with
    ``safe_gate``, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``."""
    fn = "chunk_kda"
    _check_kwargs(fn, kwargs, extra=("disable_recompute", "return_intermediate_states"))
    if kwargs.get("return_intermediate_states"):
        raise NotImplementedError(f"{fn}: return_intermediate_states is not supported")
    if g.dim() != 4:
        raise ValueError(f"{fn}: g must be [B, T, HV, K], got shape {tuple(g.shape)}")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{fn}: use_gate_in_kernel=True requires A_log")
        HV, K = g.shape[2], g.shape[3]
        x = _f32(g) + (_f32(dt_bias).view(HV, K) if dt_bias is not None else 0.0)
        A = _f32(A_log).exp().view(HV, 1)
        if safe_gate:
            if lower_bound is None:
                raise ValueError(f"{fn}: safe_gate=True requires lower_bound")
            g = lower_bound * torch.sigmoid(A * x)
        else:
            g = -A * F.softplus(x)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval, fn)
    return _run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, state_v_first)
