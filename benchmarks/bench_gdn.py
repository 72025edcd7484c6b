"""Gated delta rule: rlx_torch.gated_delta_rule side by side with a peer in one process.

CPU (default): against transformers' ``torch_chunk_gated_delta_rule`` (the plain-PyTorch
chunked code HF runs for Qwen3-Next when fla is absent), float32, q/k L2-normalized inside both.
CUDA (``--device cuda``): against fla's Triton kernels (``chunk_gated_delta_rule``, and
``chunk_kda`` for the per-channel gate) where fla imports, bf16, CUDA events, medians.

    .venv/bin/pip install transformers   # benchmark-only dependency
    .venv/bin/python benchmarks/bench_gdn.py [--repeats N] [--quick]
    python benchmarks/bench_gdn.py --device cuda [--repeats N] [--quick]

Prints times, speed-ups and GFLOP/s, then one JSON line. FLOP model (per token and value
head, multiply-add = 2): forward 7*K*V (decay K*V, S^T k, k u^T and S^T q at 2*K*V each);
forward+backward counted as 3x the forward, the usual convention.
"""

import argparse
import inspect
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the in-place build
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_summary, emit_json, median_ms, side_by_side  # noqa: E402

import rlx_torch  # noqa: E402


def load_hf():
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule,
        )
    except ImportError as e:
        print(f"transformers is not installed ({e}); install it for the comparison:\n"
              "    .venv/bin/pip install transformers\n"
              "Timing rlx_torch alone.", file=sys.stderr)
        return None
    # transformers >= 5.x wraps it (use_kernel_func_from_hub_with_fallback) so that it runs
    # fla's Triton kernel where fla imports, which fails on CPU tensors: the plain-PyTorch
    # function is the wrapper's __wrapped__.
    return inspect.unwrap(torch_chunk_gated_delta_rule)


def make_inputs(B, T, H, K, V, requires_grad):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    g = F.logsigmoid(torch.randn(B, T, H) + 2.0)
    beta = torch.rand(B, T, H)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta)]


def ours(q, k, v, g, beta):
    return rlx_torch.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


def theirs_fn(hf):
    def run(q, k, v, g, beta):
        return hf(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return run


def timed(fns, args, backward, repeats):
    """Median wall time (ms) of each fn(*args) (and its backward), side by side
    (benchmarks/_timing.py: alternating order, each timed call right after an untimed call of
    the same function). As in a training loop, the output gradient is given and the inputs'
    .grad are reset to None before every call (zero_grad(set_to_none=True)), so that neither
    the timing nor the gradients include an accumulation into .grad from earlier calls."""
    grad_out = torch.ones_like(fns[0](*args)) if backward else None

    def once(fn):
        def run():
            out = fn(*args)
            if backward:
                out.backward(grad_out)
        return run

    def zero_grad(_name):
        for t in args:
            t.grad = None

    samples = side_by_side({i: once(fn) for i, fn in enumerate(fns)}, repeats, warmup=0,
                           untimed_first=True, setup=zero_grad)
    zero_grad(None)
    return [median_ms(samples[i]) for i in range(len(fns))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="only the small shape")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's own choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--gate", choices=["head", "channel", "both"], default="both",
                        help="cuda: per-head gate, per-channel gate (KDA) or both")
    parser.add_argument("--shapes", type=int, nargs="+", default=None, metavar="I",
                        help="cuda: which of the shapes to run (indices from 0; default all)")
    parser.add_argument("--no-fla", action="store_true",
                        help="cuda: time rlx_torch alone (where fla's kernel crashes the process)")
    parser.add_argument("--no-profile", action="store_true",
                        help="cuda: skip the per-kernel profile after the timings")
    args = parser.parse_args()
    if args.device == "cuda":
        from bench_gdn_cuda import main_cuda  # the CUDA side (fla, CUDA events)

        return main_cuda(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hf = load_hf()
    cases = [("fwd", (1, 2048, 4, 64, 64), False, args.repeats),
             ("fwd+bwd", (1, 2048, 4, 64, 64), True, args.repeats)]
    if not args.quick:
        cases.append(("fwd", (1, 8192, 16, 128, 128), False, max(1, args.repeats // 3)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print(f"CPU: {cpu_summary()}")
    results = []
    for mode, (B, T, H, K, V), backward, repeats in cases:
        inputs = make_inputs(B, T, H, K, V, backward)
        with torch.set_grad_enabled(backward):
            if hf is not None:  # same math: check before timing
                diff = (ours(*inputs) - theirs_fn(hf)(*inputs)).abs().max().item()
                assert diff < 1e-3, f"outputs differ by {diff}"
            fns = [ours] + ([theirs_fn(hf)] if hf else [])
            t_ours, t_hf = (timed(fns, inputs, backward, repeats) + [None])[:2]
        flops = 7 * K * V * B * T * H * (3 if backward else 1)
        row = dict(mode=mode, B=B, T=T, H=H, K=K, V=V, rlx_ms=round(t_ours, 2),
                   hf_ms=round(t_hf, 2) if t_hf else None,
                   speedup=round(t_hf / t_ours, 2) if t_hf else None,
                   rlx_gflops=round(flops / t_ours / 1e6, 2))
        results.append(row)
        shape = f"B={B} T={T} H={H} K={K} V={V}"
        hf_text = f"hf {t_hf:9.1f} ms  speed-up {t_hf / t_ours:6.1f}x" if t_hf else "hf n/a"
        print(f"{mode:8s} {shape:32s} rlx {t_ours:8.1f} ms ({row['rlx_gflops']:.1f} GFLOP/s)"
              f"  {hf_text}")
    emit_json({"bench": "gated_delta_rule", "threads": torch.get_num_threads(),
               "cpu": cpu_summary(), "results": results})


if __name__ == "__main__":
    main()
