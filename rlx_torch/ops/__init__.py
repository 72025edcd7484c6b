"""Public op entry points (each module registers its fake kernels and autograd wrappers)."""

from . import muon_update  # registers the rlx::muon_* fakes
from .codebook import codebook_matmul  # registers rlx::codebook_* fakes
from .gated_delta import gated_delta_rule, l2norm  # registers rlx::gated_delta_* fakes
from .newton_schulz_amx import newton_schulz_amx  # registers its fake
from .symmetric_matmul import symmetric_matmul  # registers its fake

__all__ = ["codebook_matmul", "gated_delta_rule", "l2norm", "muon_update", "newton_schulz_amx",
           "symmetric_matmul"]
