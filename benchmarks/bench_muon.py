"""Step time of rlx_torch.optim.Muon against torch.optim.Muon, side by side in one process.

GPT-like parameter sets: per layer 4 x [d, d] (attention), [4d, d], [d, 4d], [4d, d] (MLP).
Both optimizers get equal settings (lr, momentum, Nesterov, weight decay, Keller coefficients,
5 steps, "original" lr adjustment, bf16 Newton–Schulz as torch.optim.Muon always uses) and
step the same params and grads. Timed with benchmarks/_timing.py: rounds alternate between
the contenders so that load from other processes hits all alike; the median round counts.
Prints the CPU (model, ISA features), a table, the ratios and one JSON line.

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


def bench_set(d: int, layers: int, device: str, rounds: int, steps: int) -> dict:
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
    medians = {name: median_ms(s) / 1e3 / steps for name, s in samples.items()}
    base = medians["torch.optim.Muon"]
    result = dict(
        d=d, layers=layers, matrices=len(params),
        params_m=round(sum(p.numel() for p in params) / 1e6, 1),
        ms={name: round(t * 1e3, 3) for name, t in medians.items()},
        speedup={name: round(base / t, 2) for name, t in medians.items() if t is not base},
    )
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
        r = bench_set(d, layers, args.device, args.rounds, args.steps)
        sys.stdout.flush()
        results.append(r)
        print(f"\nd={d}, {layers} layers: {r['matrices']} matrices, {r['params_m']} M params")
        for name, ms in r["ms"].items():
            ratio = r["speedup"].get(name)
            tail = f"  {ratio:.2f}x faster than torch.optim.Muon" if ratio else ""
            print(f"  {name:<30} {ms:10.2f} ms/step{tail}")
    emit_json(dict(bench="muon", device=args.device, machine=machine,
                   torch=torch.__version__, kernels=kernels, results=results))


if __name__ == "__main__":
    main()
