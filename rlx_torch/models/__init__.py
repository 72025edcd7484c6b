"""Small models built from the rlx_torch layers."""

from .gdn_lm import GDNConfig, GDNLanguageModel, LMOutput

__all__ = ["GDNConfig", "GDNLanguageModel", "LMOutput"]
