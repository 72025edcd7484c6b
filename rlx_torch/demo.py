"""End-to-end demo: train a byte-level Gated DeltaNet language model with Muon, quantize its MLPs
to codebooks, fine-tune the codebooks, and sample by incremental decoding.

    python -m rlx_torch.demo [--steps N] [--device auto|cpu|mps|cuda] [--out DIR] ...

Writes DIR/checkpoint.pt (float model), DIR/checkpoint_codebook.pt (quantized, fine-tuned),
DIR/loss_curve.png, DIR/sample.txt and DIR/summary.json.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from .data import DEMO_CORPUS, read_bytes
from .models import GDNConfig, GDNLanguageModel

__all__ = ["main"]

LN2 = math.log(2.0)
PROMPT = "And God said"


# ---------------------------------------------------------------- command line
def _number(text: str, kind, ok, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _non_negative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0 and math.isfinite(v), "a positive number")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlx_torch.demo",
        description="Train a byte-level Gated DeltaNet LM with Muon, quantize its MLPs to "
        "codebooks, fine-tune them, and sample text.",
    )
    p.add_argument("--steps", type=_positive_int, default=300, help="training steps (300)")
    p.add_argument("--finetune-steps", type=_non_negative_int, default=None,
                   help="codebook fine-tuning steps (default: steps // 5)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "mps", "cuda"],
                   help="auto picks mps, then cuda, then cpu")
    p.add_argument("--out", default="rlx_demo_out", help="output folder (rlx_demo_out)")
    p.add_argument("--batch-size", type=_positive_int, default=16)
    p.add_argument("--seq-len", type=_positive_int, default=128)
    p.add_argument("--hidden-size", type=_positive_int, default=128)
    p.add_argument("--layers", type=_positive_int, default=2)
    p.add_argument("--lr", type=_positive_float, default=0.02, help="Muon learning rate")
    p.add_argument("--adam-lr", type=_positive_float, default=3e-3,
                   help="learning rate of the AdamW side (embeddings, norms, gates)")
    p.add_argument("--codebooks", type=_positive_int, default=2,
                   help="additive codebooks per MLP linear (2: 2 bits per weight with 8-dim "
                   "entries, AQLM's 2x8)")
    p.add_argument("--entry-dim", type=_positive_int, default=8,
                   help="input weights per codebook entry (8)")
    p.add_argument("--eval-bytes", type=_positive_int, default=16384,
                   help="held-out bytes scored for bits per byte")
    p.add_argument("--eval-every", type=_non_negative_int, default=None,
                   help="held-out scoring interval in steps (default: steps // 10; 0: never)")
    p.add_argument("--sample-bytes", type=_non_negative_int, default=300)
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU threads (default: the cores other processes leave idle, judged "
                   "by the load average; at most torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def _require_demo_extras():
    missing = []
    for name in ("tqdm", "matplotlib"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        sys.exit(
            f"rlx_torch.demo needs {' and '.join(missing)} (the 'demo' extra). Install with:\n"
            f"    pip install {' '.join(missing)}      (or: pip install 'rlx-torch[demo]')"
        )


def _check_out_dir(parser: argparse.ArgumentParser, out: str) -> None:
    """Fail before training, not after it, when results could not be saved."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_test"):
            pass
    except OSError as e:
        parser.error(f"--out {out!r} is not a writable folder ({e.strerror or e})")


_NATIVE_OPS = ("rlx::gated_delta_fwd", "rlx::codebook_matmul")


def _has_native_kernels(dispatch_key: str) -> bool:
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)
               for op in _NATIVE_OPS)


def pick_device(choice: str) -> torch.device:
    """``auto``: MPS, then CUDA, then CPU, skipping a device this build of rlx_torch has no
    kernels for (e.g. CUDA before its kernels exist)."""
    mps_ok = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    available = {"mps": mps_ok, "cuda": torch.cuda.is_available(), "cpu": True}
    if choice == "auto":
        for name in ("mps", "cuda"):
            if available[name] and _has_native_kernels(name.upper()):
                return torch.device(name)
        return torch.device("cpu")
    if not available[choice]:
        raise SystemExit(f"--device {choice}: {choice.upper()} is not available on this machine")
    if not _has_native_kernels(choice.upper()):
        raise SystemExit(f"--device {choice}: this build of rlx_torch has no {choice.upper()} "
                         "kernels (use --device cpu)")
    return torch.device(choice)


def pick_threads(requested: int | None) -> int:
    """Intra-op threads for CPU work. On a busy machine, threads that wait for a descheduled
    peer at every one of the thousands of small ops per step make training several times
    slower than one thread (docs/benchmarks.md, "Figures behind code choices"), so by default
    only the cores that the 1-minute load average leaves idle are used."""
    if requested is not None:
        return requested
    default = torch.get_num_threads()
    try:
        # macOS has no sched_getaffinity: every core is available there
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        idle = cores - os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return default
    return max(1, min(default, math.floor(idle + 0.5)))


