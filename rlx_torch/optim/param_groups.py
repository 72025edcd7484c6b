"""The conventional Muon/AdamW split of a model's parameters."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

__all__ = ["DEFAULT_HEAD_NAMES", "muon_param_groups"]

# Output heads by the names models give them (GPT-2/LLaMA `lm_head`, timm `head`/`fc`-free
# `classifier`, fairseq `output_projection`, ...). Matched against a param's module path.
DEFAULT_HEAD_NAMES = (r"(^|\.)lm_head(\.|$)", r"(^|\.)head(\.|$)", r"(^|\.)output(\.|$)",
                      r"(^|\.)classifier(\.|$)", r"(^|\.)output_projection(\.|$)")
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)
_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def _is_norm(module: nn.Module) -> bool:
    # torch >= 2.4 has nn.RMSNorm; other libraries name theirs *Norm (RMSNorm, LlamaRMSNorm...).
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def muon_param_groups(
    model: nn.Module,
    *,
    lr: float = 0.02,
    weight_decay: float = 0.0,
    adamw_lr: float = 3e-4,
    adamw_weight_decay: float = 0.0,
    muon_names: Iterable[str] = (),
    adamw_names: Iterable[str] = (),
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    **muon_options: object,
) -> list[dict]:
    """Splits `model`'s trainable params into a Muon group and an AdamW group.

    Muon gets the hidden weights with >= 2 dims. AdamW (`use_muon=False`) gets embeddings
    (nn.Embedding/EmbeddingBag weights, and any param tied to one), output heads (module path
    matching `head_names`), norm params, biases and every 0-D/1-D param. Names are full
    parameter names as in `model.named_parameters()`; `muon_names` / `adamw_names` are regular
    expressions (`re.search`) that force a param to one side, `adamw_names` winning. Extra
    keyword arguments (`momentum`, `nd_mode`, ...) go into the Muon group.

    Returns `[muon_group, adamw_group]`, leaving out an empty group.

    Example::

        >>> model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8))
        >>> [(g["use_muon"], len(g["params"])) for g in muon_param_groups(model)]
        [(True, 1), (False, 4)]
    """
    muon_names, adamw_names, head_names = list(muon_names), list(adamw_names), list(head_names)
    to_adamw: set[int] = set()  # ids of params the module structure marks as non-hidden
    for mod_name, module in model.named_modules():
        if isinstance(module, _EMBEDDING_TYPES) or _is_norm(module) or _matches(
            mod_name, head_names
        ):
            to_adamw.update(id(p) for p in module.parameters(recurse=False))

    # remove_duplicate=False: a weight tied to an embedding shows up under both names.
    names: dict[int, list[str]] = {}
    params = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p

    muon, adamw = [], []
    for key, p in params.items():
        if not p.requires_grad:
            continue
        forced_adamw = any(_matches(n, adamw_names) for n in names[key])
        forced_muon = not forced_adamw and any(_matches(n, muon_names) for n in names[key])
        hidden = (
            p.ndim >= 2
            and not forced_adamw
            and key not in to_adamw
            and not any(n.endswith("bias") for n in names[key])
        )
        (muon if (forced_muon or hidden) else adamw).append(p)

    groups = []
    if muon:
        groups.append(dict(params=muon, use_muon=True, lr=lr, weight_decay=weight_decay,
                           **muon_options))
    if adamw:
        groups.append(dict(params=adamw, use_muon=False, lr=adamw_lr,
                           weight_decay=adamw_weight_decay))
    return groups
