"""Distributed Muon step time and bytes per step, at world sizes 1-4 (CPU, gloo), side by side.

Contenders, each on every rank of one spawned group, stepping the same GPT-like params
(per layer 4 x [d, d], [4d, d], [d, 4d], [4d, d]) with the same grads.
Replicated params (DDP):
- torch.optim.Muon on every rank (every rank orthogonalizes every matrix);
- rlx DistributedMuon: each rank orthogonalizes the batches it owns, results broadcast.
Sharded params (FSDP2: each rank holds 1/world of every param and gradient):
- torch.optim.Muon after all-gather: every rank all-gathers every gradient (one all-gather per
  param) and runs torch.optim.Muon on all matrices;
- all-gather then redundant NS (Moonlight's scheme): the same with rlx Muon;
- rlx DistributedMuon on DTensor shards (Shard(0) on a 1-D mesh, as fully_shard leaves them):
  one all-to-all per round gathers whole matrices onto owners, one sends the results back.
The step time is the slowest rank's (a barrier closes each step), median of the rounds
(benchmarks/_timing.py, rounds alternating between the contenders); bytes
are those a rank receives per step (mean and max over the ranks). Prints a table, the
scaling and one JSON line.

    python benchmarks/bench_muon_distributed.py --worlds 1,2,3,4 --d 128 --layers 4
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import emit_json, median_ms, side_by_side  # noqa: E402

from rlx_torch.optim import Muon  # noqa: E402
from rlx_torch.optim.cpu_features import cpu_features  # noqa: E402
from rlx_torch.optim.distributed import DistributedMuon  # noqa: E402


def gpt_params(d: int, layers: int) -> list[torch.nn.Parameter]:
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d), (4 * d, d)]
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(layers):
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
            p.grad = torch.randn(shape, generator=gen)
            params.append(p)
    return params


class AllGatherThenMuon:
    """Grads sharded across ranks: all-gather them, then every rank runs all NS (`optimizer`)."""

    def __init__(self, params, world: int, optimizer=Muon, **settings):
        self.params, self.world = params, world
        rank = dist.get_rank()
        self.sizes = [-(-p.numel() // world) for p in params]  # padded equal shards
        self.shards = []
        for p, size in zip(params, self.sizes, strict=True):
            flat = torch.nn.functional.pad(p.grad.flatten(), (0, size * world - p.numel()))
            self.shards.append(flat[rank * size:(rank + 1) * size].clone())
        self.opt = optimizer(params, **settings)
        self.last_step_bytes = 0

    def step(self):
        received = 0
        for p, shard, size in zip(self.params, self.shards, self.sizes, strict=True):
            parts = [torch.empty(size) for _ in range(self.world)]
            dist.all_gather(parts, shard)
            p.grad = torch.cat(parts)[: p.numel()].view(p.shape)
            received += (self.world - 1) * size * shard.element_size()
        self.last_step_bytes = received
        self.opt.step()


def sharded_params(d: int, layers: int, mesh) -> list[torch.nn.Parameter]:
    """`gpt_params` as FSDP2 leaves them: DTensor params and grads, Shard(0) on `mesh`."""
    from torch.distributed.tensor import Shard, distribute_tensor

    params = []
    for p in gpt_params(d, layers):
        shard = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        shard.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        params.append(shard)
    return params


def _worker(rank, world, tmp, d, layers, rounds, steps, threads, queue):
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rv_{world}", rank=rank,
                            world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
    contenders = {
        "replicated: torch.optim.Muon (every rank)": lambda: torch.optim.Muon(
            gpt_params(d, layers), **settings),
        "replicated: rlx DistributedMuon": lambda: DistributedMuon(
            gpt_params(d, layers), **settings),
        "sharded: all-gather + torch.optim.Muon": lambda: AllGatherThenMuon(
            gpt_params(d, layers), world, torch.optim.Muon, **settings),
        "sharded: all-gather + redundant NS": lambda: AllGatherThenMuon(
            gpt_params(d, layers), world, **settings),
        "sharded: rlx DistributedMuon (DTensor)": lambda: DistributedMuon(
            sharded_params(d, layers, mesh), **settings),
    }
    opts = {name: make() for name, make in contenders.items()}
    for opt in opts.values():  # warm-up
        opt.step()
    samples = side_by_side({name: (lambda opt=opt: [opt.step() for _ in range(steps)])
                            for name, opt in opts.items()}, rounds, warmup=0, sync=dist.barrier)
    received = {}
    for name, opt in opts.items():  # bytes each rank received in its last step
        gathered = [None] * world
        dist.all_gather_object(gathered, getattr(opt, "last_step_bytes", 0))
        received[name] = gathered
    if rank == 0:
        queue.put({name: dict(ms=median_ms(s) / steps,
                              bytes=statistics.mean(received[name]),
                              bytes_max=max(received[name]))
                   for name, s in samples.items()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,3,4")
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"torch {torch.__version__}, CPU: {cpu_features().summary()}, "
          f"{os.cpu_count()} cores, {args.threads} thread(s) per rank")
    print(f"d={args.d}, {args.layers} layers ({7 * args.layers} matrices)")
    ctx = mp.get_context("spawn")
    results = {}
    for world in (int(w) for w in args.worlds.split(",")):
        queue = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, tmp, args.d, args.layers, args.rounds, args.steps,
                                    args.threads, queue), nprocs=world, join=True)
        results[world] = queue.get()
        print(f"\nworld size {world}")
        for name, r in results[world].items():
            base = results[min(results)][name]["ms"]
            print(f"  {name:<42} {r['ms']:9.2f} ms/step  {r['bytes'] / 2**20:8.2f} MiB in/rank"
                  f" (max {r['bytes_max'] / 2**20:6.2f})  {base / r['ms']:5.2f}x vs world "
                  f"{min(results)}")
        ours = results[world]["sharded: rlx DistributedMuon (DTensor)"]["ms"]
        for name in ("sharded: all-gather + torch.optim.Muon",
                     "sharded: all-gather + redundant NS"):
            print(f"  {name[9:]} / sharded rlx DistributedMuon: "
                  f"{results[world][name]['ms'] / ours:5.2f}x (> 1: rlx faster)")
    emit_json(dict(bench="muon_distributed", cpu=cpu_features().summary(),
                   torch=torch.__version__, d=args.d, layers=args.layers,
                   threads_per_rank=args.threads,
                   results={str(w): r for w, r in results.items()}))


if __name__ == "__main__":
    main()
