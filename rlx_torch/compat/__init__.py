"""Drop-in replacements for other libraries' functional APIs (``rlx_torch.compat.fla``)."""

from . import fla

__all__ = ["fla"]
