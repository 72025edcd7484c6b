"""Gated RMSNorm: the output normalization of Gated DeltaNet (fla's ``FusedRMSNormGated``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RMSNormGated"]

_GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


class RMSNormGated(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight * act(gate)`` over the last dimension.

    ``act`` is SiLU (default; "swish" is the same) or sigmoid. Half-precision inputs are
    computed in float32; the result has ``x``'s dtype. ``gate=None`` gives a plain RMSNorm.

    Example::

        >>> norm = RMSNormGated(8)
        >>> y = norm(torch.randn(2, 3, 8), torch.randn(2, 3, 8))
        >>> y.shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "silu",
                 elementwise_affine: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if activation not in _GATE_ACTIVATIONS:
            raise ValueError(
                f"RMSNormGated: activation must be one of {sorted(_GATE_ACTIVATIONS)}, "
                f"got {activation!r}"
            )
        self.hidden_size = hidden_size
        self.eps = eps
        self.activation = activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"RMSNormGated: x's last dimension must be {self.hidden_size}, got {tuple(x.shape)}"
            )
        if gate is not None and gate.shape != x.shape:
            raise ValueError(
                f"RMSNormGated: gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}"
            )
        compute = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for gradcheck
        xc = x.to(compute)
        y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(compute)
        if gate is not None:
            y = y * _GATE_ACTIVATIONS[self.activation](gate.to(compute))
        return y.to(x.dtype)
