"""The end-to-end demo: a short run's artifacts and learning, and its command-line errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from rlx_torch import demo

TINY_RUN = ["--steps", "40", "--finetune-steps", "4", "--batch-size", "8", "--seq-len", "32",
            "--hidden-size", "64", "--layers", "1", "--eval-bytes", "2048", "--sample-bytes", "24",
            "--lr", "0.03", "--adam-lr", "0.01", "--eval-every", "10", "--no-progress"]


def test_short_run_writes_artifacts_and_learns(tmp_path, capsys):
    out = tmp_path / "run"
    threads_before = torch.get_num_threads()
    summary = demo.main([*TINY_RUN, "--out", str(out)])
    assert torch.get_num_threads() == threads_before  # restored after the run
    assert 1 <= summary["threads"] <= threads_before
    for name in ("checkpoint.pt", "checkpoint_codebook.pt", "loss_curve.png", "sample.txt",
                 "summary.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "summary.json").read_text()) == summary
    # the loss went down: later batches and the held-out score beat the start
    assert summary["last_train_bpb"] < summary["first_train_bpb"] - 1.0
    assert summary["trained_bpb"] < summary["first_train_bpb"] - 1.0
    assert all(v < 8.5 for k, v in summary.items() if k.endswith("_bpb"))
    assert summary["device"] == demo.pick_device("auto").type  # mps on a Mac, cpu here
    # the checkpoint restores the trained float model
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    model = demo.GDNLanguageModel(demo.GDNConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    assert model.config.hidden_size == 64 and len(model.blocks) == 1
    text = (out / "sample.txt").read_text()
    assert text.startswith(demo.PROMPT) and len(text.encode()) >= len(demo.PROMPT)
    printed = capsys.readouterr().out
    assert "unigram baseline" in printed and "bits per byte" in printed
    assert json.loads(printed.strip().splitlines()[-1]) == summary


def test_unigram_baseline_and_scoring_helpers():
    train = torch.tensor([0, 0, 1, 1])
    held_out = torch.tensor([0, 1])
    counts = torch.ones(256)
    counts[0] += 2
    counts[1] += 2
    expected = -(counts / counts.sum())[[0, 1]].log2().mean().item()
    assert demo.unigram_bits_per_byte(train, held_out) == pytest.approx(expected)
    train_part, held = demo.split_corpus(bytes(range(100)))
    assert len(train_part) == 90 and held.tolist() == list(range(90, 100))
    assert demo.lr_factor(0, 100, 10) == pytest.approx(0.1)
    assert demo.lr_factor(10, 100, 10) == pytest.approx(1.0)
    assert demo.lr_factor(100, 100, 10) == pytest.approx(0.1)


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "must be a positive integer"),
    (["--steps", "ten"], "--steps: must be a positive integer, got 'ten'"),
    (["--device", "tpu"], "invalid choice"),
    (["--lr", "-1"], "must be a positive number"),
    (["--finetune-steps", "-2"], "must be an integer >= 0"),
    (["--bogus"], "unrecognized arguments"),
    (["--entry-dim", "7"], "--entry-dim 7 must divide the MLP input widths 128 and 352"),
])
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_unwritable_out_fails_before_training(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")

    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(demo, "train", no_training)
    with pytest.raises(SystemExit) as exc:
        demo.main(["--out", str(blocker / "sub")])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_missing_demo_extras_are_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    with pytest.raises(SystemExit) as exc:
        demo.main(["--out", str(tmp_path)])
    assert "tqdm" in str(exc.value.code) and "pip install" in str(exc.value.code)


def test_module_entry_point_help():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for module in ("rlx_torch.demo", "rlx_torch"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                                text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "--steps" in result.stdout and "--out" in result.stdout


def test_device_choice(monkeypatch):
    assert demo.pick_device("auto").type in ("cpu", "cuda", "mps")
    assert demo.pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: CUDA is not available"):
            demo.pick_device("cuda")
    # a Mac: auto picks mps when torch has it and this build has MPS kernels, else cpu
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "_has_native_kernels", lambda key: key == "MPS")
    assert demo.pick_device("auto") == torch.device("mps")
    monkeypatch.setattr(demo, "_has_native_kernels", lambda key: False)
    assert demo.pick_device("auto") == torch.device("cpu")
    with pytest.raises(SystemExit, match="no MPS kernels"):
        demo.pick_device("mps")


def test_thread_choice(monkeypatch):
    assert demo.pick_threads(3) == 3
    default = torch.get_num_threads()
    assert 1 <= demo.pick_threads(None) <= default
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    assert demo.pick_threads(None) == 1  # a saturated machine: one thread
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert demo.pick_threads(None) == min(default, cores)
    # macOS: no sched_getaffinity, and the load average still counts
    monkeypatch.delattr(demo.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.7, 0.0, 0.0))
    assert demo.pick_threads(None) == 1
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert demo.pick_threads(None) == min(default, 2)


def test_corpus_is_shipped_with_attribution():
    from rlx_torch.data import DEMO_CORPUS, read_bytes

    text = read_bytes(DEMO_CORPUS)
    assert 100_000 < len(text) < 400_000 and text.isascii()
    assert text.startswith(b"THE FIRST BOOK OF MOSES, CALLED GENESIS")
    notice = read_bytes("README.txt").decode()
    assert "public domain" in notice and "bible-kjv-text" in notice
