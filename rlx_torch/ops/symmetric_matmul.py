"""Symmetric bf16 products for Muon's Newton–Schulz iteration on CPU.

``rlx::symmetric_matmul(a, b, c, alpha, beta, transposed=False, diag=0.0) -> out``
    a, b: bf16 ``[N, m, k]`` (``transposed``: ``[N, k, m]``); c: bf16 ``[N, m, m]`` or None.
    ``out = beta * c + alpha * a @ b^T + diag * I`` (``transposed``: ``a^T @ b``) for products whose
    result is symmetric: only the upper triangle (c read there) is computed, in float32,
    rounded once to bf16 and mirrored, so ``out`` is exactly symmetric. Native on CPUs with
    AVX512-BF16 (about half the work of a full product); elsewhere a full
    ``baddbmm`` whose upper triangle is mirrored (same meaning, no saving).
    ``RLX_NO_AVX512_BF16=1`` in the environment forces that fallback.

``rlx::symmetric_matmul_out(a, b, c, alpha, beta, transposed, diag, out) -> ()``
    The same written into ``out``: a contiguous bf16 ``[N, m, m]`` tensor that shares no memory with
    a, b or c (so that a caller can keep reusing one buffer; Muon's iteration on CPU does).

``rlx::symmetric_matmul_is_native() -> bool``: whether the fast path runs on this CPU.
"""

import torch

__all__ = ["symmetric_matmul"]


@torch.library.register_fake("rlx::symmetric_matmul")
def _symmetric_matmul_fake(a, b, c, alpha, beta, transposed=False, diag=0.0):
    m = a.shape[2] if transposed else a.shape[1]
    return a.new_empty((a.shape[0], m, m))


@torch.library.register_fake("rlx::symmetric_matmul_out")
def _symmetric_matmul_out_fake(a, b, c, alpha, beta, transposed, diag, out):
    return None


def symmetric_matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None,
                     alpha: float = 1.0, beta: float = 1.0, transposed: bool = False,
                     diag: float = 0.0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``beta * c + alpha * a @ b^T + diag * I`` (``a^T @ b`` when transposed) for a
    symmetric result, in a new tensor or into ``out``; see the module docstring.

    Example::

        >>> x = torch.randn(2, 4, 8).bfloat16()
        >>> out = symmetric_matmul(x, x)
        >>> out.shape, bool(torch.equal(out, out.transpose(1, 2)))
        (torch.Size([2, 4, 4]), True)
    """
    if out is not None:
        torch.ops.rlx.symmetric_matmul_out(a, b, c, float(alpha), float(beta), transposed,
                                           float(diag), out)
        return out
    return torch.ops.rlx.symmetric_matmul(a, b, c, float(alpha), float(beta), transposed,
                                          float(diag))
