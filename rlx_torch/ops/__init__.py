"""Public op entry points (each module registers its fake kernels and autograd wrappers)."""

from . import muon_update  # noqa: F401  (registers the rlx::muon_* fakes)
from .codebook import codebook_matmul  # noqa: F401  (registers rlx::codebook_* fakes)
from .gated_delta import gated_delta_rule  # noqa: F401  (registers rlx::gated_delta_* fakes)
from .symmetric_matmul import symmetric_matmul  # noqa: F401  (registers its fake)
