"""rlx_torch: codebook matmul, gated delta rule and Muon for PyTorch.

Native kernels on CPU, Apple Silicon (MPS) and CUDA. Muon is built from torch ops and runs on
every device.

Example::

    >>> o, _ = rlx_torch.gated_delta_rule(*torch.randn(3, 1, 8, 2, 4).unbind(0),
    ...                                   torch.zeros(1, 8, 2), torch.rand(1, 8, 2))
    >>> o.shape
    torch.Size([1, 8, 2, 4])
"""

from ._loader import load_extension

load_extension()  # registers torch.ops.rlx.*; must precede the modules that add fakes/autograd

from . import compat, models, nn, ops, optim  # noqa: E402
from .models import GDNConfig, GDNLanguageModel  # noqa: E402
from .ops.codebook import codebook_matmul  # noqa: E402
from .ops.gated_delta import gated_delta_rule  # noqa: E402

__all__ = [
    "GDNConfig",
    "GDNLanguageModel",
    "codebook_matmul",
    "compat",
    "gated_delta_rule",
    "models",
    "nn",
    "ops",
    "optim",
]

__version__ = "0.1.0"
