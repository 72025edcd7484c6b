"""``fla.ops`` on rlx_torch's kernels: the gated delta rule and KDA."""

from . import gated_delta_rule, kda
from .gated_delta_rule import (
                               chunk_gated_delta_rule,
                               chunk_gdn,
                               fused_recurrent_gated_delta_rule,
                               fused_recurrent_gdn,
)
from .kda import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_gated_delta_rule", "chunk_gdn", "chunk_kda", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gdn", "fused_recurrent_kda", "gated_delta_rule", "kda"]
