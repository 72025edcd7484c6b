"""Muon's bf16 Newton–Schulz iteration in one op, on AMX tiles (csrc/cpu/newton_schulz_amx.cpp).

``rlx::newton_schulz_amx(X, coefficients) -> Tensor``
    X: bf16 ``[N, m, n]`` on CPU, wide (``m <= n``), m and n multiples of 32; coefficients:
    ``(a, b, c)`` per step, flattened. Runs ``A = X Xᵀ; P = a I + b A + c A A; X = P X`` per
    step and returns the new X: every product from bf16 values with float32 sums, rounded to
    bf16 once (P after the whole polynomial is formed in float32). On CPUs with AMX-BF16 (and
    AVX512-BF16) each matrix's whole iteration runs on one core's tiles; elsewhere the same
    products run through ``bmm`` in float32 (same meaning, no speed). ``RLX_NO_AMX=1`` in the
    environment forces that fallback.

``rlx::newton_schulz_amx_is_native() -> bool``: whether the AMX path runs on this CPU.
"""

from collections.abc import Sequence

import torch

__all__ = ["newton_schulz_amx"]


@torch.library.register_fake("rlx::newton_schulz_amx")
def _newton_schulz_amx_fake(X, coefficients):
    torch._check(X.dim() == 3,
                 lambda: f"rlx::newton_schulz_amx: X must be [N, m, n], got {tuple(X.shape)}")
    return torch.empty_like(X, memory_format=torch.contiguous_format)


def newton_schulz_amx(X: torch.Tensor,
                      coefficients: Sequence[Sequence[float]]) -> torch.Tensor:
    """The bf16 Newton–Schulz iteration of the wide matrices X (``[N, m, n]``) with one
    ``(a, b, c)`` per step; see the module docstring.

    Example::

        >>> X = torch.randn(2, 32, 64).bfloat16() / 45
        >>> out = newton_schulz_amx(X, [(3.4445, -4.7750, 2.0315)] * 5)
        >>> S = torch.linalg.svdvals(out.float())
        >>> out.shape, bool((S > 0.5).all() and (S < 1.5).all())
        (torch.Size([2, 32, 64]), True)
    """
    flat = [float(v) for step in coefficients for v in step]
    return torch.ops.rlx.newton_schulz_amx(X, flat)
