"""rlx_torch.optim.DistributedMuon on sharded params: FSDP2 `fully_shard` on CPU with gloo, world
sizes 1-4 in spawned processes. Equality with one process running Muon on the same gradients
after 10 steps (uneven shards, an empty shard), DCP checkpoints saved at world size 2 and
resumed at 2 and 4, a NaN gradient confined to its matrix, state sharded like the params,
bytes communicated, and clear errors for unsupported layouts."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rlx_torch.optim import Muon, muon_param_groups
from rlx_torch.optim.distributed import DistributedMuon

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # spawned ranks talk over loopback

STEPS, SAVE_AT, VOCAB, D, LAYERS = 10, 5, 23, 10, 3
WORLDS, MAX_WORLD, NAN_PARAM = (1, 2, 3, 4), 4, "blocks.1.fc.weight"
PERMUTED = [3, 1, 0, 2]


class Block(nn.Module):
    """qkv [3d, d], out [d, d], fc [4d, d], proj [d, 4d], gate [3, d]: with d = 10, rows that
    2, 3 and 4 ranks split unevenly, and a gate with fewer rows than 4 ranks (an empty shard)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.out = nn.Linear(D, D, bias=False)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)
        self.gate = nn.Linear(D, 3, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.mT / D**0.5, dim=-1)
        x = x + self.out(att @ v) * torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)
        return x + self.proj(torch.relu(self.fc(x)))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


def sharded_model(mesh):
    from torch.distributed.fsdp import fully_shard

    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_opt(model, cls, **kw):
    return cls(muon_param_groups(model, lr=0.02, weight_decay=0.01, adamw_lr=3e-3), **kw)


def backward(model, step, rank):
    g = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=g)
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def full(model):
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def full_grads(model):
    return {k: v.grad.full_tensor() for k, v in model.named_parameters()}


def set_grads(model, grads):
    from torch.distributed.tensor import distribute_tensor

    for k, p in model.named_parameters():
        p.grad = distribute_tensor(grads[k], p.device_mesh, p.placements)


def momentum(model, opt):
    return {k: opt.state[p]["momentum_buffer"].full_tensor().clone()
            for k, p in model.named_parameters() if "momentum_buffer" in opt.state[p]}


def state_layouts(model, opt):
    """(param placements, placements of each of its state tensors) for every param."""
    return {k: (str(p.placements), {s: str(v.placements) for s, v in opt.state[p].items()
                                    if isinstance(v, torch.Tensor) and v.ndim > 0})
            for k, p in model.named_parameters()}


def train(rank, world, mesh, tmp):
    """10 FSDP2 steps (each rank its own data) against one process running Muon on the very
    gradients FSDP2 produced (all-gathered), then one step with a NaN in one rank's shard."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = sharded_model(mesh)
    opt = make_opt(model, DistributedMuon)
    reference = TinyGPT()
    ref_opt = make_opt(reference, Muon)
    ref_params = dict(reference.named_parameters())
    replay = []
    for step in range(STEPS + 1):
        backward(model, step, rank)
        if step == STEPS:  # the NaN step: rank world-1's shard of one matrix
            before = (copy.deepcopy(reference), copy.deepcopy(ref_opt.state_dict()))
            if rank == world - 1:
                dict(model.named_parameters())[NAN_PARAM].grad.to_local()[0, 0] = float("nan")
        grads = full_grads(model)
        for k, g in grads.items():
            ref_params[k].grad = g
        ref_opt.step()
        opt.step()
        if world == 2 and step >= SAVE_AT and step < STEPS:
            replay.append(grads)
        if world == 2 and step == SAVE_AT - 1:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{tmp}/ckpt",
                     process_group=mesh.get_group())
        if step == STEPS - 1:
            out = dict(params=full(model), momentum=momentum(model, opt),
                       ref=copy.deepcopy({k: v.detach() for k, v in ref_params.items()}),
                       bytes=opt.last_step_bytes, layouts=state_layouts(model, opt))
    out["nan"], out["nan_ref"] = full(model), {k: v.detach() for k, v in ref_params.items()}
    # The same step without the NaN, in one process: the matrices the NaN must not reach.
    clean, state = before
    clean_opt = make_opt(clean, Muon)
    clean_opt.load_state_dict(state)
    for k, p in clean.named_parameters():
        g = grads[k].clone()
        if k == NAN_PARAM:
            g[torch.isnan(g)] = 0.0
        p.grad = g
    clean_opt.step()
    out["clean"] = {k: v.detach() for k, v in clean.named_parameters()}
    if world == 2 and rank == 0:
        torch.save(dict(replay=replay, params=out["params"], momentum=out["momentum"]),
                   f"{tmp}/replay.pt")
    return out


def resume(rank, world, mesh, tmp):
    """Loads the world-2 checkpoint at `world` ranks and steps with the world-2 run's gradients."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = sharded_model(mesh)
    opt = make_opt(model, DistributedMuon)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{tmp}/ckpt", process_group=mesh.get_group())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for grads in torch.load(f"{tmp}/replay.pt")["replay"]:
        set_grads(model, grads)
        opt.step()
    return dict(params=full(model), momentum=momentum(model, opt))


