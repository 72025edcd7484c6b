"""rlx_torch.optim.muon_param_groups: the conventional Muon/AdamW split of a model's params."""

import torch
from torch import nn

from rlx_torch.optim import Muon, muon_param_groups

# ---- param groups ----


class TinyLM(nn.Module):
    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(d), mlp=nn.Linear(d, 2 * d),
                               proj=nn.Linear(2 * d, d, bias=False)))
            for _ in range(2)
        )
        self.conv = nn.Conv1d(d, d, 3)
        self.experts = nn.Parameter(torch.randn(4, d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.frozen = nn.Parameter(torch.randn(d, d), requires_grad=False)


def test_muon_param_groups_conventional_split():
    model = TinyLM()
    groups = muon_param_groups(model, lr=0.03, adamw_lr=1e-3, momentum=0.9)
    muon_group, adamw_group = groups
    name_of = {id(p): n for n, p in model.named_parameters()}
    muon_names = sorted(name_of[id(p)] for p in muon_group["params"])
    assert muon_names == sorted(["blocks.0.mlp.weight", "blocks.0.proj.weight",
                                 "blocks.1.mlp.weight", "blocks.1.proj.weight",
                                 "conv.weight", "experts"])
    assert muon_group["use_muon"] and muon_group["lr"] == 0.03 and muon_group["momentum"] == 0.9
    assert not adamw_group["use_muon"] and adamw_group["lr"] == 1e-3
    adamw_names = {name_of[id(p)] for p in adamw_group["params"]}
    assert {"embed.weight", "lm_head.weight", "blocks.0.norm.weight", "blocks.0.mlp.bias",
            "conv.bias"} <= adamw_names and "frozen" not in adamw_names

    Muon(groups).step()  # valid as is


def test_muon_param_groups_overrides_and_tied_weights():
    model = TinyLM()
    model.lm_head.weight = model.embed.weight  # tied: one param, on the AdamW side by default
    default = muon_param_groups(model, head_names=())
    assert id(model.embed.weight) not in {id(p) for p in default[0]["params"]}
    groups = muon_param_groups(model, adamw_names=[r"^conv\."], muon_names=["lm_head"],
                               head_names=())
    muon_ids = {id(p) for p in groups[0]["params"]}
    assert id(model.conv.weight) not in muon_ids
    assert id(model.embed.weight) in muon_ids  # forced by one of its names
    total = sum(len(g["params"]) for g in groups)
    assert total == len({id(p) for p in model.parameters() if p.requires_grad})
