"""codebook_matmul on CUDA side by side with dense fp16 ``x @ W.T`` (cuBLAS) and autograd
through dequantize + matmul.

Forward: rlx codebook_matmul vs ``x @ W.T``, W the dense weight in x's dtype, already built,
and vs AQLM's own CUDA kernels where the aqlm package imports (aqlm 1.1.7 builds them with
torch.utils.cpp_extension on first use), called as AQLM's QuantizedLinear calls them: up to 6
rows its matrix-vector op, more rows its dequantize + matmul op, with scales of ones (its ops
always apply scales; ours are called without).
Backward: rlx codebook_matmul_backward (dx + dcodebook) vs autograd through
``sum_m F.embedding(indices[..., m], codebook[m]) -> x @ W.T`` (the graph built once, reused).
Each peer cycles through enough copies of its inputs to overrun the L2 cache, so weights come
from device memory as in a real model. Times are CUDA-event medians of back-to-back calls
("eager", launch overhead included) and of CUDA-graph replays of the same calls ("graph", the
GPU time). Ratios are baseline / rlx (> 1: rlx is faster); outputs are checked against the
dense product first. At batch 1 the forward's bytes (codes, codebook, x, out) over its graph
time are compared with a measured device copy. Prints a table and one JSON line.

    python benchmarks/bench_codebook_cuda.py [--features 4096 8192] [--rows 1 16 256 4096]
    python benchmarks/bench_codebook.py --device cuda      (the same)
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

import rlx_torch

L2_OVERRUN_BYTES = 256 << 20


def copy_bandwidth():
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) * 1e-3)


def time_calls(fns, repeat, graph):
    """Median seconds per call of cycling through fns (one call each), by CUDA events."""
    def run_all():
        for fn in fns:
            fn()

    for _ in range(3):
        run_all()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_all()
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                run_all()
        torch.cuda.current_stream().wait_stream(stream)
        run_all = g.replay  # noqa: F811
        run_all()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_all()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(fns))
    return statistics.median(times)


def copies_for(bytes_per_set, cap=64):
    return max(2, min(cap, -(-L2_OVERRUN_BYTES // max(bytes_per_set, 1))))


def dequantize(indices, codebook):
    n, groups, m = indices.shape
    w = sum(F.embedding(indices[:, :, i].long(), codebook[i]) for i in range(m))
    return w.reshape(n, -1)


def load_aqlm():
    """torch.ops.aqlm with AQLM's CUDA kernels built and registered, or None (with the reason
    printed) where the package is missing or its kernels do not build."""
    try:
        import aqlm.inference_kernels.cuda_kernel  # noqa: F401  (builds, registers the ops)
    except Exception as e:  # ImportError, or the extension build failing
        print(f"AQLM's CUDA kernels not run: {type(e).__name__}: {str(e)[:300]}")
        return None
    return torch.ops.aqlm


def aqlm_forwards(aqlm_ops, indices, codebooks, xs, rows):
    """AQLM's forward of each input set, as QuantizedLinear picks it (aqlm/inference.py:
    at most 6 rows the matrix-vector kernel, else dequantize + matmul). AQLM's codes are the
    same bytes read as int8, its codebooks [M, E, out_group_size = 1, D]."""
    m, e, d = codebooks[0].shape
    name = f"code{m}x8_matmat" + ("" if rows <= 6 else "_dequant")
    op = getattr(aqlm_ops, name)
    ones = torch.ones(indices[0].shape[0], 1, 1, 1, device="cuda", dtype=xs[0].dtype)
    codes = [t.view(torch.int8) for t in indices]
    cbs = [c.view(m, e, 1, d) for c in codebooks]
    return [lambda i=i: op(xs[i], codes[i], cbs[i], ones, None) for i in range(len(xs))]


def bench_case(n, k, m, rows, dtype, repeat, backward, copy_bw, aqlm_ops=None):
    d, e = 8, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx_bytes = n * (k // d) * m
    sets = copies_for(idx_bytes)
    indices = [torch.randint(0, e, (n, k // d, m), device="cuda", dtype=torch.uint8,
                             generator=gen) for _ in range(sets)]
    codebooks = [(torch.randn(m, e, d, device="cuda", generator=gen) / (k * m) ** 0.5).to(dtype)
                 for _ in range(sets)]
    xs = [torch.randn(rows, k, device="cuda", generator=gen).to(dtype) for _ in range(sets)]
    dense_sets = copies_for(n * k * 2, cap=8)
    weights = [dequantize(indices[i], codebooks[i]).contiguous() for i in range(dense_sets)]
    row = {}
    ours = [lambda i=i: torch.ops.rlx.codebook_matmul(xs[i], indices[i], codebooks[i], None, None)
            for i in range(sets)]
    base = [lambda i=i: xs[i] @ weights[i].T for i in range(dense_sets)]
    peer = (aqlm_forwards(aqlm_ops, indices, codebooks, xs, rows)
            if aqlm_ops is not None and m in (1, 2) else None)
    want = xs[0].double() @ weights[0].double().T
    tol = 2e-2 * want.abs().max().item()
    err = (ours[0]().double() - want).abs().max().item()
    assert err <= tol, f"rlx forward off the dense product by {err} (tolerance {tol})"
    if peer:
        try:
            err = (peer[0]().double() - want).abs().max().item()
        except (RuntimeError, TypeError) as e:
            print(f"AQLM's kernel failed at {n}x{k} M={m} rows={rows}: {str(e)[:300]}")
            peer = None
        else:
            assert err <= tol, f"AQLM forward off the dense product by {err} (tolerance {tol})"
    for mode in ("eager", "graph"):
        t_base = time_calls(base, repeat, mode == "graph")
        t_ours = time_calls(ours, repeat, mode == "graph")
        row[f"fwd_{mode}_us_dense"], row[f"fwd_{mode}_us_rlx"] = t_base * 1e6, t_ours * 1e6
        row[f"fwd_{mode}_ratio"] = t_base / t_ours
        if peer:
            t_peer = time_calls(peer, repeat, mode == "graph")
            row[f"fwd_{mode}_us_aqlm"] = t_peer * 1e6
            row[f"fwd_{mode}_ratio_aqlm"] = t_peer / t_ours
    moved = idx_bytes + codebooks[0].nbytes + xs[0].nbytes + rows * n * xs[0].element_size()
    row["fwd_bytes"] = moved
    row["fwd_graph_bandwidth_fraction"] = moved / (row["fwd_graph_us_rlx"] * 1e-6) / copy_bw
    if backward:
        bsets = min(dense_sets, 4)
        grads = [torch.randn(rows, n, device="cuda", generator=gen).to(dtype) for _ in range(bsets)]
        graphs = []
        for i in range(bsets):
            x_req = xs[i].clone().requires_grad_()
            cb_req = codebooks[i].clone().requires_grad_()
            graphs.append((x_req @ dequantize(indices[i], cb_req).T, x_req, cb_req))
        auto = [lambda i=i: torch.autograd.grad(graphs[i][0], graphs[i][1:], grads[i],
                                                retain_graph=True) for i in range(bsets)]
        mask = [True, True, False, False]
        ours_bwd = [lambda i=i: torch.ops.rlx.codebook_matmul_backward(
            grads[i % bsets], xs[i], indices[i], codebooks[i], None, mask) for i in range(sets)]
        t_base = time_calls(auto, repeat, False)
        t_ours = time_calls(ours_bwd, repeat, False)
        row["bwd_eager_us_autograd"], row["bwd_eager_us_rlx"] = t_base * 1e6, t_ours * 1e6
        row["bwd_eager_ratio"] = t_base / t_ours
        del graphs
    return row


def run(features=(4096, 8192), rows_list=(1, 16, 256, 4096), codebooks=(1, 2),
        dtype=torch.float16, repeat=20, backward_rows=(1, 16, 256)):
    """Runs every case and prints the table and the JSON line; returns the JSON record."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_codebook_cuda: no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth()
    aqlm_ops = load_aqlm()
    print(f"codebook_matmul on {name}, torch {torch.__version__}, {dtype}, D=8 E=256, "
          f"device copy {copy_bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'N=K':>5} {'M':>2} {'rows':>5} | {'fwd graph us dense/rlx':>24} {'ratio':>6} | "
          f"{'fwd eager us dense/rlx':>24} {'ratio':>6} | {'bwd us autograd/rlx':>22} {'ratio':>6}")
    results = {}
    for n in features:
        for m in codebooks:
            for rows in rows_list:
                r = bench_case(n, n, m, rows, dtype, repeat, rows in backward_rows, copy_bw,
                               aqlm_ops)
                results[f"{n}x{n}_M{m}_rows{rows}"] = r
                bwd = (f"{r['bwd_eager_us_autograd']:10.1f} /{r['bwd_eager_us_rlx']:9.1f} "
                       f"{r['bwd_eager_ratio']:6.2f}" if "bwd_eager_ratio" in r else " " * 29)
                print(f"{n:>5} {m:>2} {rows:>5} | {r['fwd_graph_us_dense']:11.1f} /"
                      f"{r['fwd_graph_us_rlx']:10.1f} {r['fwd_graph_ratio']:6.2f} | "
                      f"{r['fwd_eager_us_dense']:11.1f} /{r['fwd_eager_us_rlx']:10.1f} "
                      f"{r['fwd_eager_ratio']:6.2f} | {bwd}"
                      + (f"   bw {100 * r['fwd_graph_bandwidth_fraction']:.0f}%"
                         if rows == 1 else "")
                      + (f"   aqlm graph/eager {r['fwd_graph_us_aqlm']:.1f} / "
                         f"{r['fwd_eager_us_aqlm']:.1f} us = {r['fwd_graph_ratio_aqlm']:.2f}x / "
                         f"{r['fwd_eager_ratio_aqlm']:.2f}x" if "fwd_graph_us_aqlm" in r else ""))
                torch.cuda.empty_cache()
    record = {"bench": "codebook_matmul_cuda", "device": name, "torch": torch.__version__,
              "rlx_torch": rlx_torch.__version__, "dtype": str(dtype),
              "copy_bandwidth": copy_bw, "results": results}
    print(json.dumps(record))
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--features", type=int, nargs="+", default=[4096, 8192], help="N = K")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--codebooks", type=int, nargs="+", default=[1, 2], help="M")
    parser.add_argument("--backward-rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    run(args.features, args.rows, args.codebooks, getattr(torch, args.dtype), args.repeat,
        args.backward_rows)


if __name__ == "__main__":
    main()
