"""rlx_torch.optim.DistributedMuon on CPU with gloo, world sizes 1-4 (spawned processes):
bitwise equality with single-process Muon after 10 steps, a NaN gradient confined to its
matrix, DCP checkpoints saved at world size 2 and resumed at 2 and 4, DDP, and errors."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlx_torch.optim import Muon, muon_param_groups
from rlx_torch.optim.distributed import DistributedMuon, assign_owners
from rlx_torch.optim.muon import default_ns_dtype

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # spawned ranks talk over loopback

STEPS, SAVE_AT, VOCAB, D, LAYERS = 10, 5, 37, 16, 3


class TinyGPT(nn.Module):
    """Embedding and head (AdamW), per layer qkv [3d, d], out [d, d], fc [4d, d],
    proj [d, 4d] (3 of each shape: not divisible by 2 or 4), norms."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList()
        for _ in range(LAYERS):
            self.blocks.append(nn.ModuleDict(dict(
                norm=nn.LayerNorm(D), qkv=nn.Linear(D, 3 * D, bias=False),
                out=nn.Linear(D, D, bias=False), fc=nn.Linear(D, 4 * D),
                proj=nn.Linear(4 * D, D))))
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            q, k, v = b["qkv"](b["norm"](x)).chunk(3, dim=-1)
            att = torch.softmax(q @ k.mT / D**0.5, dim=-1)
            x = x + b["out"](att @ v)
            x = x + b["proj"](torch.relu(b["fc"](x)))
        return self.lm_head(x)


def make_model():
    torch.manual_seed(0)
    return TinyGPT()


def batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def backward(model, step, nan_param=None):
    model.zero_grad(set_to_none=True)
    x, y = batch(step)
    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    if nan_param is not None:
        dict(model.named_parameters())[nan_param].grad[0, 0] = float("nan")


def make_opt(model, cls, **kw):
    return cls(muon_param_groups(model, lr=0.02, weight_decay=0.01, adamw_lr=3e-3), **kw)


def single_process(steps, nan_param=None):
    torch.set_num_threads(1)
    model = make_model()
    opt = make_opt(model, Muon)
    for step in range(steps):
        backward(model, step, nan_param if step == steps - 1 else None)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


WORLDS, MAX_WORLD = (1, 2, 3, 4), 4


