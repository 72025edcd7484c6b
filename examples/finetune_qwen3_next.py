"""Fine-tune a transformers Qwen3-Next on rlx_torch's kernels with Muon.

By default the model is a tiny random Qwen3-Next built from a config (no download) and reads
the text shipped in ``rlx_torch/data`` byte by byte. ``--model DIR`` fine-tunes a checkpoint
you have locally instead (any gated-delta family transformers has: Qwen3-Next, Qwen3.5,
Kimi-Linear, ...), with its own tokenizer.

    python examples/finetune_qwen3_next.py --steps 200
    python examples/finetune_qwen3_next.py --model ~/models/Qwen3-Next-tiny --steps 50

``rlx_torch.integrations.transformers.enable()`` routes the model's gated delta rule and short
convolutions to rlx_torch; ``muon_param_groups`` gives the hidden matrices to Muon and the
embeddings, head, norms and gate parameters to its AdamW side.
"""

import argparse
import math
import time

import torch

import rlx_torch.integrations.transformers as rlx_hf
from rlx_torch.data import read_bytes
from rlx_torch.optim import Muon, muon_param_groups


def tiny_qwen3_next(vocab_size: int, hidden_size: int, layers: int):
    """A random Qwen3-Next: Gated DeltaNet layers with one attention layer every fourth."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    config = Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)],
        mlp_only_layers=list(range(layers)), num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden_size // 2, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=hidden_size // 4, linear_value_head_dim=hidden_size // 4,
        use_cache=False, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


def load(args):
    """(model, token ids of the shipped text)."""
    text = read_bytes()
    if args.model is None:
        return tiny_qwen3_next(256, args.hidden_size, args.layers), torch.tensor(list(text))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                 dtype=torch.float32)
    ids = tokenizer(text.decode("utf-8", errors="replace"), return_tensors="pt").input_ids[0]
    return model, ids


def main(argv=None) -> dict:
    """Trains for ``--steps`` steps; returns the first and last training losses.

    Example::

        >>> result = main(["--steps", "2", "--seq-len", "32", "--no-progress"])
        >>> sorted(result)
        ['first_loss', 'last_loss', 'patched', 'steps', 'tokens_per_s']
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a local checkpoint folder (default: a tiny "
                   "random Qwen3-Next)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    patched = rlx_hf.enable()
    try:
        model, ids = load(args)
        model.train()
        optimizer = Muon(muon_param_groups(model, lr=args.lr, adamw_lr=args.adamw_lr),
                         lr=args.lr, momentum=0.95)
        gen = torch.Generator().manual_seed(args.seed)
        from tqdm import tqdm
        bar = tqdm(range(args.steps), unit="step", disable=args.no_progress,
                   dynamic_ncols=True)
        losses, start = [], time.perf_counter()
        for _ in bar:
            offsets = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch_size,),
                                    generator=gen)
            batch = torch.stack([ids[o:o + args.seq_len] for o in offsets.tolist()])
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elapsed = time.perf_counter() - start
    finally:
        rlx_hf.disable()
    tokens_per_s = args.steps * args.batch_size * args.seq_len / max(elapsed, 1e-9)
    if args.model is None:  # bytes: report bits per byte too
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} nats/token "
              f"({losses[-1] / math.log(2):.3f} bits/byte), {tokens_per_s:.0f} tokens/s")
    else:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {tokens_per_s:.0f} tokens/s")
    return dict(first_loss=losses[0], last_loss=losses[-1], patched=patched, steps=args.steps,
                tokens_per_s=tokens_per_s)


if __name__ == "__main__":
    main()