LAYOUTS = [((7, 5), 1), ((3, 6, 5), 0), ((3, 6, 5), 2), ((9, 4), 1), ((9, 4), 0), ((2, 9), 0)]


def local_chunk(t, dim, mesh):
    """This rank's shard of `t` on `mesh` (torch.chunk's split at the mesh coordinate)."""
    n, world, coord = t.shape[dim], mesh.size(), mesh.get_coordinate()[0]
    chunk = -(-n // world)
    start = min(coord * chunk, n)
    return t.narrow(dim, start, min(n, start + chunk) - start)


def other_layouts(mesh, dtype, plain=False, **settings):
    """Plain DTensors sharded on other dims (columns, the expert dim of a 3-D param, the
    matrix dims of one), against one process; float64 takes the op-by-op path. Shards are
    built and compared at the mesh coordinate by hand (in torch 2.13 `distribute_tensor`
    scatters by group rank on a mesh in another order while DTensor places shards by
    coordinate). `plain`: add a replicated plain-tensor param (the default group's path);
    `settings`: more arguments of both optimizers.
    Returns (this rank's shard, the same shard of the reference) pairs."""
    from torch.distributed.tensor import DTensor, Shard

    def shard(t, dim):
        return DTensor.from_local(local_chunk(t, dim, mesh).clone(), mesh, [Shard(dim)],
                                  run_check=False, shape=t.shape, stride=t.stride())

    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randn(shape, generator=gen, dtype=dtype) for shape, _ in LAYOUTS]
    params = [nn.Parameter(shard(f, dim)) for f, (_, dim) in zip(fulls, LAYOUTS, strict=True)]
    refs = [nn.Parameter(f.clone()) for f in fulls]
    extra = [nn.Parameter(torch.randn(6, 9, generator=gen, dtype=dtype))] if plain else []
    extra_refs = [nn.Parameter(e.detach().clone()) for e in extra]
    opt = DistributedMuon(params + extra, lr=0.05, weight_decay=0.1, **settings)
    ref_opt = Muon(refs + extra_refs, lr=0.05, weight_decay=0.1, **settings)
    for _ in range(3):
        for p, r, (_, dim) in zip(params, refs, LAYOUTS, strict=True):
            r.grad = torch.randn(r.shape, generator=gen, dtype=dtype)
            p.grad = shard(r.grad, dim)
        for e, r in zip(extra, extra_refs, strict=True):
            r.grad = torch.randn(r.shape, generator=gen, dtype=dtype)
            e.grad = r.grad.clone()
        opt.step()
        ref_opt.step()
    return [(p.to_local().detach().clone(), local_chunk(r.detach(), dim, mesh).clone())
            for p, r, (_, dim) in zip(params, refs, LAYOUTS, strict=True)] + [
        (e.detach().clone(), r.detach().clone()) for e, r in zip(extra, extra_refs, strict=True)]


def capture(errors, name, exc_type, fn):
    try:
        fn()
    except exc_type as e:
        errors[name] = str(e)


