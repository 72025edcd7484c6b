"""Plain-PyTorch references for the rlx ops: the tests' oracle and the docs' definition,
written for clarity, not speed. The package's own modules never import it (a kernel checked
against code it shares would be checked against itself)."""

from __future__ import annotations

import torch

__all__ = ["codebook_dequantize", "codebook_matmul", "gated_delta_rule"]

# ---- codebook matmul ----


def codebook_dequantize(indices: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Dense weight W[j, kb*D + t] = sum_m codebook[m, indices[j, kb, m], t], shape [N, K].

    Example::

        >>> codebook_dequantize(torch.tensor([[1, 0]]), torch.eye(2)).tolist()
        [[0.0, 1.0, 1.0, 0.0]]
    """
    if indices.dim() == 2:
        indices, codebook = indices.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, num_codebooks = indices.shape
    idx = indices.long()
    weight = sum(codebook[m][idx[:, :, m]] for m in range(num_codebooks))  # [N, K/D, D]
    return weight.reshape(n, groups * codebook.shape[-1])


def codebook_matmul(x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor,
                    scales: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """out[..., j] = scales[j] * (x @ W.T)[..., j] + bias[j] with W = codebook_dequantize(...).

    Computed in float32 for half inputs (like the kernels) and returned in x's dtype.

    Example::

        >>> codebook_matmul(torch.ones(1, 4), torch.tensor([[1, 0]]), torch.eye(2)).tolist()
        [[2.0]]
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight = codebook_dequantize(indices, codebook.to(compute))
    out = x.to(compute) @ weight.T
    if scales is not None:
        out = out * scales.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    return out.to(x.dtype)

# ---- gated delta rule ----


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's naive recurrence (fla/ops/gated_delta_rule/naive.py, fla/ops/kda/naive.py),
    token by token, with GVA, per-head or per-channel gates and varlen.

    State math in float32 (float64 for float64 inputs); o in v's dtype; final state in the
    state dtype. Shapes as in rlx_torch.gated_delta_rule.

    Example::

        >>> q = k = torch.tensor([[[[1.0, 0.0]]]]); v = torch.tensor([[[[3.0]]]])
        >>> o, S = gated_delta_rule(q, k, v, torch.zeros(1, 1, 1), torch.ones(1, 1, 1), scale=1.0,
        ...                         output_final_state=True)
        >>> o.item(), S.flatten().tolist()
        (3.0, [3.0, 0.0])
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    q, k, v, g, beta = (t.to(acc) for t in (q, k, v, g, beta))
    if use_qk_l2norm:  # fla's l2norm: x / sqrt(sum x^2 + 1e-6)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = K**-0.5 if scale is None else scale
    # GVA: value head hv reads q/k head hv // (HV // H).
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    gate = g if g.dim() == 4 else g.unsqueeze(-1).expand(B, T, HV, K)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(bounds):
        S = q.new_zeros(HV, K, V) if initial_state is None else initial_state[n].to(acc)
        seq_out = []
        # One unbind per sequence rather than an index per token: the backward of `x[b, t]`
        # writes a zero tensor of x's whole size for every token, unbind's stacks once.
        steps = zip(*(x[b, bos:eos].unbind(0) for x in (q, k, v, gate, beta)), strict=True)
        for q_t, k_t, v_t, g_t, beta_t in steps:
            S = S * g_t.exp().unsqueeze(-1)
            u = beta_t.unsqueeze(-1) * (v_t - torch.einsum("hk,hkv->hv", k_t, S))
            S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
            seq_out.append(torch.einsum("hk,hkv->hv", q_t, S))
        outs.append(torch.stack(seq_out) if seq_out else v.new_zeros(0, HV, V))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs) if outs else v.new_zeros(0, T, HV, V)
    else:
        o = torch.cat(outs).unsqueeze(0)
    final_state = torch.stack(finals) if finals else v.new_zeros(0, HV, K, V)
    return o.to(out_dtype), (final_state if output_final_state else None)
