"""Muon across the processes of a torch.distributed group, for replicated params (DDP).

Every rank holds every param and the same (all-reduced) gradients. Each step, every rank
updates all momentum buffers and builds every batch's Newton–Schulz input (elementwise, cheap),
but orthogonalizes only the batches it owns; each result is broadcast from its owner, and
every rank applies every update. Ownership is cost-balanced: batches (same-shape matrices,
as in `Muon`) go, largest Newton–Schulz cost first, to the least-loaded rank. All ranks issue
the broadcasts in one order, asynchronously, so a rank's own Newton–Schulz overlaps the
transfers of the others' results. The AdamW side runs locally on every rank.

Because each batch goes through the same operations as in `Muon` and the owner's result is
copied bit for bit, params and state after any number of steps are bitwise those of a single
process running `Muon` on the same gradients (with the same thread count), whatever the world
size. Optimizer state stays replicated, so any rank's `state_dict()` resumes a run of any
world size, including a single process.

Not supported: params sharded across ranks (FSDP2 `fully_shard`, tensor parallel: DTensor
params), which raise a clear error.
"""

from __future__ import annotations

import heapq

import torch
import torch.distributed as dist
from torch import Tensor

from .muon import Muon

__all__ = ["DistributedMuon"]


def _is_dtensor(p: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without DTensor
        return False
    return isinstance(p, DTensor)


def assign_owners(costs: list[float], world_size: int) -> list[int]:
    """Longest-processing-time-first: each job, largest cost first (ties: lower index),
    goes to the least-loaded rank (ties: lower rank). Deterministic, so every rank agrees.

    >>> assign_owners([4.0, 1.0, 3.0, 2.0], 2)
    [0, 1, 1, 0]
    """
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


class DistributedMuon(Muon):
    """`Muon` with Newton–Schulz split across the ranks of `process_group` (replicated params).

    Takes `Muon`'s arguments, plus keyword-only `process_group` (default: the default group).
    Every rank must build it with the same params and groups, and step with gradients on the
    same params (as DDP gives); the first step checks that and raises otherwise.
    `last_step_bytes` holds the bytes this rank received in the last step's broadcasts.

    Example (in each process of an initialised group)::

        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = DistributedMuon(muon_param_groups(model.module), lr=0.02)
        loss.backward(); opt.step()
    """

    def __init__(self, params, *args, process_group=None, **kwargs) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedMuon needs an initialised torch.distributed process "
                               "group (torch.distributed.init_process_group)")
        self.process_group = process_group or dist.group.WORLD
        self.last_step_bytes = 0
        self._checked = False
        super().__init__(params, *args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if _is_dtensor(p):
                raise ValueError(
                    f"param {i} of group {len(self.param_groups) - 1} is a DTensor (FSDP2 "
                    "fully_shard or tensor parallel): DistributedMuon supports replicated "
                    "params only (DDP); Newton–Schulz needs each matrix whole"
                )
        self._checked = False

    def _check_same_everywhere(self, signature: list) -> None:
        world = dist.get_world_size(self.process_group)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, signature, group=self.process_group)
        for rank, other in enumerate(gathered):
            if other != signature:
                raise RuntimeError(
                    "DistributedMuon: the ranks disagree on the params to orthogonalize "
                    f"(rank {dist.get_rank(self.process_group)} has {len(signature)} batches, "
                    f"rank {rank} {len(other)}, or their shapes differ): every rank must hold "
                    "the same param groups and gradients on the same params"
                )

    @torch.no_grad()
    def step(self, closure=None):
        """One step; see the module docstring. `closure` re-evaluates the model."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs = []
        for group in self.param_groups:
            if group["use_muon"]:
                jobs.extend(self._muon_jobs(group))
            else:
                self._adamw_step(group)
        group_ranks = dist.get_world_size(self.process_group)
        me = dist.get_rank(self.process_group)
        if not self._checked:
            signature = [(tuple(job.X.shape), str(job.ns_dtype)) for job in jobs]
            self._check_same_everywhere(signature)
            self._checked = True
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
        for handle in handles:
            handle.wait()
        for job, ortho in zip(jobs, results, strict=True):
            job.apply(ortho)
        self.last_step_bytes = received
        return loss
