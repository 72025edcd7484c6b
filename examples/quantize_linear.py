"""Quantize an nn.Linear with CodebookLinear.from_linear, then fine-tune its codebook.

The layer to compress has a structured weight (low rank plus noise, like trained layers) so
that k-means has something to find, and its inputs are anisotropic (some features much larger
than others, like real activations). k-means minimizes the weight error; fine-tuning trains
the codebook, scales and bias (the uint8 indices stay fixed) to match the original layer's
outputs on such inputs, which k-means alone does not see.

    python examples/quantize_linear.py --num-codebooks 2 --steps 200
"""

import argparse
import time

import torch

from rlx_torch.nn import CodebookLinear


def structured_linear(in_features, out_features, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features)
    with torch.no_grad():
        u = torch.randn(out_features, rank, generator=gen)
        v = torch.randn(rank, in_features, generator=gen)
        weight = u @ v / (rank * in_features) ** 0.5
        weight += 0.3 * torch.randn(out_features, in_features, generator=gen) / in_features**0.5
        linear.weight.copy_(weight)
    return linear


def sample_inputs(batch, in_features, generator=None):
    # Per-feature scales spanning two orders of magnitude.
    feature_scale = torch.logspace(0, -2, in_features)
    return torch.randn(batch, in_features, generator=generator) * feature_scale


def relative_output_error(layer, reference, x):
    with torch.no_grad():
        want = reference(x)
        return float((layer(x) - want).norm() / want.norm())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--in-features", type=int, default=512)
    parser.add_argument("--out-features", type=int, default=512)
    parser.add_argument("--entry-dim", type=int, default=8)
    parser.add_argument("--num-entries", type=int, default=256)
    parser.add_argument("--num-codebooks", type=int, default=1)
    parser.add_argument("--kmeans-iters", type=int, default=25)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    original = structured_linear(args.in_features, args.out_features, rank=32, seed=args.seed)
    start = time.perf_counter()
    layer = CodebookLinear.from_linear(
        original,
        entry_dim=args.entry_dim,
        num_entries=args.num_entries,
        num_codebooks=args.num_codebooks,
        iters=args.kmeans_iters,
    )
    print(layer)
    print(
        f"k-means ({time.perf_counter() - start:.1f} s): relative weight error "
        f"{layer.quantization_error:.4f}"
    )
    x_eval = sample_inputs(256, args.in_features, torch.Generator().manual_seed(args.seed + 1))
    before = relative_output_error(layer, original, x_eval)
    print(f"relative output error after k-means: {before:.4f}")

    params = [p for p in (layer.codebook, layer.scales, layer.bias) if p is not None]
    opt = torch.optim.Adam(params, lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = sample_inputs(args.batch, args.in_features)
        with torch.no_grad():
            target = original(x)
        loss = torch.nn.functional.mse_loss(layer(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps:
            print(f"step {step:4d}  mse {loss.item():.3e}")
    after = relative_output_error(layer, original, x_eval)
    print(f"fine-tuning {args.steps} steps ({time.perf_counter() - start:.1f} s)")
    print(f"relative output error: {before:.4f} after k-means -> {after:.4f} after fine-tuning")
    return before, after


if __name__ == "__main__":
    main()
