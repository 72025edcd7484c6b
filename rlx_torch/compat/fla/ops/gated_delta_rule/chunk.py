"""``fla.ops.gated_delta_rule.chunk`` on rlx_torch's kernels."""

from __future__ import annotations

import torch

from ..._common import (
    activate_beta,
    check_heads,
    check_shape,
    offsets,
    pop_kwargs,
    reject_cp,
    run,
    softplus_gate,
)

__all__ = ["chunk_gated_delta_rule", "chunk_gdn"]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: torch.Tensor | None = None,
                           cu_seqlens_cpu: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None, cp_context: object = None, *,
                           use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, chunk_size: int = 64,
                           **kwargs: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (same positional order and keyword arguments).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g ``[B, T, HV]`` log decay (with
    ``use_gate_in_kernel``, the raw input of ``-exp(A_log) * softplus(g + dt_bias)``, A_log and
    dt_bias ``[HV]``); beta ``[B, T, HV]`` (with ``use_beta_sigmoid_in_kernel``, logits; times 2
    with ``allow_neg_eigval``). initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``). cu_seqlens int32/int64 ``[N + 1]`` with B = 1. ``chunk_size`` (16, 32,
    64), ``cu_seqlens_cpu`` and ``chunk_indices`` are checked and accepted; they do not change
    the result. ``transpose_state_layout`` is fla's deprecated name of ``state_v_first``.
    Returns ``(o [B, T, HV, V], final_state or None)``; both differentiable.

    Example::

        >>> q = k = torch.randn(1, 8, 2, 4); v = torch.randn(1, 8, 2, 3)
        >>> g = torch.randn(1, 8, 2).sigmoid().log(); beta = torch.rand(1, 8, 2)
        >>> o, ht = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        >>> o.shape, ht.shape
        (torch.Size([1, 8, 2, 3]), torch.Size([1, 2, 4, 3]))
    """
    fn = "chunk_gated_delta_rule"
    state_v_first = pop_kwargs(fn, kwargs, state_v_first)
    B, T, H, HV, K, V = check_heads(fn, q, k, v)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got "
                         f"{chunk_size}.")
    reject_cp(fn, cp_context)
    cu_seqlens = offsets(fn, cu_seqlens, q, initial_state)
    check_shape(fn, "g", g, (B, T, HV), "[B, T, HV]")
    check_shape(fn, "beta", beta, (B, T, HV), "[B, T, HV]")
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{fn}: `A_log` must be provided when use_gate_in_kernel=True.")
        g = softplus_gate(g, A_log, dt_bias, HV, per_key=False)
    beta = activate_beta(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    if scale is None:
        scale = K ** -0.5
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm_in_kernel, state_v_first)


chunk_gdn = chunk_gated_delta_rule
