"""``fla.ops.gated_delta_rule.fused_recurrent`` on rlx_torch's kernels."""

from __future__ import annotations

import torch

from ..._common import (
    activate_beta,
    check_heads,
    check_shape,
    f32,
    offsets,
    pop_kwargs,
    run,
    run_per_value,
    softplus_gate,
)

__all__ = ["fused_recurrent_gated_delta_rule", "fused_recurrent_gdn"]


def fused_recurrent_gated_delta_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None = None,
        gk: torch.Tensor | None = None, gv: torch.Tensor | None = None,
        beta: torch.Tensor | None = None, scale: float | None = None,
        initial_state: torch.Tensor | None = None, output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
        A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
        state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
        **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_gated_delta_rule`` (same positional order), with a backward.

    Decays multiply, as in fla's kernel: ``g [B, T, HV]`` per head (with ``use_gate_in_kernel``
    the raw input of ``-exp(A_log) * softplus(g + dt_bias)``), ``gk [B, T, HV, K]`` per key
    channel, ``gv [B, T, HV, V]`` per value channel; none means no decay. beta ``[B, T, HV]`` or
    per value channel ``[B, T, HV, V]``; None is fla's ones ``[B, T, H]``, which needs HV = H.
    Other arguments as in :func:`chunk_gated_delta_rule`.

    Example::

        >>> q = k = torch.nn.functional.normalize(torch.randn(1, 5, 2, 4), dim=-1)
        >>> v = torch.randn(1, 5, 2, 3); gv = -torch.rand(1, 5, 2, 3)
        >>> o, _ = fused_recurrent_gated_delta_rule(q, k, v, gv=gv)
        >>> o.shape
        torch.Size([1, 5, 2, 3])
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = pop_kwargs(fn, kwargs, state_v_first)
    B, T, H, HV, K, V = check_heads(fn, q, k, v)
    cu_seqlens = offsets(fn, cu_seqlens, q, initial_state)
    if scale is None:
        scale = K ** -0.5
    if beta is None:
        if HV != H:
            raise ValueError(f"{fn}: beta=None is fla's ones [B, T, H], which does not cover "
                             f"HV={HV} value heads (H={H}); pass beta [B, T, HV]")
        beta = torch.ones(B, T, HV, dtype=q.dtype, device=q.device)
    per_value_beta = beta.dim() == 4
    check_shape(fn, "beta", beta, (B, T, HV, V) if per_value_beta else (B, T, HV),
                "[B, T, HV, V]" if per_value_beta else "[B, T, HV]")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True`.")
        if g is None:
            raise ValueError(f"{fn}: `g` (raw pre-activation) must be provided when "
                             "`use_gate_in_kernel=True`.")
    if g is not None:
        check_shape(fn, "g", g, (B, T, HV), "[B, T, HV]")
        if use_gate_in_kernel:
            g = softplus_gate(g, A_log, dt_bias, HV, per_key=False)
    if gk is not None:
        check_shape(fn, "gk", gk, (B, T, HV, K), "[B, T, HV, K]")
    if gv is not None:
        check_shape(fn, "gv", gv, (B, T, HV, V), "[B, T, HV, V]")
    beta = activate_beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    key_gate = gk if g is None else (f32(g).unsqueeze(-1) + (0 if gk is None else f32(gk)))
    if gv is not None or per_value_beta:
        return run_per_value(q, k, v, key_gate, gv, beta, scale, initial_state,
                             output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                             state_v_first)
    if key_gate is None:
        key_gate = torch.zeros(B, T, HV, dtype=f32(q).dtype, device=q.device)
    elif gk is None:
        key_gate = f32(g)  # one decay per head: the per-head kernels
    return run(q, k, v, key_gate, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel, state_v_first)


fused_recurrent_gdn = fused_recurrent_gated_delta_rule
