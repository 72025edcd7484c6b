"""rlx_torch: codebook matmul, gated delta rule and Muon for PyTorch (MPS, CPU, CUDA)."""

from ._loader import load_extension

load_extension()

from . import nn, ops, optim  # noqa: E402
from .models import GDNConfig, GDNLanguageModel  # noqa: E402
from .ops.codebook import codebook_matmul  # noqa: E402
from .ops.gated_delta import gated_delta_rule  # noqa: E402

# Public API (each feature adds its names here).
__all__ = ["nn", "ops", "optim"]
__all__ += ["codebook_matmul"]
__all__ += ["gated_delta_rule"]
__all__ += ["GDNConfig", "GDNLanguageModel"]

__version__ = "0.1.0"
