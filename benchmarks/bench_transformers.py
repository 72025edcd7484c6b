"""A transformers Qwen3-Next-style model on rlx_torch's kernels against transformers' own
plain-PyTorch fallback, side by side in one process (CPU, float32).

    .venv/bin/python benchmarks/bench_transformers.py [--repeats N] [--threads N]

1. Forward + backward (LM loss) of a small random Qwen3-Next (hidden 256, 3 Gated DeltaNet
   layers + 1 attention layer, K = V = 64, dense MLPs), B = 2, T = 512: transformers'
   fallback vs ``rlx_torch.integrations.transformers.enable()``.
2. The gated delta rule alone, forward + backward, B = 1, T = 2048, H = 4, K = V = 128:
   transformers' ``torch_chunk_gated_delta_rule`` vs the function ``enable()`` puts in its
   place.

Both sides are checked to agree first. Timed with benchmarks/_timing.py: the sides take
turns, each first on every other repeat, and every timed call follows an untimed one of the
same side. Prints the CPU (model, ISA features), the times and ratios, then one JSON line.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the in-place build
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_summary, emit_json, median_ms, side_by_side  # noqa: E402
from bench_gdn import timed  # noqa: E402

import rlx_torch.integrations.transformers as rlx_hf  # noqa: E402


def small_qwen3_next():
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    config = Qwen3NextConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_only_layers=[0, 1, 2, 3],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, use_cache=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def free_recurrence(query, key, value, g, beta, **kwargs):
    """Stands in for the gated delta rule at (almost) no cost, gradients still flowing."""
    return value * beta.unsqueeze(-1), None


def free_convolution(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Stands in for the short convolution at (almost) no cost, gradients still flowing."""
    return F.silu(hidden_states * weight[:, -1:])


def zero_cost_kernels():
    """Replaces both kernels by near-free stand-ins: the rest of the step is then all that is
    left, so fallback / this time bounds what any kernel library can reach on this model."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen
    rlx_hf.disable()
    qwen.torch_chunk_gated_delta_rule = free_recurrence
    qwen.causal_conv1d_fn = free_convolution


def time_model(model, ids, repeats):
    """Median ms of forward + backward with the fallback, with our kernels, and with both
    kernels replaced by near-free stand-ins (the ceiling of the model's speed-up), alternating."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen
    originals = qwen.torch_chunk_gated_delta_rule, qwen.causal_conv1d_fn

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    def restore():
        qwen.torch_chunk_gated_delta_rule, qwen.causal_conv1d_fn = originals
        rlx_hf.disable()

    sides = {"fallback": restore, "rlx": lambda: (restore(), rlx_hf.enable(import_families=False)),
             "zero-cost kernels": lambda: (restore(), zero_cost_kernels())}
    samples = side_by_side({name: step for name in sides}, repeats, warmup=0,
                           untimed_first=True, setup=lambda name: sides[name]())
    restore()
    return ([median_ms(samples[name]) for name in sides],
            [median_ms(samples[name], "cpu") for name in sides])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen
    print(f"{cpu_summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"transformers {transformers.__version__}")

    model = small_qwen3_next()
    ids = torch.randint(0, 2048, (2, 512), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rlx_hf.disable()
        ref = model(ids).logits
        rlx_hf.enable()
        diff = (model(ids).logits - ref).abs().max().item()
        rlx_hf.disable()
    assert diff < 1e-4, f"logits differ by {diff}"
    (fb_ms, rlx_ms, free_ms), (fb_cpu, rlx_cpu, free_cpu) = time_model(model, ids, args.repeats)
    model_row = dict(B=2, T=512, hidden=256, gdn_layers=3, attention_layers=1, K=64, V=64,
                     fallback_ms=round(fb_ms, 1), rlx_ms=round(rlx_ms, 1),
                     speedup=round(fb_ms / rlx_ms, 2), zero_cost_kernels_ms=round(free_ms, 1),
                     ceiling=round(fb_ms / free_ms, 2), cpu_ms=[round(fb_cpu, 1), round(rlx_cpu, 1),
                     round(free_cpu, 1)], max_logit_diff=diff)
    print(f"model fwd+bwd  B=2 T=512       fallback {fb_ms:9.1f} ms  rlx {rlx_ms:8.1f} ms  "
          f"speed-up {fb_ms / rlx_ms:5.2f}x  (target >= 4x; logits within {diff:.1e})")
    print(f"  with both kernels near-free {free_ms:8.1f} ms: ceiling of any kernel library "
          f"{fb_ms / free_ms:5.2f}x")
    print(f"  process CPU time: fallback {fb_cpu:.1f} ms, rlx {rlx_cpu:.1f} ms "
          f"({fb_cpu / rlx_cpu:.2f}x), near-free kernels {free_cpu:.1f} ms "
          f"({fb_cpu / free_cpu:.2f}x)")

    fallback = qwen.torch_chunk_gated_delta_rule.__wrapped__
    rlx_hf.enable(import_families=False)
    ours = qwen.torch_chunk_gated_delta_rule
    rlx_hf.disable()
    B, T, H, K, V = 1, 2048, 4, 128, 128
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
              torch.randn(B, T, H, V, generator=gen),
              F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0),
              torch.rand(B, T, H, generator=gen)]
    inputs = [t.requires_grad_() for t in inputs]

    def side(fn):
        return lambda q, k, v, g, beta: fn(q, k, v, g=g, beta=beta,
                                           use_qk_l2norm_in_kernel=True)[0]

    kdiff = (side(ours)(*inputs) - side(fallback)(*inputs)).abs().max().item()
    assert kdiff < 1e-3, f"kernel outputs differ by {kdiff}"
    k_fb, k_rlx = timed([side(fallback), side(ours)], inputs, True, args.repeats)
    kernel_row = dict(B=B, T=T, H=H, K=K, V=V, fallback_ms=round(k_fb, 1),
                      rlx_ms=round(k_rlx, 1), speedup=round(k_fb / k_rlx, 2))
    print(f"kernel fwd+bwd B=1 T=2048 H=4 K=V=128  fallback {k_fb:9.1f} ms  rlx {k_rlx:8.1f} "
          f"ms  speed-up {k_fb / k_rlx:5.2f}x  (target >= 20x)")
    emit_json({"bench": "transformers", "cpu": cpu_summary(),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "transformers": transformers.__version__, "model_fwd_bwd": model_row,
               "gated_delta_rule_fwd_bwd": kernel_row})


if __name__ == "__main__":
    main()
