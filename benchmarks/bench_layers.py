"""Layers, side by side in one process (CPU by default):

1. ShortConvolution's dense path (a sum of W shifted products) against the depthwise
   ``nn.Conv1d`` it replaces (causal padding, same weights), forward + backward.
2. Decoding with the RecurrentCache (one token per step through the conv and recurrent states)
   against recomputing the full forward over the growing prefix for every new token, with the
   demo's model (greedy, so both produce the same bytes; checked).
3. GatedDeltaNet layer throughput, forward + backward, at the demo's size.

    .venv/bin/python benchmarks/bench_layers.py [--repeats N] [--device cpu]

Timed with benchmarks/_timing.py (rounds alternate between the peers; the median counts).
Prints the CPU (model, ISA features), the ratios, then one JSON line.
"""

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the in-place build
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_summary, emit_json, median_ms  # noqa: E402
from _timing import side_by_side as _side_by_side  # noqa: E402

from rlx_torch.models import GDNConfig, GDNLanguageModel  # noqa: E402
from rlx_torch.nn import GatedDeltaNet, ShortConvolution  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "mps":
        torch.mps.synchronize()


def side_by_side(fns, repeats, device):
    """Median seconds of each callable; one call of each per round, in alternating order."""
    samples = _side_by_side(fns, repeats, warmup=1, sync=lambda: sync(device))
    return {name: median_ms(s) / 1e3 for name, s in samples.items()}


def bench_conv(B, T, D, W, repeats, device):
    ours = ShortConvolution(D, W, activation="silu").to(device)
    x = torch.randn(B, T, D, device=device, requires_grad=True)

    def conv1d_path():
        y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), ours.weight, groups=D)
        F.silu(y.transpose(1, 2)).sum().backward()

    def shifted_sum_path():
        ours(x)[0].sum().backward()

    with torch.no_grad():
        y_ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), ours.weight, groups=D))
        torch.testing.assert_close(ours(x)[0], y_ref.transpose(1, 2), rtol=1e-4, atol=1e-5)
    t = side_by_side({"conv1d": conv1d_path, "shifted_sum": shifted_sum_path}, repeats, device)
    return {"shape": [B, T, D, W], "conv1d_ms": t["conv1d"] * 1e3,
            "shifted_sum_ms": t["shifted_sum"] * 1e3, "speedup": t["conv1d"] / t["shifted_sum"]}


def bench_decode(prompt_len, new_tokens, repeats, device):
    torch.manual_seed(0)
    model = GDNLanguageModel(GDNConfig(hidden_size=128, num_layers=2, num_heads=2,
                                       head_dim=64)).to(device).eval()
    prompt = torch.randint(0, 256, (1, prompt_len), device=device)
    results = {}

    @torch.no_grad()
    def with_cache():
        results["cache"] = model.generate(prompt, new_tokens, temperature=0)

    @torch.no_grad()
    def recompute():
        seq = prompt
        for _ in range(new_tokens):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        results["recompute"] = seq[:, prompt_len:]

    t = side_by_side({"recompute": recompute, "cache": with_cache}, repeats, device)
    assert torch.equal(results["cache"], results["recompute"]), "decoding paths disagree"
    return {"prompt": prompt_len, "new_tokens": new_tokens,
            "recompute_ms": t["recompute"] * 1e3, "cache_ms": t["cache"] * 1e3,
            "speedup": t["recompute"] / t["cache"],
            "cache_tokens_per_s": new_tokens / t["cache"]}


def bench_layer(B, T, repeats, device):
    torch.manual_seed(0)
    layer = GatedDeltaNet(128, num_heads=2, head_dim=64, expand_v=1).to(device)
    x = torch.randn(B, T, 128, device=device, requires_grad=True)

    def step():
        layer(x)[0].sum().backward()

    t = side_by_side({"layer": step}, repeats, device)["layer"]
    return {"shape": [B, T, 128], "fwd_bwd_ms": t * 1e3, "tokens_per_s": B * T / t}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, device {device}")
    print(f"CPU: {cpu_summary()}")
    convs = [bench_conv(16, 128, 128, 4, args.repeats, device),
             bench_conv(4, 1024, 512, 4, args.repeats, device)]
    for c in convs:
        print(f"ShortConvolution {c['shape']} fwd+bwd: conv1d {c['conv1d_ms']:.2f} ms, "
              f"shifted sum {c['shifted_sum_ms']:.2f} ms -> {c['speedup']:.2f}x")
    decode = bench_decode(64, 64, max(3, args.repeats // 2), device)
    print(f"decode {decode['new_tokens']} bytes after a {decode['prompt']}-byte prompt: "
          f"recompute {decode['recompute_ms']:.0f} ms, cache {decode['cache_ms']:.0f} ms -> "
          f"{decode['speedup']:.2f}x ({decode['cache_tokens_per_s']:.0f} tokens/s)")
    layer = bench_layer(16, 128, args.repeats, device)
    print(f"GatedDeltaNet(128, 2 heads of 64) {layer['shape']} fwd+bwd: "
          f"{layer['fwd_bwd_ms']:.1f} ms ({layer['tokens_per_s']:,.0f} tokens/s)")
    emit_json({"bench": "layers", "device": str(device), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "cpu": cpu_summary(), "conv": convs,
               "decode": decode, "layer": layer})


if __name__ == "__main__":
    main()
