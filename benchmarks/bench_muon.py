"""Step time of rlx_torch.optim.Muon against torch.optim.Muon, side by side in one process.

GPT-like parameter sets: per layer 4 x [d, d] (attention), [4d, d], [d, 4d], [4d, d] (MLP).
Both optimizers get equal settings (lr, momentum, Nesterov, weight decay, Keller coefficients,
5 steps, "original" lr adjustment, bf16 Newton–Schulz as torch.optim.Muon always uses) and
step the same params and grads. Timed with benchmarks/_timing.py: rounds alternate between
the contenders so that load from other processes hits all alike; the median round counts.
Prints the CPU (model, ISA features), a table, the ratios and one JSON line.

Newton–Schulz arithmetic: per matrix (m <= n, the small side first) and step, the Gram
product X·Xᵀ (2·m²·n FLOPs), A·A (2·m³) and B·X (2·m²·n). Both optimizers run exactly these
products in bf16, so the step's FLOP count over the time gives each one's rate; next to it
stands the rate of plain bf16 `torch.bmm` on the same batches (one batched call per shape and
product, the fastest of several rounds), the ceiling of any implementation that keeps the
arithmetic. The two symmetric products could be computed as half (their upper triangle):
the bound that saving gives is printed too, and the measured rate of a block-symmetric
form of them (3 of the 4 half-size blocks, as 2 bmm calls, then the mirror copy).

    python benchmarks/bench_muon.py                      # CPU: 12 layers at d=256
    python benchmarks/bench_muon.py --device cuda        # d=768 x 12 and d=2048 x 24
"""

import argparse
import platform
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import emit_json, median_ms, side_by_side  # noqa: E402

try:
    from rlx_torch.optim import Muon
    from rlx_torch.optim.cpu_features import cpu_features, symmetric_kernel_pays
    from rlx_torch.optim.muon import default_ns_dtype
except ImportError:
    # The optimizer is pure Python: run it without the compiled extension (e.g. on a machine
    # where rlx_torch._C is not built for the local torch).
    root = Path(__file__).resolve().parents[1] / "rlx_torch"
    package = types.ModuleType("rlx_torch")
    package.__path__ = [str(root)]
    sys.modules["rlx_torch"] = package
    from rlx_torch.optim import Muon
    from rlx_torch.optim.cpu_features import cpu_features, symmetric_kernel_pays
    from rlx_torch.optim.muon import default_ns_dtype

CUDA_SETS = [(768, 12), (2048, 24)]
CPU_SETS = [(256, 12)]


def gpt_params(d: int, layers: int, device: str) -> list[torch.nn.Parameter]:
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d), (4 * d, d)]
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for _ in range(layers):
        for shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen) * 0.02)
            p.grad = torch.randn(shape, device=device, generator=gen)
            params.append(p)
    return params


def ns_shapes(params) -> dict[tuple[int, int], int]:
    """(m, n) with m <= n -> how many matrices of the set have it."""
    shapes: dict[tuple[int, int], int] = {}
    for p in params:
        m, n = sorted(p.shape[-2:])
        shapes[(m, n)] = shapes.get((m, n), 0) + 1
    return shapes


def ns_flops(shapes: dict[tuple[int, int], int], steps: int, half_symmetric: bool = False) -> int:
    """FLOPs of `steps` Newton–Schulz steps over the set; half_symmetric: X·Xᵀ and A·A at half
    their cost (only one triangle computed)."""
    sym = 1 if half_symmetric else 2
    return steps * sum(count * (sym * m * m * n + sym * m ** 3 + 2 * m * m * n)
                       for (m, n), count in shapes.items())


