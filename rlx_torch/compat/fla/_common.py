"""Argument handling shared by the fla entry points: every fla argument is honoured with fla's
meaning or rejected with an error that names it (fla-core 0.6.0 is the reference)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ...ops.gated_delta import L2NORM_EPS, gated_delta_rule, l2norm


def f32(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (float64 stays float64): fla computes gates and beta in float32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pop_kwargs(fn: str, kwargs: dict, state_v_first: bool, accepted=()) -> bool:
    """fla's handling of its ``**kwargs``; returns the effective ``state_v_first``.

    ``transpose_state_layout`` is fla's deprecated alias of ``state_v_first``; ``head_first``
    raises as in fla; anything else fla does not define raises TypeError (fla would ignore it).
    """
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(f"{fn}: cannot pass both `state_v_first` and the deprecated "
                             "`transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if "head_first" in kwargs:
        raise DeprecationWarning(
            "head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{fn}: unexpected keyword arguments {unknown} (not fla arguments)")
    return bool(state_v_first)


def reject_cp(fn: str, cp_context) -> None:
    if cp_context is not None:
        raise NotImplementedError(f"{fn}: context parallelism (cp_context) is not supported")


def check_heads(fn: str, q, k, v) -> tuple[int, int, int, int, int, int]:
    """Shapes of q, k ``[B, T, H, K]`` and v ``[B, T, HV, V]``, as fla checks them (ValueError)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a 4-D tensor [B, T, heads, dim], got {got}")
    if q.shape != k.shape:
        raise ValueError(f"{fn}: q and k must have the same shape [B, T, H, K], got "
                         f"q={list(q.shape)} and k={list(k.shape)}")
    B, T, H, K = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"{fn}: v must be [B, T, HV, V] with B, T = {B}, {T}, got "
                         f"{list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"{fn}: for GVA, num_v_heads (HV={HV}) must be evenly divisible by "
                         f"num_heads (H={H}), but got HV % H = {HV % H}")
    return B, T, H, HV, K, V


def check_shape(fn: str, name: str, t, shape, what: str) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must have shape {what}={list(shape)}, got {got}")


def offsets(fn: str, cu_seqlens, q, initial_state):
    """fla's cu_seqlens checks; int32 offsets (HF, FlashAttention) become int64."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32,
                                                                              torch.int64):
        got = getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__)
        raise ValueError(f"{fn}: cu_seqlens must be an int32 or int64 tensor, got {got}")
    if q.shape[0] != 1:
        raise ValueError(
            f"The batch size is expected to be 1 rather than {q.shape[0]} when using "
            "`cu_seqlens`. Please flatten variable-length inputs before processing.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(
            "The number of initial states is expected to be equal to the number of input "
            f"sequences, i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")
    return cu_seqlens.to(torch.int64)


def activate_beta(fn: str, beta, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool):
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}: `allow_neg_eigval=True` requires "
                         "`use_beta_sigmoid_in_kernel=True`.")
    if use_beta_sigmoid_in_kernel:
        beta = f32(beta).sigmoid()
        if allow_neg_eigval:
            beta = beta * 2
    return beta


def softplus_gate(g, A_log, dt_bias, heads: int, per_key: bool):
    """``-exp(A_log) * softplus(g + dt_bias)``; A_log ``[HV]``, dt_bias ``[HV]`` or ``[HV*K]``."""
    x = f32(g)
    if dt_bias is not None:
        x = x + f32(dt_bias).reshape(heads, -1) if per_key else x + f32(dt_bias)
    A = f32(A_log).exp()
    return -(A.reshape(heads, 1) if per_key else A) * F.softplus(x)


def lower_bound_gate(g, A_log, dt_bias, lower_bound: float, heads: int):
    """KDA's ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (without A_log: of
    ``g + dt_bias``)."""
    x = f32(g)
    if dt_bias is not None:
        x = x + f32(dt_bias).reshape(heads, -1)
    if A_log is not None:
        x = f32(A_log).exp().reshape(heads, 1) * x
    return lower_bound * torch.sigmoid(x)


def state_in(initial_state, state_v_first: bool):
    """``[N, HV, V, K]`` (state_v_first) -> the kernels' ``[N, HV, K, V]``."""
    if state_v_first and initial_state is not None:
        return initial_state.transpose(-1, -2)
    return initial_state


