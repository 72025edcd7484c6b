"""rlx_torch: codebook matmul, gated delta rule and Muon for PyTorch (MPS, CPU, CUDA)."""

from ._loader import load_extension

load_extension()

__version__ = "0.1.0"