def _blocked_symmetric(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·bᵀ for a symmetric result, from 3 of its 4 half-size blocks (2 bmm calls)."""
    m = a.size(-2)
    h = m // 2
    out = torch.empty(a.size(0), m, m, dtype=a.dtype, device=a.device)
    left = torch.bmm(a, b[:, :h].mT)                  # blocks (0, 0) and (1, 0)
    out[:, :, :h] = left
    out[:, h:, h:] = torch.bmm(a[:, h:], b[:, h:].mT)  # block (1, 1)
    out[:, :h, h:] = left[:, h:].mT                   # block (0, 1), mirrored
    return out


def bmm_rates(shapes: dict[tuple[int, int], int], device: str, rounds: int = 7) -> dict:
    """GFLOP/s of one NS step's products as plain bf16 bmm calls on the set's batches (the
    fastest round), of the block-symmetric form of the two symmetric ones, and of one large
    bf16 matrix product (the machine's GEMM peak)."""
    gen = torch.Generator(device=device).manual_seed(1)
    batches = {s: torch.randn(c, *s, device=device, generator=gen).bfloat16()
               for s, c in shapes.items()}
    squares = {s: torch.bmm(x, x.mT) for s, x in batches.items()}

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t)
        return min(times)

    def plain():
        for s, x in batches.items():
            A = torch.bmm(x, x.mT)
            torch.bmm(squares[s], squares[s])
            torch.bmm(A, x)

    def symmetric_plain():
        for s, x in batches.items():
            torch.bmm(x, x.mT)
            torch.bmm(squares[s], squares[s])

    def symmetric_blocked():
        for s, x in batches.items():
            _blocked_symmetric(x, x)
            _blocked_symmetric(squares[s], squares[s])

    flops = ns_flops(shapes, 1)
    sym_flops = sum(c * (2 * m * m * n + 2 * m ** 3) for (m, n), c in shapes.items())
    big = torch.randn(2048, 2048, device=device, generator=gen).bfloat16()
    t_big = best(lambda: torch.mm(big, big))
    t_plain, t_sym, t_blk = best(plain), best(symmetric_plain), best(symmetric_blocked)
    return dict(
        ns_step_gflops=round(flops / t_plain / 1e9, 1),
        symmetric_products_ms=round(t_sym * 1e3, 3),
        symmetric_blocked_ms=round(t_blk * 1e3, 3),
        symmetric_gflops=round(sym_flops / t_sym / 1e9, 1),
        symmetric_blocked_gflops_counted_full=round(sym_flops / t_blk / 1e9, 1),
        mm_2048_gflops=round(2 * 2048 ** 3 / t_big / 1e9, 1),
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(opt, steps: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    sync(device)
    return (time.perf_counter() - start) / steps


def bench_set(d: int, layers: int, device: str, rounds: int, steps: int,
              profile: bool = False) -> dict:
    params = gpt_params(d, layers, device)
    settings = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5,
                    adjust_lr_fn="original")  # the defaults' NS dtype: see default_ns_dtype
    contenders = {
        "torch.optim.Muon": torch.optim.Muon(params, **settings),
        "rlx Muon (bf16 NS)": Muon(params, ns_dtype=torch.bfloat16, **settings),
    }
    if device != "cuda":  # the default NS dtype differs from bf16 only off CUDA
        contenders["rlx Muon (default NS dtype)"] = Muon(params, **settings)
    for opt in contenders.values():  # warm-up: state allocation, kernels, allocator
        time_steps(opt, 2, device)
    samples = side_by_side({name: (lambda opt=opt: [opt.step() for _ in range(steps)])
                            for name, opt in contenders.items()}, rounds, warmup=0,
                           sync=lambda: sync(device))
    if profile:
        for name, opt in contenders.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.step()
            print(f"\n{name}, one step, by self CPU time:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    medians = {name: median_ms(s) / 1e3 / steps for name, s in samples.items()}
    base = medians["torch.optim.Muon"]
    shapes = ns_shapes(params)
    flops = ns_flops(shapes, settings["ns_steps"])
    rates = bmm_rates(shapes, device)
    result = dict(
        d=d, layers=layers, matrices=len(params),
        params_m=round(sum(p.numel() for p in params) / 1e6, 1),
        ms={name: round(t * 1e3, 3) for name, t in medians.items()},
        speedup={name: round(base / t, 2) for name, t in medians.items() if t is not base},
        ns_gflop_per_step=round(flops / 1e9, 3),
        gflops={name: round(flops / t / 1e9, 1) for name, t in medians.items()},
        bmm=rates,
        # the step at the bmm rate with the same arithmetic, and with both symmetric
        # products at half cost, against torch.optim.Muon's measured step
        bound_ms=round(flops / rates["ns_step_gflops"] / 1e6, 3),
        bound_half_symmetric_ms=round(
            ns_flops(shapes, settings["ns_steps"], True) / rates["ns_step_gflops"] / 1e6, 3),
    )
    result["max_speedup_same_arithmetic"] = round(base * 1e3 / result["bound_ms"], 2)
    result["max_speedup_half_symmetric"] = round(
        base * 1e3 / result["bound_half_symmetric_ms"], 2)
    del contenders, params
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"])
    parser.add_argument("--sets", default=None,
                        help="d:layers,... (default: 256:12 on CPU/MPS, 768:12,2048:24 on CUDA)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true",
                        help="also print each optimizer's top ops in one step (torch.profiler)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sets:
        sets = [tuple(int(v) for v in s.split(":")) for s in args.sets.split(",")]
    else:
        sets = CUDA_SETS if args.device == "cuda" else CPU_SETS
    machine = (torch.cuda.get_device_name() if args.device == "cuda"
               else f"{cpu_features().model if args.device == 'cpu' else platform.machine()}, "
                    f"{torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {args.device}: {machine}")
    kernels = {}
    if args.device == "cpu":
        # What decided the kernel choices: the default NS dtype (bf16 only with native bf16
        # arithmetic) and whether bf16 symmetric products use rlx::symmetric_matmul.
        kernels = dict(cpu=cpu_features().summary(),
                       default_ns_dtype=str(default_ns_dtype(torch.device("cpu"),
                                                             torch.float32)),
                       symmetric_kernel=symmetric_kernel_pays(),
                       torch_cpu_capability=torch.backends.cpu.get_cpu_capability())
        for key, value in kernels.items():
            print(f"  {key}: {value}")
    results = []
    for d, layers in sets:
        r = bench_set(d, layers, args.device, args.rounds, args.steps, args.profile)
        sys.stdout.flush()
        results.append(r)
        print(f"\nd={d}, {layers} layers: {r['matrices']} matrices, {r['params_m']} M params")
        for name, ms in r["ms"].items():
            ratio = r["speedup"].get(name)
            tail = f"  {ratio:.2f}x faster than torch.optim.Muon" if ratio else ""
            print(f"  {name:<30} {ms:10.2f} ms/step {r['gflops'][name]:8.1f} GFLOP/s (NS){tail}")
        b = r["bmm"]
        print(f"  Newton-Schulz products: {r['ns_gflop_per_step']:.3f} GFLOP a step; plain bf16 "
              f"bmm on the same batches {b['ns_step_gflops']:.1f} GFLOP/s (a 2048^3 bf16 mm: "
              f"{b['mm_2048_gflops']:.1f} GFLOP/s)")
        print(f"  at that bmm rate a step takes >= {r['bound_ms']:.2f} ms with the same arithmetic "
              f"(torch.optim.Muon can be beaten by at most {r['max_speedup_same_arithmetic']:.2f}x)"
              f", >= {r['bound_half_symmetric_ms']:.2f} ms with X·Xᵀ and A·A at half cost "
              f"(at most {r['max_speedup_half_symmetric']:.2f}x)")
        print(f"  symmetric products X·Xᵀ, A·A: plain bmm {b['symmetric_products_ms']:.2f} ms, "
              f"block-symmetric (3 of 4 blocks) {b['symmetric_blocked_ms']:.2f} ms")
    emit_json(dict(bench="muon", device=args.device, machine=machine,
                   torch=torch.__version__, kernels=kernels, results=results))


if __name__ == "__main__":
    main()