def state_out(final_state, state_v_first: bool):
    if state_v_first and final_state is not None:
        return final_state.transpose(-1, -2).contiguous()
    return final_state


def run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
        state_v_first):
    """The recurrence with per-head ``g [B, T, HV]`` or per-key ``g [B, T, HV, K]``."""
    o, final_state = gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=state_in(initial_state, state_v_first),
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm)
    return o, state_out(final_state, state_v_first)


def run_per_value(q, k, v, gk, gv, beta, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm, state_v_first):
    """The recurrence with a per-value-channel decay ``gv [B, T, HV, V]`` and/or a per-value
    beta ``[B, T, HV, V]`` (fla's fused-recurrent options).

    Every column j of a value head's state evolves on its own, with decay ``exp(gk + gv_j)`` and
    step ``beta_j``; so each (value head, column) becomes a value head of width 1: value head
    ``hv * V + j`` still reads q/k head ``hv // (HV // H)``, and the per-key gate carries gv.
    """
    B, T, HV, V = v.shape
    K = q.shape[-1]
    acc = torch.promote_types(f32(v).dtype, torch.float32)
    gate = torch.zeros(B, T, HV, V, K, dtype=acc, device=v.device)
    if gk is not None:
        gate = gate + f32(gk).unsqueeze(3)
    if gv is not None:
        gate = gate + f32(gv).unsqueeze(-1)
    beta = f32(beta)
    beta = beta.unsqueeze(-1).expand(B, T, HV, V) if beta.dim() == 3 else beta
    h0 = state_in(initial_state, state_v_first)
    if h0 is not None:  # [N, HV, K, V] -> [N, HV * V, K, 1]
        h0 = h0.permute(0, 1, 3, 2).reshape(h0.shape[0], HV * V, K, 1)
    o, final_state = gated_delta_rule(
        q, k, v.reshape(B, T, HV * V, 1), gate.reshape(B, T, HV * V, K),
        beta.reshape(B, T, HV * V), scale=scale, initial_state=h0,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm)
    if final_state is not None:  # [N, HV * V, K, 1] -> [N, HV, K, V]
        final_state = final_state.reshape(-1, HV, V, K).permute(0, 1, 3, 2)
    return o.reshape(B, T, HV, V), state_out(final_state, state_v_first)


def intermediate_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                        state_v_first, chunk_size: int):
    """fla's ``return_intermediate_states``: the state before every chunk of ``chunk_size``
    tokens of every sequence, ``[B, NT, HV, K, V]`` in k's dtype (``[1, NT_total, ...]`` with
    cu_seqlens), read from the forward op's checkpoints taken every ``chunk_size`` tokens."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T = q.shape[:2]
    eps = None
    if use_qk_l2norm and q.device.type == "cpu":
        eps = L2NORM_EPS
    elif use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    h0 = state_in(initial_state, state_v_first)
    _, _, checkpoints, _ = torch.ops.rlx.gated_delta_fwd(
        q, k, v, g.to(acc), beta.to(acc), float(scale), None if h0 is None else h0.to(acc),
        cu_seqlens, int(chunk_size), eps)
    # Sequence n, first token bos_n, keeps its state before token j*C in slot n + bos_n//C + j.
    bounds = ([(n * T, T) for n in range(B)] if cu_seqlens is None else
              [(int(a), int(b) - int(a)) for a, b in zip(cu_seqlens[:-1].tolist(),
                                                          cu_seqlens[1:].tolist(), strict=True)])
    slots = [n + bos // chunk_size + j for n, (bos, length) in enumerate(bounds)
             for j in range(-(-length // chunk_size))]
    h = checkpoints[torch.tensor(slots, dtype=torch.long, device=checkpoints.device)]
    h = h.reshape(1 if cu_seqlens is not None else B, -1, *h.shape[1:])
    if state_v_first:
        h = h.transpose(-1, -2)
    return h.to(k.dtype).contiguous()
