"""``fla.ops.kda`` on rlx_torch's kernels."""

from .chunk import chunk_kda
from .fused_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda"]
