"""Muon's matrix step for sharded params (FSDP2 `fully_shard`, DTensor `Shard` on a 1-D mesh).

Newton–Schulz needs each matrix whole, but the params, their gradients and their momentum
buffers are shards. Each step:

1. every rank updates its momentum shards and builds its shards of the Newton–Schulz input
   (`u`: the Nesterov look-ahead, or the buffer), elementwise, with the very arithmetic of
   `Muon` (on CPU float32 through the fused `rlx::muon_ns_input` kernel itself);
2. the batches (`Muon`'s: same-shape matrices stacked) get owners, cost-balanced with
   `assign_owners`, and are taken in rounds, a round holding at most one batch per owner;
   one `all_to_all_single` per round carries every rank's shards of the round's batches to
   their owners, which normalize and orthogonalize each batch whole;
3. one `all_to_all_single` per round carries each result's shards back, and every rank
   applies its shards of the updates.

All rounds' gathers are issued asynchronously up front, and each round's scatter as soon as
its result exists, so transfers overlap the Newton–Schulz of other rounds. Split sizes come
from the shapes alone: the step reads no tensor values on the host.

Momentum buffers are DTensors sharded like their params, so `torch.distributed.checkpoint`
saves and reloads the optimizer like any other, at any world size. Because every elementwise
operation is `Muon`'s applied to shards and the owner sees exactly the matrix a single process
would, the result equals one process running `Muon` on the same gradients.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .muon import (
    CPU_MAX_BATCH_ELEMENTS,
    MAX_BATCH_ELEMENTS,
    _apply_update,
    _chunks,
    _host_scalar,
    _native_ops,
    default_ns_dtype,
    lr_scale,
    matrix_view,
)
from .newton_schulz import newton_schulz, resolve_schedule

# ShardedMesh, plan_jobs and sharded_muon_step are DistributedMuon's machinery, not API.
__all__ = ["is_dtensor"]

_ALIGN = 16  # byte alignment of each segment in a packed buffer (viewable as any dtype)


def is_dtensor(t: Tensor) -> bool:
    """Whether `t` is a `torch.distributed.tensor.DTensor` (False where torch lacks DTensor).

    >>> is_dtensor(torch.zeros(2))
    False
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _shard_dim(p, what: str) -> int:
    """The dim a supported DTensor is sharded on; ValueError naming `what` otherwise."""
    from torch.distributed.tensor import Shard

    mesh, placements = p.device_mesh, p.placements
    if mesh.ndim != 1:
        raise ValueError(
            f"{what} is a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)} "
            f"(placements {placements}): only 1-D meshes are supported (FSDP2 fully_shard on "
            "one mesh dim); HSDP and tensor parallel layouts are not"
        )
    placement = placements[0]
    if type(placement) is not Shard:  # Replicate, Partial, _StridedShard (FSDP2 + TP), ...
        raise ValueError(
            f"{what} is a DTensor with placement {placement}: only Shard(dim) is supported "
            "(Replicate params belong in a plain-tensor DistributedMuon, Partial values must "
            "be reduced first)"
        )
    return placement.dim % p.ndim


