"""``fla.ops.kda.fused_recurrent`` on rlx_torch's kernels."""

from __future__ import annotations

import torch

from ..._common import (
    activate_beta,
    check_heads,
    check_shape,
    lower_bound_gate,
    offsets,
    pop_kwargs,
    run,
    run_per_value,
    softplus_gate,
)

__all__ = ["fused_recurrent_kda"]


def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, A_log: torch.Tensor | None = None,
                        dt_bias: torch.Tensor | None = None, scale: float | None = None,
                        initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False,
                        use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                        use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                        lower_bound: float | None = None, state_v_first: bool = False,
                        cu_seqlens: torch.Tensor | None = None,
                        **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``fused_recurrent_kda`` (same positional order), with a backward.

    g ``[B, T, HV, K]``; beta ``[B, T, HV]`` or per value channel ``[B, T, HV, V]``. With
    ``use_gate_in_kernel``: ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when
    ``lower_bound`` is set (``A_log=None``: of ``g + dt_bias``), else
    ``-exp(A_log) * softplus(g + dt_bias)``, which needs A_log (fla's kernel would use A = e
    without it; refused here). Other arguments as in ``chunk_kda``.

    Example::

        >>> q = k = torch.nn.functional.normalize(torch.randn(1, 5, 2, 4), dim=-1)
        >>> v = torch.randn(1, 5, 2, 3); g = -torch.rand(1, 5, 2, 4)
        >>> o, _ = fused_recurrent_kda(q, k, v, g, torch.rand(1, 5, 2))
        >>> o.shape
        torch.Size([1, 5, 2, 3])
    """
    fn = "fused_recurrent_kda"
    state_v_first = pop_kwargs(fn, kwargs, state_v_first)
    B, T, H, HV, K, V = check_heads(fn, q, k, v)
    cu_seqlens = offsets(fn, cu_seqlens, q, initial_state)
    if scale is None:
        scale = K ** -0.5
    check_shape(fn, "g", g, (B, T, HV, K), "[B, T, HV, K]")
    per_value_beta = isinstance(beta, torch.Tensor) and beta.dim() == 4
    check_shape(fn, "beta", beta, (B, T, HV, V) if per_value_beta else (B, T, HV),
                "[B, T, HV, V]" if per_value_beta else "[B, T, HV]")
    if use_gate_in_kernel:
        if lower_bound is not None:
            g = lower_bound_gate(g, A_log, dt_bias, lower_bound, HV)
        elif A_log is None:
            raise ValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` "
                             "and `lower_bound` is not set.")
        else:
            g = softplus_gate(g, A_log, dt_bias, HV, per_key=True)
    beta = activate_beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if per_value_beta:
        return run_per_value(q, k, v, g, None, beta, scale, initial_state, output_final_state,
                             cu_seqlens, use_qk_l2norm_in_kernel, state_v_first)
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel, state_v_first)
