"""Muon across the processes of a torch.distributed group: replicated params (DDP) and
sharded ones (FSDP2, DTensor).

Replicated params: every rank holds every param and the same (all-reduced) gradients. Each
step, every rank updates all momentum buffers and builds every batch's Newton–Schulz input
(elementwise, cheap), but orthogonalizes only the batches it owns; each result is broadcast
from its owner, and every rank applies every update. Ownership is cost-balanced: batches
(same-shape matrices, as in `Muon`) go, largest Newton–Schulz cost first, to the
least-loaded rank. All ranks issue the broadcasts in one order, asynchronously, so a rank's
own Newton–Schulz overlaps the transfers of the others' results. The AdamW side runs
locally on every rank.

Because each batch goes through the same operations as in `Muon` and the owner's result is
copied bit for bit, params and state after any number of steps are bitwise those of a single
process running `Muon` on the same gradients (with the same thread count), whatever the world
size. Optimizer state stays replicated, so any rank's `state_dict()` resumes a run of any
world size, including a single process.

DTensor params sharded on a 1-D mesh (FSDP2 `fully_shard`) take the sharded path of
`rlx_torch.optim.distributed_sharded` instead: shards gathered onto owners by all-to-all,
state sharded like the params. Other DTensor layouts (2-D meshes, Replicate, Partial, strided
shards) raise a clear error.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from .distributed_sharded import ShardedMesh, is_dtensor, plan_jobs, sharded_muon_step
from .muon import Muon

__all__ = ["DistributedMuon", "assign_owners"]


def assign_owners(costs: list[float], world_size: int) -> list[int]:
    """Longest-processing-time-first: each job, largest cost first (ties: lower index),
    goes to the least-loaded rank (ties: lower rank). Deterministic, so every rank agrees.

    >>> assign_owners([4.0, 1.0, 3.0, 2.0], 2)
    [0, 0, 1, 1]
    """
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


class DistributedMuon(Muon):
    """`Muon` with Newton–Schulz split across ranks: replicated params (DDP) and params
    sharded on a 1-D device mesh (FSDP2 `fully_shard`, DTensor `Shard(dim)`).

    Takes `Muon`'s arguments, plus keyword-only `process_group` (default: the default group
    for plain params; DTensor params use their mesh's group, and a `process_group` given with
    other ranks is an error). Every rank must build it with the same params and groups, and
    step with gradients on the same params (as DDP and FSDP2 give); the first step checks that
    and raises otherwise. `last_step_bytes` holds the bytes this rank received from other
    ranks in the last step.

    Example (in each process of an initialised group)::

        >>> model = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
        >>> opt = DistributedMuon(muon_param_groups(model.module), lr=0.02)  # doctest: +SKIP
        >>> model(x).sum().backward(); opt.step()  # doctest: +SKIP
    """

    def __init__(self, params: ParamsT, *args: Any, process_group: dist.ProcessGroup | None = None,
                 **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedMuon needs an initialised torch.distributed process "
                               "group (torch.distributed.init_process_group)")
        self._requested_group = process_group
        self.process_group = process_group or dist.group.WORLD
        self.mesh: ShardedMesh | None = None
        self.last_step_bytes = 0
        self._checked = False
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if is_dtensor(p):
                what = f"param {i} of group {index}"
                if self.mesh is None:
                    self.mesh = ShardedMesh(p, what, self._requested_group)
                self.mesh.check(p, what)
        self._checked = False

    def _check_same_everywhere(self, signature: list, group) -> None:
        world = dist.get_world_size(group)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, signature, group=group)
        for rank, other in enumerate(gathered):
            if other != signature:
                raise RuntimeError(
                    "DistributedMuon: the ranks disagree on the params to orthogonalize "
                    f"(rank {dist.get_rank(group)} has {len(signature)} batches, "
                    f"rank {rank} {len(other)}, or their shapes differ): every rank must hold "
                    "the same param groups and gradients on the same params"
                )

    def _sharded_params_with_grad(self, group: dict, params: list) -> list:
        out = list(self._params_with_grad(dict(group, params=params)))
        for p in out:
            g = p.grad
            if not is_dtensor(g) or g.device_mesh != p.device_mesh or g.placements != p.placements:
                layout = (f"a DTensor with placements {g.placements}" if is_dtensor(g)
                          else "a plain tensor")
                raise RuntimeError(
                    f"DistributedMuon: the gradient of a DTensor param with placements "
                    f"{p.placements} is {layout}: it must be sharded like its param (as FSDP2 "
                    "gives it, reduced)"
                )
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step; see the module docstring. `closure` re-evaluates the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs, sharded, has_plain_muon = [], [], False
        for group in self.param_groups:
            plain = [p for p in group["params"] if not is_dtensor(p)]
            shards = [p for p in group["params"] if is_dtensor(p)]
            if group["use_muon"]:
                has_plain_muon |= bool(plain)
                jobs.extend(self._muon_jobs(dict(group, params=plain)))
                if shards:
                    sharded.extend(plan_jobs(self, group, self._sharded_params_with_grad(
                        group, shards), self.mesh))
            else:  # AdamW: plain tensors and DTensors (elementwise, on the shards) apart
                if plain:
                    self._adamw_step(dict(group, params=plain))
                if shards:
                    self._adamw_step(dict(group, params=self._sharded_params_with_grad(
                        group, shards)))
        if not self._checked:
            if has_plain_muon:
                # The params' shapes too: X holds a tall batch transposed where it is iterated
                # wide, so [6, 4] on one rank and [4, 6] on another give the same X.
                self._check_same_everywhere(
                    [(tuple(job.X.shape), tuple(job.params[0].shape), str(job.ns_dtype))
                     for job in jobs], self.process_group)
            if self.mesh is not None:
                self._check_same_everywhere(
                    [(sum(j.counts), j.rows, j.cols, str(j.ns_dtype)) for j in sharded],
                    self.mesh.group)
            self._checked = True
        handles, results, received = self._launch_replicated(jobs)
        if sharded:
            owners = assign_owners([job.cost for job in sharded], self.mesh.world)
            received += sharded_muon_step(sharded, self.mesh, owners)
        for handle in handles:
            handle.wait()
        for job, ortho in zip(jobs, results, strict=True):
            job.apply(ortho)
        self.last_step_bytes = received
        return loss

    def _launch_replicated(self, jobs: list) -> tuple[list, list, int]:
        """Orthogonalizes the replicated batches this rank owns and starts the broadcasts
        that share every result; returns (handles, results, bytes to receive)."""
        group_ranks = dist.get_world_size(self.process_group)
        me = dist.get_rank(self.process_group)
        costs = [float(job.X.numel() * min(job.X.shape[-2:])) for job in jobs]
        owners = assign_owners(costs, group_ranks)
        results, handles, received = [], [], 0
        for job, owner in zip(jobs, owners, strict=True):
            if owner == me:
                ortho = job.orthogonalize()
            else:
                ortho = job.ortho_like()
                received += ortho.numel() * ortho.element_size()
            if group_ranks > 1:
                handles.append(dist.broadcast(ortho, group_src=owner, group=self.process_group,
                                              async_op=True))
            results.append(ortho)
        return handles, results, received