class ShardedMesh:
    """The 1-D mesh all DTensor params of an optimizer live on, and its process group.

    `check(p, what)` validates a param (ValueError for another mesh or an unsupported
    layout); `coords[r]` is the mesh coordinate (= shard index) of group rank `r`.

    Example (in each process of an initialised group of 2)::

        mesh = init_device_mesh("cpu", (2,))
        p = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])
        ShardedMesh(p, "p").shard_shapes(p.shape, 0)   # [(3, 3), (2, 3)]
    """

    def __init__(self, p: Tensor, what: str, process_group=None) -> None:
        _shard_dim(p, what)
        self.mesh = p.device_mesh
        self.group = self.mesh.get_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        mesh_ranks = [int(r) for r in self.mesh.mesh.flatten().tolist()]  # a CPU tensor
        group_ranks = dist.get_process_group_ranks(self.group)
        self.coords = [mesh_ranks.index(r) for r in group_ranks]
        self._shapes: dict[tuple, list[tuple[int, ...]]] = {}
        if process_group is not None:
            theirs = dist.get_process_group_ranks(process_group)
            if sorted(theirs) != sorted(group_ranks):
                raise ValueError(
                    f"{what}: its device mesh spans global ranks {mesh_ranks}, but "
                    f"process_group has ranks {theirs}: sharded params communicate over their "
                    "mesh's group; pass that group (or none)"
                )

    def check(self, p: Tensor, what: str) -> None:
        _shard_dim(p, what)
        if p.device_mesh != self.mesh:
            raise ValueError(
                f"{what} is on device mesh {p.device_mesh}, other params on {self.mesh}: all "
                "DTensor params of one optimizer must share one mesh"
            )

    def shapes_of(self, p: Tensor, dim: int) -> list[tuple[int, ...]]:
        """`shard_shapes` of a param, checked once against its actual local shard."""
        key = (id(p), tuple(p.shape), dim)
        shapes = self._shapes.get(key)
        if shapes is None:
            shapes = self.shard_shapes(p.shape, dim)
            local = tuple(p._local_tensor.shape)
            if local != shapes[self.rank]:
                raise RuntimeError(
                    f"DistributedMuon: a DTensor param of shape {tuple(p.shape)} with "
                    f"placements {p.placements} has a local shard of shape {local} on group "
                    f"rank {self.rank}, not the {shapes[self.rank]} of torch.chunk's split: "
                    "unsupported layout")
            self._shapes[key] = shapes
        return shapes

    def shard_shapes(self, shape: torch.Size, dim: int) -> list[tuple[int, ...]]:
        """Local shape of each group rank's shard (torch.chunk's split, as DTensor's Shard)."""
        size = shape[dim]
        chunk = -(-size // self.world) if size else 0
        shapes = []
        for coord in self.coords:
            start = min(coord * chunk, size)
            local = list(shape)
            local[dim] = min(size, start + chunk) - start
            shapes.append(tuple(local))
        return shapes


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@dataclass
class _Job:
    """One batch of `Muon`: same-shape matrices orthogonalized together on one owner."""

    params: list[Tensor]
    dims: list[int]  # the shard dim of each param
    shapes: list[list[tuple[int, ...]]]  # [param][group rank] -> shard shape
    u: Tensor  # this rank's shards of the NS input, flattened one after another (param dtype)
    rows: int
    cols: int
    counts: list[int]
    fused: bool
    ns_dtype: torch.dtype
    group: dict
    cost: float
    owner: int = 0

    def numels(self, rank: int) -> list[int]:
        """The element counts of `rank`'s shards of the job's params."""
        return [_numel(shapes[rank]) for shapes in self.shapes]


def _local(t: Tensor) -> Tensor:
    # The local shard itself (what `to_local()` returns under no_grad, without its autograd
    # Function call, which dominated small steps).
    return t._local_tensor


def _shard_inputs(opt, group: dict, params: list[Tensor], fused: bool) -> Tensor:
    """Updates this rank's momentum shards and returns its shards of the NS input, flat and
    one after another."""
    momentum, nesterov = group["momentum"], group["nesterov"]
    grads = [_local(p.grad) for p in params]
    bufs = [_local(opt.state[p]["momentum_buffer"]) for p in params]
    if not fused:
        torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
        return torch.cat([(torch.lerp(g, b, momentum) if nesterov else b).reshape(-1)
                          for g, b in zip(grads, bufs, strict=True)])
    # The fused kernel on the shards, each seen as one 1 x n matrix, with the normaliser
    # pinned at max(0 * norm, 1) = 1: it updates the buffers with its own lerp and returns
    # the look-ahead u * 1.0f, that is u exactly.
    n = grads[0].numel()
    if n > 0 and all(g.numel() == n and g.is_contiguous() and b.is_contiguous()
                     for g, b in zip(grads, bufs, strict=True)):
        return torch.ops.rlx.muon_ns_input(grads, bufs, 1, n, momentum, nesterov, 1.0, 0.0,
                                           torch.float32).view(-1)
    out = []
    for g, b in zip(grads, bufs, strict=True):
        if g.numel() == 0:
            continue
        gc, bc = g.contiguous(), b.contiguous()
        out.append(torch.ops.rlx.muon_ns_input([gc], [bc], 1, gc.numel(), momentum, nesterov,
                                               1.0, 0.0, torch.float32).view(-1))
        if bc is not b:
            b.copy_(bc)
    return torch.cat(out) if out else grads[0].new_empty(0)


def _fused(p: Tensor, lr, ns_dtype: torch.dtype) -> bool:
    """`Muon`'s choice of the fused CPU ops, from metadata only (the same on every rank)."""
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.grad.dtype == torch.float32
            and not isinstance(lr, Tensor) and ns_dtype in (torch.float32, torch.bfloat16)
            and _native_ops())


