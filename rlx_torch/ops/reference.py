"""Plain-PyTorch references for every rlx op: the test oracle, the docs' definition, and a
fallback that runs anywhere autograd does. Written for clarity, not speed."""

import torch

# ---- codebook matmul ----


def codebook_dequantize(indices, codebook):
    """Dense weight W[j, kb*D + t] = sum_m codebook[m, indices[j, kb, m], t], shape [N, K]."""
    if indices.dim() == 2:
        indices, codebook = indices.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, num_codebooks = indices.shape
    idx = indices.long()
    weight = sum(codebook[m][idx[:, :, m]] for m in range(num_codebooks))  # [N, K/D, D]
    return weight.reshape(n, groups * codebook.shape[-1])


def codebook_matmul(x, indices, codebook, scales=None, bias=None):
    """out[..., j] = scales[j] * (x @ W.T)[..., j] + bias[j] with W = codebook_dequantize(...).

    Computed in float32 for half inputs (like the kernels) and returned in x's dtype.
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