# ---------------------------------------------------------------- data and scoring
def split_corpus(data: bytes, held_out_fraction: float = 0.1):
    """The last ``held_out_fraction`` of the text (whole chapters late in the book) is held out."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(tokens) * (1 - held_out_fraction))
    return tokens[:cut], tokens[cut:]


def unigram_bits_per_byte(train: torch.Tensor, held_out: torch.Tensor) -> float:
    """Cross-entropy of the held-out bytes under the training byte frequencies (add-one)."""
    counts = torch.bincount(train, minlength=256).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[held_out].mean() / LN2)


def random_batch(tokens, batch_size, seq_len, generator, device):
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).to(device)
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def bits_per_byte(model, tokens, seq_len, batch_size, device) -> float:
    """Mean next-byte cross-entropy (bits) over consecutive windows of ``tokens``; every window
    starts from an empty state, exactly like training."""
    was_training = model.training
    model.eval()
    n_windows = (len(tokens) - 1) // seq_len
    usable = tokens[: n_windows * seq_len + 1]
    inputs = usable[:-1].view(n_windows, seq_len)
    targets = usable[1:].view(n_windows, seq_len)
    total = 0.0
    for i in range(0, n_windows, batch_size):
        x, y = inputs[i:i + batch_size].to(device), targets[i:i + batch_size].to(device)
        logits = model(x).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum"))
    model.train(was_training)
    return total / targets.numel() / LN2


# ---------------------------------------------------------------- optimization
def make_optimizer(model, lr, adam_lr):
    """Muon for the hidden matrices of the parameters that require grad; AdamW for embeddings,
    the head, norms, gate vectors and the depthwise conv filters (tiny [D, 1, W] kernels that
    are per-channel filters, not matrices)."""
    from .optim import Muon, muon_param_groups

    return Muon(muon_param_groups(model, lr=lr, adamw_lr=adam_lr, adamw_names=[r"conv1d"]))


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(model, optimizer, tokens, steps, args, device, generator, desc, curves, score):
    """``steps`` Muon steps on random windows; appends each batch's bits per byte to
    ``curves["batches"]`` and, every ``args.eval_every`` steps, ``(step, score())`` to
    ``curves["held_out"]``. Returns the seconds spent training (scoring excluded)."""
    from tqdm import tqdm

    base_lrs = [group["lr"] for group in optimizer.param_groups]
    warmup = max(1, steps // 20)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(steps), desc=desc, unit="step", disable=args.no_progress, dynamic_ncols=True)
    model.train()
    busy = 0.0
    for step in bar:
        started = time.perf_counter()
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * lr_factor(step, steps, warmup)
        x, y = random_batch(tokens, args.batch_size, args.seq_len, generator, device)
        logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bits = loss.item() / LN2
        busy += time.perf_counter() - started
        curves["batches"].append(bits)
        rate = (step + 1) * tokens_per_step / busy
        postfix = {"loss_bpb": f"{bits:.3f}", "tok_s": f"{rate:,.0f}"}
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < steps:
            curves["held_out"].append((len(curves["batches"]) - 1, score()))
            model.train()
        if curves["held_out"]:
            postfix["held_out_bpb"] = f"{curves['held_out'][-1][1]:.3f}"
        bar.set_postfix(postfix)
    bar.close()
    return busy


# ---------------------------------------------------------------- artifacts
def save_loss_curve(path, curves, phase_starts, marks, baseline):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    batches = curves["batches"]
    bounds = [*phase_starts.values(), len(batches)]
    for (label, start), stop in zip(phase_starts.items(), bounds[1:], strict=True):
        if stop > start:
            ax.plot(range(start, stop), batches[start:stop], lw=0.8, label=f"{label} batches")
    if curves["held_out"]:
        steps, values = zip(*curves["held_out"], strict=True)
        ax.plot(steps, values, "o-", ms=3, lw=1, color="black", label="held-out")
    for label, (step, value) in marks.items():
        ax.scatter([step], [value], zorder=3, s=40, label=f"held-out, {label}: {value:.3f}")
    ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline: {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title("rlx_torch demo: byte-level Gated DeltaNet LM, Muon, codebook MLPs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sample_text(model, device, n_bytes, seed) -> str:
    prompt = torch.tensor([list(PROMPT.encode())], device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    new = model.generate(prompt, n_bytes, temperature=0.8, top_k=20, generator=generator)
    return (PROMPT.encode() + bytes(new[0].tolist())).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    """Runs the demo with the command-line arguments ``argv`` (default: ``sys.argv[1:]``) and
    returns the summary it writes to ``summary.json``.

    Example::

        >>> summary = main(["--steps", "20", "--out", "/tmp/rlx_demo"])  # doctest: +SKIP
        >>> summary["trained_bpb"] < summary["unigram_bpb"]  # doctest: +SKIP
        True
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    config = GDNConfig(hidden_size=args.hidden_size, num_layers=args.layers,
                       num_heads=max(1, args.hidden_size // 64), head_dim=64)
    for width in (config.hidden_size, config.mlp_width()):
        if width % args.entry_dim:
            parser.error(f"--entry-dim {args.entry_dim} must divide the MLP input widths "
                         f"{config.hidden_size} and {config.mlp_width()}")
    _require_demo_extras()
    _check_out_dir(parser, args.out)
    device = pick_device(args.device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(pick_threads(args.threads))
    try:
        return run(parser, args, config, device)
    finally:
        torch.set_num_threads(previous_threads)  # main() may be called in-process (tests)


def run(parser, args, config, device) -> dict:
    finetune_steps = args.steps // 5 if args.finetune_steps is None else args.finetune_steps
    if args.eval_every is None:
        args.eval_every = args.steps // 10
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()

    train_tokens, held_out = split_corpus(read_bytes(DEMO_CORPUS))
    held_out = held_out[: args.eval_bytes + 1]
    if len(train_tokens) <= args.seq_len + 1 or len(held_out) <= args.seq_len + 1:
        parser.error(f"--seq-len {args.seq_len} is too long for the corpus")
    baseline = unigram_bits_per_byte(train_tokens, held_out)
    model = GDNLanguageModel(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    threads = torch.get_num_threads()
    print(f"rlx_torch demo on {device} ({threads} CPU thread{'s' * (threads > 1)}): {DEMO_CORPUS} "
          f"({len(train_tokens):,} training bytes, {len(held_out) - 1:,} held out), "
          f"{n_params / 1e3:.0f}k parameters")
    print(f"unigram baseline: {baseline:.3f} bits per byte")

    def score():
        return bits_per_byte(model, held_out, args.seq_len, args.batch_size, device)

    def save(name):
        torch.save({"config": asdict(config), "model": model.state_dict(), "args": vars(args)},
                   os.path.join(args.out, name))

    curves, marks = {"batches": [], "held_out": []}, {}
    phase_starts = {"training": 0}
    optimizer = make_optimizer(model, args.lr, args.adam_lr)
    train_s = train(model, optimizer, train_tokens, args.steps, args, device, generator,
                    "train", curves, score)
    bpb_trained = score()
    marks["trained"] = (args.steps - 1, bpb_trained)
    curves["held_out"].append(marks["trained"])
    print(f"held-out: {bpb_trained:.3f} bits per byte after {args.steps} steps "
          f"({train_s:.0f} s of training; unigram {baseline:.3f})")
    save("checkpoint.pt")

    quantize_started = time.perf_counter()
    model.quantize_mlp(num_codebooks=args.codebooks, entry_dim=args.entry_dim)
    quantize_s = time.perf_counter() - quantize_started
    bpb_quantized = score()
    marks["codebook MLPs"] = (args.steps - 1, bpb_quantized)
    curves["held_out"].append(marks["codebook MLPs"])
    linear = model.blocks[0].mlp.gate_proj
    print(f"quantized the MLP linears to {linear.bits_per_weight:g} bits per weight "
          f"({args.codebooks} codebook(s) of 256 entries of {args.entry_dim}) in "
          f"{quantize_s:.0f} s: held-out {bpb_quantized:.3f} bits per byte")
    # Fine-tune only the codebooks and scales (the uint8 indices stay fixed).
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name in model.mlp_linears():
        for p in getattr(parent, name).parameters():
            p.requires_grad_(True)
    finetune_s = 0.0
    if finetune_steps:
        phase_starts["codebook fine-tuning"] = args.steps
        ft_optimizer = make_optimizer(model, args.lr / 4, args.adam_lr / 4)
        finetune_s = train(model, ft_optimizer, train_tokens, finetune_steps, args, device,
                           generator, "fine-tune codebooks", curves, score)
    bpb_finetuned = score()
    marks["codebooks fine-tuned"] = (args.steps + finetune_steps - 1, bpb_finetuned)
    curves["held_out"].append(marks["codebooks fine-tuned"])
    print(f"held-out bits per byte: float {bpb_trained:.3f} -> codebook MLPs {bpb_quantized:.3f}"
          f" -> after {finetune_steps} codebook fine-tuning steps {bpb_finetuned:.3f}")
    save("checkpoint_codebook.pt")
    save_loss_curve(os.path.join(args.out, "loss_curve.png"), curves, phase_starts, marks,
                    baseline)

    text = sample_text(model, device, args.sample_bytes, args.seed)
    with open(os.path.join(args.out, "sample.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    print("sample (incremental decoding, temperature 0.8, top-20):\n" + "-" * 60)
    print(text)
    print("-" * 60)
    summary = {
        "device": str(device), "threads": torch.get_num_threads(), "steps": args.steps,
        "finetune_steps": finetune_steps,
        "unigram_bpb": round(baseline, 4), "trained_bpb": round(bpb_trained, 4),
        "quantized_bpb": round(bpb_quantized, 4), "finetuned_bpb": round(bpb_finetuned, 4),
        "first_train_bpb": round(curves["batches"][0], 4),
        "last_train_bpb": round(curves["batches"][args.steps - 1], 4),
        "bits_per_weight": linear.bits_per_weight, "train_seconds": round(train_s, 1),
        "finetune_seconds": round(finetune_s, 1), "quantize_seconds": round(quantize_s, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {args.out}/: checkpoint.pt, checkpoint_codebook.pt, loss_curve.png, "
          f"sample.txt, summary.json ({summary['total_seconds']:.0f} s in all)")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
