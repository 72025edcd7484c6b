"""Fine-tune an AQLM checkpoint's codebooks and scales with Muon, codes fixed (PV-tuning style).

Loads a local AQLM-format checkpoint (transformers + safetensors) as a model on CodebookLinear,
trains only the codebooks (Muon) and the per-row scales (Muon's AdamW side) as a byte-level
language model on the text shipped in rlx_torch/data, reports the held-out loss (nats per byte)
before and after, and saves the result in our format (a safetensors state dict with
CodebookLinear's indices/codebook/scales) and in AQLM's (readable by load_aqlm and by
transformers with the aqlm package). The uint8/int16 codes never change.

Without --checkpoint it writes a tiny random Llama in AQLM's 1x8 format first (vocab 256, one
entry per byte) and fine-tunes that:

    python examples/finetune_aqlm.py --out /tmp/aqlm-ft --steps 200
    python examples/finetune_aqlm.py --checkpoint path/to/aqlm-model --out /tmp/aqlm-ft
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_model

from rlx_torch.data import read_bytes
from rlx_torch.integrations.aqlm import load_aqlm, save_aqlm
from rlx_torch.nn import CodebookLinear
from rlx_torch.optim import Muon, muon_param_groups


def make_tiny_checkpoint(folder: Path, *, seed: int = 0, dtype=torch.float16) -> Path:
    """A tiny byte-level Llama in AQLM's format: every decoder linear 1x8 (one 256-entry
    codebook of 8-dim entries, random codes and codebook), float embeddings, norms and head."""
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers."):
            layer = CodebookLinear(
                module.in_features, module.out_features, module.bias is not None, entry_dim=8
            )
            model.set_submodule(name, layer)
    return save_aqlm(model, folder, dtype=dtype)


def split_tokens(data: bytes, held_out_fraction: float = 0.1):
    """Bytes as tokens; the last ``held_out_fraction`` of the text is held out."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - held_out_fraction))
    return tokens[:cut], tokens[cut:]


def random_windows(tokens, batch_size, seq_len, generator):
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def held_out_loss(model, tokens, seq_len, max_windows=64) -> float:
    """Mean next-byte cross-entropy (nats) over the first ``max_windows`` consecutive windows."""
    n = min((len(tokens) - 1) // seq_len, max_windows)
    inputs = tokens[: n * seq_len].view(n, seq_len)
    targets = tokens[1 : n * seq_len + 1].view(n, seq_len)
    was_training = model.training
    model.eval()
    logits = model(inputs).logits.float()
    model.train(was_training)
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def trainable_codebooks_and_scales(model) -> int:
    """Freezes everything but CodebookLinear codebooks and scales; returns their count."""
    model.requires_grad_(False)
    count = 0
    for layer in model.modules():
        if isinstance(layer, CodebookLinear):
            for p in (layer.codebook, layer.scales):
                if p is not None:
                    p.requires_grad_(True)
                    count += p.numel()
    return count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="AQLM checkpoint folder (default: a tiny random one)")
    parser.add_argument("--out", default="aqlm-finetuned", help="output folder")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (codebooks)")
    parser.add_argument("--scales-lr", type=float, default=3e-3, help="AdamW lr (scales)")
    parser.add_argument(
        "--save-dtype", default="float32", choices=["float32", "float16", "bfloat16"]
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    out = Path(args.out)
    source = Path(args.checkpoint) if args.checkpoint else make_tiny_checkpoint(out / "input")
    model = load_aqlm(source, dtype=torch.float32)
    codes_before = {n: m.indices.clone() for n, m in model.named_modules()
                    if isinstance(m, CodebookLinear)}
    n_trainable = trainable_codebooks_and_scales(model)
    print(f"{source}: {len(codes_before)} CodebookLinear layers, {n_trainable} trainable numbers")

    train, held_out = split_tokens(read_bytes())
    optimizer = Muon(
        params=muon_param_groups(model, lr=args.lr, adamw_lr=args.scales_lr),
        lr=args.lr,
    )
    generator = torch.Generator().manual_seed(args.seed)
    before = held_out_loss(model, held_out, args.seq_len)
    print(f"held-out loss before: {before:.4f} nats/byte ({before / math.log(2):.3f} bits)")
    model.train()
    for step in range(1, args.steps + 1):
        x, y = random_windows(train, args.batch_size, args.seq_len, generator)
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 10) == 0:
            print(f"step {step:5d}  train loss {loss.item():.4f}")
    after = held_out_loss(model, held_out, args.seq_len)
    print(f"held-out loss after:  {after:.4f} nats/byte ({after / math.log(2):.3f} bits)")
    unchanged = all(torch.equal(m.indices, codes_before[n]) for n, m in model.named_modules()
                    if isinstance(m, CodebookLinear))

    out.mkdir(parents=True, exist_ok=True)
    ours = out / "rlx"
    ours.mkdir(exist_ok=True)
    save_model(model, str(ours / "model.safetensors"))  # our format: CodebookLinear tensors
    (ours / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    aqlm_folder = save_aqlm(model, out / "aqlm", dtype=getattr(torch, args.save_dtype))
    reloaded = held_out_loss(load_aqlm(aqlm_folder, dtype=torch.float32), held_out, args.seq_len)
    print(f"saved {ours} and {aqlm_folder}; reloaded from AQLM's format: {reloaded:.4f}")
    return {
        "before": before,
        "after": after,
        "reloaded": reloaded,
        "codes_unchanged": unchanged,
        "rlx": ours,
        "aqlm": aqlm_folder,
    }


if __name__ == "__main__":
    main()