def train(rank, world, pg, tmp, resume):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = make_model()
    opt = make_opt(model, DistributedMuon, process_group=pg)
    out, first = {}, 0
    if resume:
        state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=f"{tmp}/ckpt", process_group=pg)
        model.load_state_dict(state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        first = SAVE_AT
    for step in range(first, STEPS):
        backward(model, step)
        opt.step()
        if not resume and world == 2 and step == SAVE_AT - 1:
            dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=f"{tmp}/ckpt", process_group=pg)
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["bytes"] = opt.last_step_bytes
    if resume:
        return out
    # One more step with a NaN in one matrix's gradient.
    backward(model, STEPS, nan_param="blocks.1.fc.weight")
    opt.step()
    out["nan"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if world > 1:  # DDP: each rank its own data, the params stay identical
        ddp_model = nn.parallel.DistributedDataParallel(make_model(), process_group=pg)
        ddp_opt = make_opt(ddp_model.module, DistributedMuon, process_group=pg)
        for step in range(2):
            ddp_opt.zero_grad()
            x, y = batch(step, rank)
            nn.functional.cross_entropy(ddp_model(x).flatten(0, 1), y.flatten()).backward()
            ddp_opt.step()
        out["ddp"] = {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}
    return out


def check_errors(rank, pair):
    """Mismatched params across ranks, and unsupported DTensor layouts, raise clear errors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    errors = {}
    if rank < 2:
        shape = (4, 6) if rank == 0 else (6, 4)
        p = nn.Parameter(torch.randn(shape))
        p.grad = torch.randn(shape)
        try:
            DistributedMuon([p], process_group=pair).step()
        except RuntimeError as e:
            errors["mismatch"] = str(e)
    mesh = init_device_mesh("cpu", (MAX_WORLD,))
    p = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Replicate()]))
    try:
        DistributedMuon([p])
    except ValueError as e:
        errors["dtensor"] = str(e)
    return errors


def _worker(rank, tmp):
    # One group of MAX_WORLD processes; each world size runs on a subgroup of its first ranks
    # (one spawn for every check: starting processes dominates the time here).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=MAX_WORLD)
    try:
        groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
        pair = dist.new_group([0, 1])
        out = {"train": {}, "resume": {}}
        for world in WORLDS:
            if rank < world:
                out["train"][world] = train(rank, world, groups[world], tmp, resume=False)
            dist.barrier()
        for world in (2, 4):
            if rank < world:
                out["resume"][world] = train(rank, world, groups[world], tmp, resume=True)
            dist.barrier()
        out["errors"] = check_errors(rank, pair)
        torch.save(out, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def assert_bitwise(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    try:
        reference = single_process(STEPS)
        with_nan = single_process(STEPS + 1, nan_param="blocks.1.fc.weight")
        without_nan = single_process(STEPS + 1)
    finally:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(tmp,), nprocs=MAX_WORLD, join=True)
        outs = [torch.load(f"{tmp}/rank{r}.pt") for r in range(MAX_WORLD)]
    results = {w: [outs[r]["train"][w] for r in range(w)] for w in WORLDS}
    resumed = {w: [outs[r]["resume"][w] for r in range(w)] for w in (2, 4)}
    return dict(reference=reference, with_nan=with_nan, without_nan=without_nan,
                results=results, resumed=resumed, errors=[o["errors"] for o in outs])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_equal_to_one_process_after_10_steps(runs, world):
    for rank, out in enumerate(runs["results"][world]):
        assert_bitwise(out["params"], runs["reference"], f"world {world}, rank {rank}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_receives_only_the_others_results(runs, world):
    received = [out["bytes"] for out in runs["results"][world]]
    assert all(r > 0 for r in received)
    # One NS-dtype element (float32, or bf16 on CPUs with native bf16) per entry of every
    # other rank's batches: together, (world - 1) times all NS outputs.
    element = default_ns_dtype(torch.device("cpu"), torch.float32).itemsize
    total = sum(p.numel() for k, p in runs["reference"].items()
                if k.endswith("weight") and p.ndim == 2 and "embed" not in k
                and "lm_head" not in k) * element
    if runs["results"][world][0]["params"]["blocks.0.qkv.weight"].dtype == torch.float32:
        assert sum(received) == (world - 1) * total


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_nan_gradient_spoils_only_its_matrix(runs, world):
    for out in runs["results"][world]:
        nan = out["nan"]
        assert torch.isnan(nan["blocks.1.fc.weight"]).all()
        for k, v in nan.items():
            if k != "blocks.1.fc.weight":
                assert torch.equal(v, runs["without_nan"][k]), k
        for k, v in nan.items():  # and all of it as in one process
            torch.testing.assert_close(v, runs["with_nan"][k], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_checkpoint_saved_at_2_resumes_bitwise(runs, world):
    for rank, out in enumerate(runs["resumed"][world]):
        assert_bitwise(out["params"], runs["reference"], f"resumed at {world}, rank {rank}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_ranks_stay_identical(runs, world):
    outs = runs["results"][world]
    for out in outs[1:]:
        assert_bitwise(out["ddp"], outs[0]["ddp"], f"DDP world {world}")


def test_assign_owners_balances_cost():
    owners = assign_owners([8.0, 8.0, 8.0, 1.0, 1.0, 1.0, 1.0], 3)
    loads = [sum(c for c, o in zip([8.0] * 3 + [1.0] * 4, owners, strict=True) if o == r)
             for r in range(3)]
    assert sorted(loads) == [9.0, 9.0, 10.0]
    assert assign_owners([], 4) == []


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedMuon([nn.Parameter(torch.randn(3, 3))])


def test_dtensor_params_and_mismatched_ranks_raise_clear_errors(runs):
    for rank, errors in enumerate(runs["errors"]):
        assert "DTensor" in errors.get("dtensor", ""), errors
        if rank < 2:
            assert "disagree" in errors.get("mismatch", ""), errors
