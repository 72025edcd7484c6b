"""The CUDA side of bench_gdn.py (``python benchmarks/bench_gdn.py --device cuda``):
rlx_torch.gated_delta_rule against fla's Triton kernels in one process, bf16 q/k/v, float32
g/beta, q/k L2-normalized inside both, per-head gate (fla's ``chunk_gated_delta_rule``) and
per-channel gate (``chunk_kda``). Times are CUDA-event medians after warm-ups, the two sides
taking turns. TFLOP/s use the recurrence's count (bench_gdn.py's docstring): 7*K*V per token
and head forward, 3x that forward+backward. "rlx" is the token recurrence
(RLX_CUDA_GATED_DELTA_CHUNKED=0 around forward and backward); the chunked tensor-core
kernels (the default for 16-bit inputs, either gate) are timed in the same turns; at the end,
torch.profiler gives the CUDA time per kernel of both paths at the first shape, per-head gate,
and of the chunked path with the per-channel gate.

Run as a script (``python benchmarks/bench_gdn_cuda.py [--chunk-size 64 128]``) it times the
chunked path through ``torch.ops.rlx.gated_delta_fwd`` / ``gated_delta_bwd`` directly (first
shape, bf16, per-head gate, q and k unit rows, no l2norm: CUDA-event medians, then the CUDA
time per kernel of one forward+backward) and checks that the backward is bitwise
reproducible, equal across chunk sizes (the states from the 64-token checkpoints or from a
re-run of the state kernel round alike) and close to the token backward.
"""

import contextlib
import itertools
import json
import os
import statistics

import torch
import torch.nn.functional as F

import rlx_torch

SHAPES = [(4, 4096, 16, 128, 128), (1, 16384, 16, 128, 128), (8, 2048, 32, 64, 64)]


def load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001 (fla missing, or its Triton refuses this GPU)
        print(f"fla is not importable ({e}): timing rlx_torch alone")
        return None
    import fla

    return {"version": getattr(fla, "__version__", "?"), "head": chunk_gated_delta_rule,
            "channel": chunk_kda}


def make_inputs(B, T, H, K, V, per_channel, requires_grad):
    dev = torch.device("cuda")
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
    g_shape = (B, T, H, K) if per_channel else (B, T, H)
    g = F.logsigmoid(torch.randn(g_shape, device=dev) + 2.0)
    beta = torch.rand(B, T, H, device=dev)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, beta)]


def ours(q, k, v, g, beta):
    return rlx_torch.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)[0]


def chunked(q, k, v, g, beta):
    """rlx_torch on the chunked tensor-core kernels (the default for 16-bit inputs): rlx_path
    sets RLX_CUDA_GATED_DELTA_CHUNKED=1 around its forward and its backward (the ops read it
    at every call)."""
    return ours(q, k, v, g, beta)


@contextlib.contextmanager
def rlx_path(fn):
    """RLX_CUDA_GATED_DELTA_CHUNKED=1 while `chunked` (forward and backward) runs, 0 (the token
    recurrence) while any other fn runs, restored afterwards."""
    key = "RLX_CUDA_GATED_DELTA_CHUNKED"
    saved = os.environ.pop(key, None)
    os.environ[key] = "1" if fn is chunked else "0"
    try:
        yield
    finally:
        os.environ.pop(key, None)
        if saved is not None:
            os.environ[key] = saved