def check_errors(rank, groups):
    """Unsupported layouts, several meshes and a mismatched process group raise clear errors."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    errors = {}
    mesh = DeviceMesh.from_group(groups[MAX_WORLD], "cpu")

    def param(placements, m=mesh, local=(2, 6)):  # global [8, 6]; no communication
        return nn.Parameter(DTensor.from_local(torch.randn(local), m, placements,
                                               run_check=False, shape=(8, 6), stride=(6, 1)))

    mesh2d = init_device_mesh("cpu", (2, 2))
    capture(errors, "2d", ValueError,
            lambda: DistributedMuon([param([Shard(0), Shard(1)], mesh2d, (4, 3))]))
    capture(errors, "replicate", ValueError,
            lambda: DistributedMuon([param([Replicate()], local=(8, 6))]))
    capture(errors, "partial", ValueError,
            lambda: DistributedMuon([param([Partial()], local=(8, 6))]))
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 + TP's layout

    capture(errors, "strided", ValueError,
            lambda: DistributedMuon([param([_StridedShard(0, split_factor=2)])]))
    capture(errors, "group", ValueError,
            lambda: DistributedMuon([param([Shard(0)])], process_group=groups["pair"]))
    if rank < 2:
        small = DeviceMesh.from_group(groups[2], "cpu")
        capture(errors, "meshes", ValueError,
                lambda: DistributedMuon([param([Shard(0)]), param([Shard(0)], small, (4, 6))]))
    p = param([Shard(0)])
    p.grad = DTensor.from_local(torch.randn(8, 6), mesh, [Partial()], run_check=False)
    capture(errors, "partial_grad", RuntimeError, lambda: DistributedMuon([p]).step())
    return errors


def _worker(rank, tmp):
    # One group of MAX_WORLD processes; each world size runs on a subgroup of its first ranks
    # (one spawn for every check: starting processes dominates the time here).
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=MAX_WORLD)
    try:
        groups = {w: dist.new_group(list(range(w))) for w in WORLDS}
        groups["pair"] = dist.new_group([0, 1])
        out = {"train": {}, "resume": {}}
        for world in WORLDS:
            if rank < world:
                mesh = DeviceMesh.from_group(groups[world], "cpu")
                out["train"][world] = train(rank, world, mesh, tmp)
                if world in (3, 4):
                    # World size 3 also without Nesterov (the NS input is the buffer).
                    out["train"][world]["layouts_fp32"] = other_layouts(
                        mesh, torch.float32, nesterov=world != 3)
                    out["train"][world]["layouts_fp64"] = other_layouts(mesh, torch.float64)
            dist.barrier()
        for world in (2, 4):
            if rank < world:
                mesh = DeviceMesh.from_group(groups[world], "cpu")
                out["resume"][world] = resume(rank, world, mesh, tmp)
            dist.barrier()
        # A mesh whose order is not the group's: shard i lives on global rank PERMUTED[i].
        # Also: NS in bfloat16, so results travel back in another dtype than the inputs.
        out["permuted"] = other_layouts(DeviceMesh("cpu", PERMUTED), torch.float32, plain=True,
                                        ns_dtype=torch.bfloat16)
        out["errors"] = check_errors(rank, groups)
        out["replay"] = torch.load(f"{tmp}/replay.pt") if rank == 0 else None
        torch.save(out, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(tmp,), nprocs=MAX_WORLD, join=True)
        return [torch.load(f"{tmp}/rank{r}.pt") for r in range(MAX_WORLD)]


def assert_equal(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.mark.parametrize("world", WORLDS)
def test_bitwise_equal_to_one_process_after_10_steps(runs, world):
    for rank in range(world):
        out = runs[rank]["train"][world]
        assert_equal(out["params"], out["ref"], f"world {world}, rank {rank}")
        # The run moved: the comparison is not between two untouched models.
        assert not torch.equal(out["params"]["blocks.0.qkv.weight"],
                               TinyGPT().blocks[0].qkv.weight.detach())


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
@pytest.mark.parametrize("world", [3, 4])
def test_other_shard_dims_and_3d_params_equal_one_process(runs, world, dtype):
    for rank in range(world):
        for (shape, dim), (got, want) in zip(LAYOUTS, runs[rank]["train"][world][
                f"layouts_{dtype}"], strict=True):
            assert torch.equal(got, want), f"world {world}, {shape} Shard({dim}), {dtype}"


def test_mesh_in_another_rank_order_and_plain_params_equal_one_process(runs):
    for rank in range(MAX_WORLD):
        layouts = [*LAYOUTS, ((6, 9), "plain")]
        for (shape, dim), (got, want) in zip(layouts, runs[rank]["permuted"], strict=True):
            assert torch.equal(got, want), f"rank {rank}, {shape} Shard({dim})"


@pytest.mark.parametrize("world", WORLDS)
def test_state_is_sharded_like_the_params(runs, world):
    for rank in range(world):
        layouts = runs[rank]["train"][world]["layouts"]
        assert layouts["blocks.2.gate.weight"][1].keys() == {"momentum_buffer"}
        assert layouts["embed.weight"][1].keys() == {"exp_avg", "exp_avg_sq"}
        for name, (placements, state) in layouts.items():
            assert placements == "(Shard(dim=0),)", name
            assert state and all(s == placements for s in state.values()), name


@pytest.mark.parametrize("world", WORLDS)
def test_bytes_received(runs, world):
    received = [runs[r]["train"][world]["bytes"] for r in range(world)]
    if world == 1:
        assert received == [0]
        return
    assert all(b > 0 for b in received)
    # Each Muon matrix crosses at most once to its owner (float32) and once back (NS dtype,
    # at most 4 bytes), plus at most 16 bytes of alignment per piece.
    ref = runs[0]["train"][world]["ref"]
    matrices = [v for k, v in ref.items() if v.ndim == 2 and "embed" not in k
                and "lm_head" not in k]
    bound = sum(8 * m.numel() + 2 * 16 * world for m in matrices)
    assert sum(received) <= bound


@pytest.mark.parametrize("world", WORLDS)
def test_nan_gradient_spoils_only_its_matrix(runs, world):
    for rank in range(world):
        out = runs[rank]["train"][world]
        assert torch.isnan(out["nan"][NAN_PARAM]).all()
        for k, v in out["nan"].items():
            torch.testing.assert_close(v, out["nan_ref"][k], rtol=0, atol=0, equal_nan=True)
            if k != NAN_PARAM:
                assert torch.equal(v, out["clean"][k]), k


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_checkpoint_saved_at_2_resumes_bitwise(runs, world):
    expected = runs[0]["replay"]
    assert len(expected["replay"]) == STEPS - SAVE_AT
    for rank in range(world):
        out = runs[rank]["resume"][world]
        assert_equal(out["params"], expected["params"], f"resumed at {world}, rank {rank}")
        assert_equal(out["momentum"], expected["momentum"], f"momentum at {world}, rank {rank}")


@pytest.mark.parametrize(("name", "needle"), [
    ("2d", "2-D device mesh"), ("replicate", "Replicate"), ("partial", "Partial"),
    ("strided", "only Shard(dim) is supported"),
    ("group", "process_group"), ("meshes", "share one mesh"),
    ("partial_grad", "sharded like its param")])
def test_unsupported_layouts_raise_clear_errors(runs, name, needle):
    ranks = range(2) if name == "meshes" else range(MAX_WORLD)
    for rank in ranks:
        assert needle in runs[rank]["errors"].get(name, ""), (rank, runs[rank]["errors"])


def _cuda_worker(rank, world, tmp, queue):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,))
        gen = torch.Generator().manual_seed(0)
        shapes = [(48, 32), (48, 32), (32, 96), (5, 32)]
        params = [nn.Parameter(distribute_tensor(torch.randn(s, generator=gen).cuda(), mesh,
                                                 [Shard(0)])) for s in shapes]
        bias = nn.Parameter(distribute_tensor(torch.zeros(48).cuda(), mesh, [Shard(0)]))
        opt = DistributedMuon([dict(params=params), dict(params=[bias], use_muon=False)],
                              lr=0.02, weight_decay=0.01)
        for p in [*params, bias]:
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen).cuda(), mesh,
                                       [Shard(0)])
        opt.step()  # the first step checks the ranks agree (all_gather_object): a sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in [*params, bias])
        if rank == 0:
            queue.put(finite)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="needs CUDA and NCCL")
def test_sharded_step_makes_no_host_device_sync_on_cuda():
    world = min(2, torch.cuda.device_count())
    queue = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_cuda_worker, args=(world, tmp, queue), nprocs=world, join=True)
    assert queue.get()
