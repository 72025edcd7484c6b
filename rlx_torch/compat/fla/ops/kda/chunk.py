"""``fla.ops.kda.chunk`` on rlx_torch's kernels."""

from __future__ import annotations

import torch

from ..._common import (
    activate_beta,
    check_heads,
    check_shape,
    intermediate_states,
    lower_bound_gate,
    offsets,
    pop_kwargs,
    reject_cp,
    run,
    softplus_gate,
)

__all__ = ["chunk_kda"]


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, scale: float | None = None,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
              use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
              safe_gate: bool = False, lower_bound: float | None = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False,
              state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
              cu_seqlens_cpu: torch.Tensor | None = None, cp_context: object = None,
              use_graph: bool = False, max_num_seqs: int | None = None, *,
              A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
              chunk_size: int = 64, **kwargs: object) -> tuple[torch.Tensor | None, ...]:
    """fla's ``chunk_kda`` (same positional order and keyword arguments).

    g ``[B, T, HV, K]`` per-key log decay. With ``use_gate_in_kernel`` g is the raw input:
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound`` is set (without
    A_log: ``lower_bound * sigmoid(g + dt_bias)``), else ``-exp(A_log) * softplus(g + dt_bias)``;
    A_log ``[HV]``, dt_bias ``[HV * K]``. ``safe_gate`` (with the gate in kernel: lower_bound in
    [-5, 0) required) selects a numerically safer kernel in fla; the kernels here are exact
    either way. ``return_intermediate_states=True`` (inference mode only, as in fla) also returns
    the state before every chunk, ``[B, NT, HV, K, V]`` in k's dtype. ``disable_recompute``,
    ``use_graph``, ``max_num_seqs`` and ``cu_seqlens_cpu`` are accepted (checked as fla does);
    they do not change the result. Other arguments as in ``chunk_gated_delta_rule``.

    Example::

        >>> q = k = torch.randn(1, 8, 2, 4); v = torch.randn(1, 8, 2, 3)
        >>> g = torch.randn(1, 8, 2, 4); beta = torch.rand(1, 8, 2)
        >>> o, _ = chunk_kda(q, k, v, g, beta, use_gate_in_kernel=True, lower_bound=-5.0)
        >>> o.shape
        torch.Size([1, 8, 2, 3])
    """
    fn = "chunk_kda"
    state_v_first = pop_kwargs(fn, kwargs, state_v_first)
    reject_cp(fn, cp_context)
    cu_seqlens = offsets(fn, cu_seqlens, q, initial_state)
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError(f"{fn}: `A_log` must be provided when `use_gate_in_kernel=True` and "
                         "`lower_bound` is not set.")
    if chunk_size not in (32, 64):
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError(f"{fn}: `lower_bound` must be specified when `safe_gate=True` and "
                             "`use_gate_in_kernel=True`.")
        if not (-5 <= lower_bound < 0):
            raise ValueError(f"{fn}: `lower_bound` must be in the safe range [-5, 0), got "
                             f"{lower_bound}.")
    if use_graph and cu_seqlens is not None and max_num_seqs is not None \
            and cu_seqlens.shape[0] - 1 != max_num_seqs:
        raise ValueError(f"{fn}: with use_graph, cu_seqlens must be padded with zero-length "
                         f"tail sequences to exactly max_num_seqs + 1 = {max_num_seqs + 1} "
                         f"entries, got {cu_seqlens.shape[0]}")
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError(f"{fn}: return_intermediate_states is only allowed in inference "
                             "mode (torch.inference_mode()), as in fla")
        if disable_recompute:
            raise ValueError(f"{fn}: return_intermediate_states must be used with "
                             "disable_recompute=False, as in fla")
    B, T, H, HV, K, V = check_heads(fn, q, k, v)
    if K > 256:
        raise ValueError(f"{fn}: key head dim K must be <= 256, got {K}")
    check_shape(fn, "g", g, (B, T, HV, K), "[B, T, HV, K]")
    check_shape(fn, "beta", beta, (B, T, HV), "[B, T, HV]")
    if use_gate_in_kernel:
        if lower_bound is not None:
            g = lower_bound_gate(g, A_log, dt_bias, lower_bound, HV)
        else:
            g = softplus_gate(g, A_log, dt_bias, HV, per_key=True)
    beta = activate_beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if scale is None:
        scale = K ** -0.5
    o, final_state = run(q, k, v, g, beta, scale, initial_state, output_final_state,
                         cu_seqlens, use_qk_l2norm_in_kernel, state_v_first)
    if not return_intermediate_states:
        return o, final_state
    h = intermediate_states(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                            use_qk_l2norm_in_kernel, state_v_first, chunk_size)
    return o, final_state, h
