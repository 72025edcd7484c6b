"""codebook_matmul side by side with dense float32 matmul and autograd through dequantize+matmul.

Forward: rlx codebook_matmul vs ``x @ W.T`` (W the dense float32 weight, already built).
Backward: rlx codebook_matmul_backward (dx + dcodebook) vs autograd through
``F.embedding(indices, codebook) -> x @ W.T`` (the dequantize+matmul training path, the graph
built once and reused). Timed with benchmarks/_timing.py (rounds alternate between the
peers); ratios are baseline / rlx (> 1 means rlx is faster), from medians of wall-clock and
of process CPU time. Prints the CPU (model, ISA features) first and one JSON line at the end.

    python benchmarks/bench_codebook.py [--rows 1 16 256] [--threads N] [--repeat 15]
    python benchmarks/bench_codebook.py --num-entries 65536 --rows 1 16   # 1x16 (int16 codes)
    python benchmarks/bench_codebook.py --device cuda [...]   (benchmarks/bench_codebook_cuda.py)

Larger E is also timed through the packed index layout (``codebook_matmul_packed``, the
layout built once per weight, as CodebookLinear keeps it) for up to 16 rows.
E <= 256 uses uint8 codes (the lookup-table kernels); larger E int16 codes stored as AQLM does
(values >= 2**15 wrapped negative), which take the gather kernels, and the forward is timed a
second time with the codebook in float16 (AQLM's dtype, read as it is by the kernel) against
the dense float32 weight built from the same float16 entries.
"""

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import best_ms, cpu_summary, emit_json, median_ms, side_by_side  # noqa: E402

import rlx_torch  # noqa: E402


def paired_times(fns, repeat, warmup=2):
    """The samples of ``fns = [baseline, rlx]``, side by side (benchmarks/_timing.py)."""
    samples = side_by_side({"baseline": fns[0], "rlx": fns[1]}, repeat, warmup=warmup)
    return samples["baseline"], samples["rlx"]


def summarize(name, base, ours):
    row = {}
    for kind in ("wall", "cpu"):
        b, o = median_ms(base, kind), median_ms(ours, kind)
        row[f"{kind}_ms_baseline"], row[f"{kind}_ms_rlx"] = b, o
        row[f"{kind}_ratio"] = b / o
    row["wall_ratio_best"] = best_ms(base) / best_ms(ours)
    print(
        f"  {name:<30} wall {row['wall_ms_baseline']:8.2f} / {row['wall_ms_rlx']:7.2f} ms "
        f"= {row['wall_ratio']:5.2f}x (best {row['wall_ratio_best']:5.2f}x)   cpu "
        f"{row['cpu_ms_baseline']:8.2f} / {row['cpu_ms_rlx']:7.2f} ms = {row['cpu_ratio']:5.2f}x"
    )
    return row


def main():
    if "--device" in sys.argv:
        return main_device()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--features", type=int, default=4096, help="N = K")
    parser.add_argument("--entry-dim", type=int, default=8)
    parser.add_argument("--num-entries", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--slice-entries", type=int, default=0, help="packed layout's slice (0: the default)"
    )
    parser.add_argument(
        "--block-rows", type=int, default=0, help="packed layout's row block (0: the default)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n = k = args.features
    d, e = args.entry_dim, args.num_entries
    codes = torch.randint(0, e, (n, k // d))
    if e <= 256:
        indices = codes.to(torch.uint8)
    else:
        indices = (codes - 65536 * (codes >= 32768)).to(torch.int16)
    codebook = torch.randn(e, d) / k**0.5
    weight = F.embedding(codes, codebook).reshape(n, k).contiguous()
    if e > 256:
        codebook16 = codebook.half()
        weight16 = F.embedding(codes, codebook16.float()).reshape(n, k).contiguous()
    print(
        f"codebook_matmul N=K={n} D={d} E={e} M=1 codebook, threads={torch.get_num_threads()}, "
        f"indices {indices.dtype}, torch {torch.__version__}, {platform.machine()}"
    )
    print(f"CPU: {cpu_summary()}")
    results = {}
    for rows in args.rows:
        print(f"rows={rows}")
        x = torch.randn(rows, k)
        grad_out = torch.randn(rows, n)
        fwd = paired_times(
            [
                lambda x=x: x @ weight.T,
                lambda x=x: torch.ops.rlx.codebook_matmul(x, indices, codebook, None, None),
            ],
            args.repeat,
        )
        entry = {"forward_vs_dense": summarize("forward vs dense x @ W.T", *fwd)}
        if e > 256:
            # AQLM's float16 codebook, read as it is, against the dense float32 weight built
            # from the same (float16-rounded) entries.
            fwd16 = paired_times(
                [
                    lambda x=x: x @ weight16.T,
                    lambda x=x: torch.ops.rlx.codebook_matmul(x, indices, codebook16, None, None),
                ],
                args.repeat,
            )
            entry["forward_fp16_codebook_vs_dense"] = summarize(
                "fp16 codebook vs dense x @ W.T", *fwd16
            )
            if indices.dim() == 2 and rows <= 16:
                # The layout CodebookLinear builds once per weight (csrc/cpu/codebook_packed.h).
                packed = torch.ops.rlx.codebook_pack_indices(
                    indices, e, args.slice_entries, args.block_rows
                )
                for name, cb, w in (("", codebook, weight), ("fp16 ", codebook16, weight16)):
                    fwdp = paired_times(
                        [
                            lambda x=x, w=w: x @ w.T,
                            lambda x=x, cb=cb, p=packed: torch.ops.rlx.codebook_matmul_packed(
                                x, p, indices, cb, None, None
                            ),
                        ],
                        args.repeat,
                    )
                    key = f"forward_packed_{name.strip() or 'fp32'}_vs_dense"
                    entry[key] = summarize(f"packed {name}vs dense x @ W.T", *fwdp)

        x_req = x.clone().requires_grad_()
        cb_req = codebook.clone().requires_grad_()
        out = x_req @ F.embedding(codes, cb_req).reshape(n, k).T

        bwd = paired_times(
            [
                lambda out=out, x_req=x_req, cb_req=cb_req, g=grad_out: torch.autograd.grad(
                    out, (x_req, cb_req), g, retain_graph=True
                ),
                lambda x=x, g=grad_out: torch.ops.rlx.codebook_matmul_backward(
                    g, x, indices, codebook, None, [True, True, False, False]
                ),
            ],
            args.repeat,
        )
        entry["backward_vs_autograd"] = summarize("backward dx+dC vs autograd", *bwd)
        results[str(rows)] = entry
    record = {
        "bench": "codebook_matmul",
        "features": n,
        "entry_dim": d,
        "num_entries": e,
        "index_dtype": str(indices.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rlx_torch": rlx_torch.__version__,
        "cpu": cpu_summary(),
        "results": results,
    }
    emit_json(record)


def main_device():
    """``--device cuda``: the CUDA benchmark (its own options follow)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    args, rest = parser.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    if args.device == "cpu":
        return main()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_codebook_cuda

    return bench_codebook_cuda.main(rest)


if __name__ == "__main__":
    main()
