"""Drop-in nn.Module layers built on the rlx ops."""

from .cache import RecurrentCache
from .codebook_linear import CodebookLinear
from .conv import ShortConvolution
from .gated_deltanet import GatedDeltaNet
from .norm import RMSNormGated

__all__ = ["CodebookLinear", "GatedDeltaNet", "RMSNormGated", "RecurrentCache", "ShortConvolution"]
