"""Side-by-side benchmarks of the Metal kernels on an Apple GPU (run by scripts/verify_macos.sh).

- codebook matmul (fp16, 1 codebook of 256 entries x 8, the AQLM-2-bit-like layout) against
  the dense fp16 matmul with the dequantized weight, forward and forward+backward;
- gated delta rule (fp16 or bf16, Qwen3-Next head sizes) against Hugging Face's plain-PyTorch
  chunked implementation (transformers' torch_chunk_gated_delta_rule) when transformers is
  installed, else against rlx's plain-PyTorch reference recurrence.

Prints one line per comparison (times and the ratio) and a final JSON line.
    python benchmarks/bench_mps.py                 # device mps
    python benchmarks/bench_mps.py --device cpu --quick   # smoke test anywhere
"""

import argparse
import json
import platform
import time

import torch

import rlx_torch
from rlx_torch.ops import reference


def sync(device):
    if device == "mps":
        torch.mps.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats):
    fn()  # warm-up: pipelines compile on first use
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_codebook(device, quick, repeats):
    n = k = 512 if quick else 4096
    d, e = 8, 256
    dtype = torch.float16 if device != "cpu" else torch.float32
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, e, (n, k // d), generator=g, dtype=torch.uint8).to(device)
    codebook = (torch.randn(e, d, generator=g) * 0.05).to(device, dtype)
    weight = reference.codebook_dequantize(indices, codebook)
    rows = []
    for batch in ([1, 16] if quick else [1, 16, 256]):
        x = torch.randn(batch, k, generator=g).to(device, dtype)
        fwd = timed(lambda x=x: rlx_torch.ops.codebook_matmul(x, indices, codebook), device,
                    repeats)
        dense = timed(lambda x=x: x @ weight.t(), device, repeats)
        xg = x.clone().requires_grad_()
        cg = codebook.clone().requires_grad_()
        wg = weight.clone().requires_grad_()

        def train_codebook(xg=xg, cg=cg):
            rlx_torch.ops.codebook_matmul(xg, indices, cg).sum().backward()

        def train_dense(xg=xg, wg=wg):
            (xg @ wg.t()).sum().backward()

        fb = timed(train_codebook, device, repeats)
        fb_dense = timed(train_dense, device, repeats)
        rows.append({"batch": batch, "n": n, "k": k, "codebook_fwd_ms": fwd * 1e3,
                     "dense_fwd_ms": dense * 1e3, "fwd_speedup": dense / fwd,
                     "codebook_fwdbwd_ms": fb * 1e3, "dense_fwdbwd_ms": fb_dense * 1e3,
                     "fwdbwd_speedup": fb_dense / fb})
        print(f"codebook B={batch:4d} {n}x{k} {str(dtype)[6:]}: fwd {fwd * 1e3:8.3f} ms vs dense "
              f"{dense * 1e3:8.3f} ms -> x{dense / fwd:5.2f};  fwd+bwd {fb * 1e3:8.3f} ms vs "
              f"{fb_dense * 1e3:8.3f} ms -> x{fb_dense / fb:5.2f}")
    return rows


def _peer_gdn():
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import (
            torch_chunk_gated_delta_rule,
        )
    except ImportError:
        return "rlx reference (token-by-token recurrence)", lambda q, k, v, g, b: (
            reference.gated_delta_rule(q, k, v, g, b)[0])
    return "HF torch_chunk_gated_delta_rule", lambda q, k, v, g, b: torch_chunk_gated_delta_rule(
        q, k, v, g, b)[0]


def bench_gdn(device, quick, repeats):
    b, t, h, dk = (1, 128, 4, 64) if quick else (1, 2048, 16, 128)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q = torch.nn.functional.normalize(make(b, t, h, dk), dim=-1)
    k = torch.nn.functional.normalize(make(b, t, h, dk), dim=-1)
    v = make(b, t, h, dk)
    g = -torch.rand(b, t, h, generator=gen).to(device, torch.float32) * 0.1
    beta = torch.rand(b, t, h, generator=gen).to(device, torch.float32)
    name, peer = _peer_gdn()
    ours = timed(lambda: rlx_torch.ops.gated_delta_rule(q, k, v, g, beta), device, repeats)
    theirs = timed(lambda: peer(q, k, v, g.to(dtype), beta.to(dtype)), device,
                   max(1, repeats // 3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def train():
        rlx_torch.ops.gated_delta_rule(*leaves, g, beta)[0].float().square().sum().backward()

    def train_peer():
        peer(*leaves, g.to(dtype), beta.to(dtype)).float().square().sum().backward()

    fb = timed(train, device, repeats)
    fb_peer = timed(train_peer, device, max(1, repeats // 3))
    print(f"gated delta rule B={b} T={t} H={h} K=V={dk} {str(dtype)[6:]}: fwd {ours * 1e3:8.2f} "
          f"ms vs {name} {theirs * 1e3:8.2f} ms -> x{theirs / ours:5.2f};  fwd+bwd "
          f"{fb * 1e3:8.2f} ms vs {fb_peer * 1e3:8.2f} ms -> x{fb_peer / fb:5.2f}")
    return {"peer": name, "b": b, "t": t, "h": h, "k": dk, "fwd_ms": ours * 1e3,
            "peer_fwd_ms": theirs * 1e3, "fwd_speedup": theirs / ours, "fwdbwd_ms": fb * 1e3,
            "peer_fwdbwd_ms": fb_peer * 1e3, "fwdbwd_speedup": fb_peer / fb}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "mps" if torch.backends.mps.is_available() else "cpu"
    ap.add_argument("--device", default=default, choices=["mps", "cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    result = {
        "bench": "mps", "device": args.device, "machine": platform.platform(),
        "processor": platform.processor(), "torch": torch.__version__,
        "codebook": bench_codebook(args.device, args.quick, args.repeats),
        "gated_delta": bench_gdn(args.device, args.quick, args.repeats),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
