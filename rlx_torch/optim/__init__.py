"""Optimizers: Muon (with its AdamW side) and the conventional param-group split."""

from .cpu_features import cpu_features
from .distributed import DistributedMuon
from .muon import Muon
from .newton_schulz import KELLER, POLAR_EXPRESS, newton_schulz, resolve_schedule
from .param_groups import muon_param_groups

__all__ = [
    "DistributedMuon",
    "KELLER",
    "POLAR_EXPRESS",
    "Muon",
    "cpu_features",
    "muon_param_groups",
    "newton_schulz",
    "resolve_schedule",
]
