"""Drop-in nn.Module layers built on the rlx ops."""

# ---- layers (Gated DeltaNet and its parts) ----
from .cache import RecurrentCache as RecurrentCache  # noqa: E402
from .codebook_linear import CodebookLinear as CodebookLinear  # noqa: E402  (codebook)
from .conv import ShortConvolution as ShortConvolution  # noqa: E402
from .gated_deltanet import GatedDeltaNet as GatedDeltaNet  # noqa: E402
from .norm import RMSNormGated as RMSNormGated  # noqa: E402