def plan_jobs(opt, group: dict, params: list[Tensor], layout: ShardedMesh) -> list[_Job]:
    """`Muon._muon_jobs`' batches for the sharded `params` of `group` (in param order), with
    this rank's momentum shards updated and its NS-input shards built.

    Example (what `DistributedMuon.step` does with them)::

        jobs = plan_jobs(opt, group, params_with_grad, opt.mesh)
        sharded_muon_step(jobs, opt.mesh, assign_owners([j.cost for j in jobs], opt.mesh.world))
    """
    batches: dict[tuple, list[Tensor]] = defaultdict(list)
    for p in params:
        state = opt.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)  # a DTensor sharded like p
        _, rows, cols = matrix_view(p.shape, group["nd_mode"])
        batches[(rows, cols, p.dtype, p.device)].append(p)
    lr = _host_scalar(group["lr"])
    jobs = []
    for (rows, cols, dtype, device), same in batches.items():
        limit = CPU_MAX_BATCH_ELEMENTS if device.type == "cpu" else MAX_BATCH_ELEMENTS
        for chunk in _chunks(same, limit):
            ns_dtype = group["ns_dtype"] or default_ns_dtype(device, dtype)
            fused = _fused(chunk[0], lr, ns_dtype)
            dims = [_shard_dim(p, "param") for p in chunk]
            numel = sum(p.numel() for p in chunk)
            jobs.append(_Job(
                params=chunk, dims=dims, shapes=[layout.shapes_of(p, d) for p, d in
                                                 zip(chunk, dims, strict=True)],
                u=_shard_inputs(opt, group, chunk, fused), rows=rows, cols=cols,
                counts=[matrix_view(p.shape, group["nd_mode"])[0] for p in chunk],
                fused=fused, ns_dtype=ns_dtype, group=group, cost=float(numel * min(rows, cols))))
    return jobs


def _rounds(jobs: list[_Job], world: int) -> list[dict[int, _Job]]:
    """Round k holds each owner's k-th batch (owners' batches in job order)."""
    per_owner: list[list[_Job]] = [[] for _ in range(world)]
    for job in jobs:
        per_owner[job.owner].append(job)
    depth = max((len(js) for js in per_owner), default=0)
    return [{o: js[k] for o, js in enumerate(per_owner) if k < len(js)} for k in range(depth)]


class _Exchange:
    """One all_to_all_single: `send[o]` (pieces of one dtype) goes to rank o, and from each
    rank s arrive `recv[s] = (numel, dtype)`, read back with `segment(s)`. Segments are
    packed into byte buffers at 16-byte-aligned offsets, so each can be viewed in its dtype."""

    def __init__(self, layout: ShardedMesh, send: list[list[Tensor]],
                 recv: list[tuple[int, torch.dtype]], device: torch.device) -> None:
        self.recv = recv
        self.handle = None
        self._local: Tensor | None = None
        if layout.world == 1:  # nothing to move: keep the one segment as it is
            self._local = torch.cat([t.reshape(-1) for t in send[0]]) if len(send[0]) != 1 \
                else send[0][0].reshape(-1)
            self.received = 0
            return
        send_sizes = [_aligned(sum(t.numel() for t in pieces) * pieces[0].element_size())
                      if pieces else 0 for pieces in send]
        self.recv_sizes = [_aligned(n * dtype.itemsize) for n, dtype in recv]
        send_buf = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
        self.recv_buf = torch.empty(sum(self.recv_sizes), dtype=torch.uint8, device=device)
        start = 0
        for pieces, size in zip(send, send_sizes, strict=True):
            if pieces:
                n = sum(t.numel() for t in pieces)
                segment = send_buf[start:start + n * pieces[0].element_size()]
                torch.cat([t.reshape(-1) for t in pieces], out=segment.view(pieces[0].dtype))
            start += size
        self.received = sum(s for r, s in enumerate(self.recv_sizes) if r != layout.rank)
        self._send_buf = send_buf  # kept alive until the transfer is done
        self.handle = dist.all_to_all_single(self.recv_buf, send_buf, self.recv_sizes,
                                             send_sizes, group=layout.group, async_op=True)

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            self._send_buf = None

    def segment(self, source: int) -> Tensor:
        numel, dtype = self.recv[source]
        if self._local is not None:
            return self._local
        start = sum(self.recv_sizes[:source])
        return self.recv_buf[start:start + numel * dtype.itemsize].view(dtype)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _orthogonalize(job: _Job, gather: _Exchange, world: int, order: list[int]) -> Tensor:
    """The owner's step: the whole NS input from every rank's shards (`order`: the group
    ranks by shard index), normalized and orthogonalized as `Muon` does it. Returns
    `[sum(counts), rows, cols]` in ns_dtype."""
    group = job.group
    p0 = job.params[0]
    pieces = [gather.segment(s).split(job.numels(s)) for s in range(world)]
    U = torch.empty((sum(job.counts), job.rows, job.cols), dtype=p0.dtype, device=p0.device)
    for k, (whole, p) in enumerate(zip(U.split(job.counts), job.params, strict=True)):
        torch.cat([pieces[s][k].view(job.shapes[k][s]) for s in order],
                  dim=job.dims[k], out=whole.view(p.shape))
    schedule = resolve_schedule(group["ns_coefficients"], group["ns_steps"])
    if job.fused:
        # The fused kernel with g = buf = u (nesterov off): lerp(u, u, w) = u, so it returns
        # exactly the normalized input `Muon` builds from the unsharded gradients.
        X = torch.ops.rlx.muon_ns_input([U], [U], job.rows, job.cols, group["momentum"], False,
                                        group["eps"], schedule.safety, job.ns_dtype)
        return newton_schulz(X, schedule, group["eps"], job.ns_dtype, normalized=True).contiguous()
    return newton_schulz(U, schedule, group["eps"], job.ns_dtype).contiguous()