def kernel_profile(fn, B, T, H, K, V, per_channel, backward):
    """CUDA time per kernel (microseconds per call, torch.profiler) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    inputs = make_inputs(B, T, H, K, V, per_channel, backward)
    grad_out = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)

    def once():
        with torch.set_grad_enabled(backward), rlx_path(fn):
            out = fn(*inputs)
            if backward:
                out.backward(grad_out)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            once()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append((round(us / reps, 1), e.key[:90]))
    return sorted(rows, reverse=True)[:30]


def theirs(fn):
    def run(q, k, v, g, beta):
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return run


def time_cuda(fns, args, backward, warmup, repeats):
    """Median milliseconds of each fn (and its backward), by CUDA events, turns alternating."""
    grad_out = torch.randn_like(fns[0](*args)) if backward else None

    def once(fn):
        with rlx_path(fn):
            out = fn(*args)
            if backward:
                out.backward(grad_out)
        for t in args:
            t.grad = None

    for fn in fns:
        for _ in range(warmup):
            once(fn)
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for r in range(repeats):
        order = list(range(len(fns)))
        for i in order if r % 2 == 0 else order[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once(fns[i])
            end.record()
            torch.cuda.synchronize()
            times[i].append(start.elapsed_time(end))
    return [statistics.median(t) for t in times]


def main_cuda(args):
    torch.manual_seed(0)
    fla = None if args.no_fla else load_fla()
    name = torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {name}, fla {fla['version'] if fla else 'n/a'}")
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes is not None:
        shapes = [SHAPES[i] for i in args.shapes]
    results = []
    for gate in ("head", "channel") if args.gate == "both" else (args.gate,):
        for B, T, H, K, V in shapes:
            for mode, backward in (("fwd", False), ("fwd+bwd", True)):
                inputs = make_inputs(B, T, H, K, V, gate == "channel", backward)
                fns = [ours] + ([theirs(fla[gate])] if fla else []) + [chunked]
                with torch.set_grad_enabled(backward):
                    t = time_cuda(fns, inputs, backward, warmup=3, repeats=max(args.repeats, 5))
                t_ours, t_fla = t[0], (t[1] if fla else None)
                t_chunked = t[-1]
                flops = 7 * K * V * B * T * H * (3 if backward else 1)
                row = dict(gate=gate, mode=mode, B=B, T=T, H=H, K=K, V=V,
                           rlx_ms=round(t_ours, 3), fla_ms=round(t_fla, 3) if t_fla else None,
                           ratio=round(t_ours / t_fla, 2) if t_fla else None,
                           chunked_ms=round(t_chunked, 3) if t_chunked else None,
                           chunked_ratio=(round(t_chunked / t_fla, 2)
                                          if t_chunked and t_fla else None),
                           rlx_tflops=round(flops / t_ours / 1e9, 2),
                           fla_tflops=round(flops / t_fla / 1e9, 2) if t_fla else None)
                results.append(row)
                fla_text = (f"fla {t_fla:8.3f} ms ({row['fla_tflops']:.2f} TFLOP/s)  "
                            f"rlx/fla {row['ratio']:.2f}x" if t_fla else "fla n/a")
                token_text = f"  rlx chunked {t_chunked:8.3f} ms" if t_chunked else ""
                if row["chunked_ratio"]:
                    token_text += f" (chunked/fla {row['chunked_ratio']:.2f}x)"
                print(f"{gate:7s} {mode:8s} B={B} T={T} H={H} K={K} V={V}  rlx {t_ours:8.3f} ms "
                      f"({row['rlx_tflops']:.2f} TFLOP/s)  {fla_text}{token_text}", flush=True)
                del inputs
    profiles = {}
    paths = [("token", ours, False), ("chunked", chunked, False), ("chunked", chunked, True)]
    for (path, fn, per_channel), (mode, backward) in itertools.product(
            () if args.no_profile else paths, (("fwd", False), ("fwd+bwd", True))):
        gate = "channel" if per_channel else "head"
        if args.gate not in ("both", gate):
            continue
        rows = kernel_profile(fn, *SHAPES[0], per_channel, backward)
        profiles[f"{path} {gate} {mode}"] = rows
        print(f"per-kernel CUDA time, {path}, {gate} gate, {mode}, shape {SHAPES[0]} "
              "(us per call):")
        for us, kernel in rows:
            print(f"  {us:10.1f}  {kernel}")
    print(json.dumps({"bench": "gated_delta_rule_cuda", "profile": profiles, "device": name,
                      "fla": fla["version"] if fla else None, "results": results}))


def _direct_inputs(B, T, H, K, V):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = torch.device("cuda"), torch.bfloat16
    q = F.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1).to(bf)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1).to(bf)
    v = torch.randn(B, T, H, V, device=dev, generator=gen).to(bf)
    g = F.logsigmoid(torch.randn(B, T, H, device=dev, generator=gen) + 2.0)
    beta = torch.rand(B, T, H, device=dev, generator=gen)
    do = torch.randn(B, T, H, V, device=dev, generator=gen).to(bf)
    return q, k, v, g, beta, do


def direct_ops(chunk_sizes, repeats=10):
    """Times and profiles the chunked forward and backward ops (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    os.environ["RLX_CUDA_GATED_DELTA_CHUNKED"] = "1"
    B, T, H, K, V = SHAPES[0]
    q, k, v, g, beta, do = _direct_inputs(B, T, H, K, V)
    scale = K ** -0.5
    fwd, bwd = torch.ops.rlx.gated_delta_fwd, torch.ops.rlx.gated_delta_bwd

    def run_fwd(cs):
        return fwd(q, k, v, g, beta, scale, None, None, cs, None)

    def run_bwd(cs, outs):
        return bwd(q, k, v, g, beta, scale, None, None, outs[2], do, None, cs, None, outs[3])

    def median_ms(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, direct ops, bf16, "
          f"per-head gate, B={B} T={T} H={H} K={K} V={V}, no l2norm ({rlx_torch.__file__})")
    rows, packed = [], {}
    for cs in chunk_sizes:
        outs = run_fwd(cs)
        t_fwd = median_ms(lambda cs=cs: run_fwd(cs))
        t_bwd = median_ms(lambda cs=cs, outs=outs: run_bwd(cs, outs))
        t_both = median_ms(lambda cs=cs: run_bwd(cs, run_fwd(cs)))
        first, second = run_bwd(cs, outs), run_bwd(cs, outs)
        bitwise = bool(torch.equal(first, second))
        packed[cs] = first
        row = dict(chunk_size=cs, fwd_ms=round(t_fwd, 3), bwd_ms=round(t_bwd, 3),
                   fwd_bwd_ms=round(t_both, 3), bitwise_reproducible=bitwise,
                   finite=bool(torch.isfinite(first).all()))
        rows.append(row)
        print(f"chunk_size {cs}: forward {t_fwd:.3f} ms, backward {t_bwd:.3f} ms, "
              f"forward+backward {t_both:.3f} ms, bitwise reproducible {bitwise}", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run_bwd(cs, run_fwd(cs))
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -(
                getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0))):
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if us > 0:
                print(f"  {us / 5:10.1f} us  x{e.count // 5:<3d} {e.key[:80]}")
    sizes = list(packed)
    for cs in sizes[1:]:
        same = bool(torch.equal(packed[sizes[0]], packed[cs]))
        print(f"backward at chunk_size {sizes[0]} and {cs} bitwise equal: {same}")
        rows.append(dict(chunk_sizes=[sizes[0], cs], bitwise_equal=same))
    outs = run_fwd(sizes[0])
    os.environ["RLX_CUDA_GATED_DELTA_CHUNKED"] = "0"  # the token backward on the same outputs
    token = run_bwd(sizes[0], outs)
    os.environ["RLX_CUDA_GATED_DELTA_CHUNKED"] = "1"
    chunked = run_bwd(sizes[0], outs)
    rel = ((chunked.double() - token.double()).pow(2).mean().sqrt()
           / token.double().pow(2).mean().sqrt()).item()
    print(f"chunked against token backward (same forward outputs): {rel:.2e} relative RMS")
    rows.append(dict(chunked_vs_token_rel_rms=rel))
    print(json.dumps({"bench": "gated_delta_ops_cuda", "device": torch.cuda.get_device_name(),
                      "results": rows}))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunk-size", type=int, nargs="+", default=[64, 128])
    direct_ops(parser.parse_args().chunk_size)
