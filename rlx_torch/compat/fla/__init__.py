"""fla's functional gated-delta-rule and KDA API on rlx_torch's native kernels.

``from rlx_torch.compat.fla import chunk_gated_delta_rule`` (or the mirrored paths
``rlx_torch.compat.fla.ops.gated_delta_rule`` / ``rlx_torch.compat.fla.ops.kda``) in place of
``fla.ops...``: fla's names, positional order, keyword arguments, defaults, layouts
(``[B, T, H, D]``) and return values, checked against fla-core 0.6.0. Every fla argument is
either honoured with fla's meaning or rejected with an error that names it; unknown keyword
arguments raise TypeError. Fused gate/beta options run as differentiable PyTorch ops before the
kernel; every entry point has a backward (fla's fused_recurrent ones are forward-only).

Example::

    >>> import torch
    >>> from rlx_torch.compat.fla import chunk_gated_delta_rule
    >>> q = k = torch.randn(1, 8, 2, 4); v = torch.randn(1, 8, 2, 3)
    >>> o, _ = chunk_gated_delta_rule(q, k, v, torch.zeros(1, 8, 2), torch.rand(1, 8, 2))
"""

from . import ops
from .ops import (
                  chunk_gated_delta_rule,
                  chunk_gdn,
                  chunk_kda,
                  fused_recurrent_gated_delta_rule,
                  fused_recurrent_gdn,
                  fused_recurrent_kda,
)

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "chunk_kda", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gdn", "fused_recurrent_kda", "ops"]