def _apply(job: _Job, ortho: Tensor, rank: int) -> None:
    """Applies this rank's shards of the update; `ortho` holds them flat, one after another."""
    group = job.group
    lr = _host_scalar(group["lr"])
    scale = lr_scale(group["adjust_lr_fn"], job.rows, job.cols)
    numels = job.numels(rank)
    locals_ = [_local(p) for p in job.params]
    if job.fused and numels[0] > 0 and all(n == numels[0] and t.is_contiguous()
                                           for n, t in zip(numels, locals_, strict=True)):
        torch.ops.rlx.muon_apply_(locals_, ortho.view(len(numels), 1, numels[0]), lr,
                                  group["weight_decay"], scale)
        return
    for local, o in zip(locals_, ortho.split(numels), strict=True):
        if local.numel() == 0:
            continue
        if job.fused:
            target = local.contiguous()
            torch.ops.rlx.muon_apply_([target], o.view(1, 1, -1), lr, group["weight_decay"],
                                      scale)
            if target is not local:
                local.copy_(target)
        else:
            _apply_update([local], o.view(1, -1), [1], lr, group["weight_decay"], scale)


def sharded_muon_step(jobs: list[_Job], layout: ShardedMesh, owners: list[int]) -> int:
    """Gathers, orthogonalizes, scatters and applies `jobs` (see the module docstring).
    `owners[i]` is the group rank that orthogonalizes `jobs[i]`. Returns the bytes this rank
    received from other ranks. Example: see `plan_jobs`."""
    world, me = layout.world, layout.rank
    for job, owner in zip(jobs, owners, strict=True):
        job.owner = owner
    rounds = _rounds(jobs, world)
    order = sorted(range(world), key=lambda r: layout.coords[r])
    device = jobs[0].params[0].device if jobs else None
    gathers = []
    for rnd in rounds:
        mine = rnd.get(me)
        send = [[rnd[o].u] if o in rnd else [] for o in range(world)]
        recv = [(sum(mine.numels(s)), mine.params[0].dtype) if mine else (0, torch.uint8)
                for s in range(world)]
        gathers.append(_Exchange(layout, send, recv, device))
    scatters = []
    for rnd, gather in zip(rounds, gathers, strict=True):
        gather.wait()
        mine = rnd.get(me)
        send: list[list[Tensor]] = [[] for _ in range(world)]
        if mine is not None:
            ortho = _orthogonalize(mine, gather, world, order)
            wholes = [o.view(p.shape) for o, p in zip(ortho.split(mine.counts), mine.params,
                                                       strict=True)]
            for k, whole in enumerate(wholes):
                dim, start = mine.dims[k], 0
                for s in order:  # the shards in index order: each starts where the last ends
                    size = mine.shapes[k][s][dim]
                    send[s].append(whole.narrow(dim, start, size))
                    start += size
        recv = [(sum(rnd[o].numels(me)), rnd[o].ns_dtype) if o in rnd else (0, torch.uint8)
                for o in range(world)]
        scatters.append(_Exchange(layout, send, recv, device))
        gather.recv_buf = None  # the gathered inputs are no longer needed
    received = sum(g.received for g in gathers)
    for rnd, scatter in zip(rounds, scatters, strict=True):
        scatter.wait()
        for owner, job in rnd.items():
            _apply(job, scatter.segment(owner), me)
        received += scatter.received
    return received
