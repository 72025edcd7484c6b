"""benchmarks/_timing.py, the benchmarks' shared harness: call order, warm-up, untimed calls,
set-up and sync hooks, the summaries and the machine line."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _timing  # noqa: E402


def recorder():
    log = []
    return log, {name: (lambda name=name: log.append(name)) for name in ("a", "b", "c")}


def test_rounds_alternate_the_order():
    log, fns = recorder()
    samples = _timing.side_by_side(fns, 4, warmup=1)
    assert log == list("abc") + list("abc") + list("cba") + list("abc") + list("cba")
    assert {name: len(s) for name, s in samples.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(s.wall >= 0 and s.cpu >= 0 for ss in samples.values() for s in ss)


def test_untimed_first_setup_and_sync():
    log, fns = recorder()
    fns = {k: fns[k] for k in ("a", "b")}
    _timing.side_by_side(fns, 2, warmup=0, untimed_first=True,
                         setup=lambda name: log.append(f"setup {name}"),
                         sync=lambda: log.append("sync"))
    one = ["setup a", "a", "setup a", "sync", "a", "sync"]
    other = ["setup b", "b", "setup b", "sync", "b", "sync"]
    assert log == one + other + other + one


def test_summaries_are_medians_and_minima_in_ms():
    samples = [_timing.Sample(w, c) for w, c in ((0.003, 0.001), (0.001, 0.004), (0.002, 0.002))]
    assert _timing.median_ms(samples) == pytest.approx(2.0)
    assert _timing.median_ms(samples, "cpu") == pytest.approx(2.0)
    assert _timing.best_ms(samples) == pytest.approx(1.0)
    assert _timing.best_ms(samples, "cpu") == pytest.approx(1.0)


def test_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        _timing.side_by_side({"a": lambda: None}, 0)


def test_machine_line_and_json(capsys):
    from rlx_torch.optim.cpu_features import cpu_features

    line = _timing.machine_line()
    assert cpu_features().model in line and "torch" in line and "threads" in line
    _timing.emit_json({"bench": "x", "ms": 1.5})
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"bench": "x",
                                                                            "ms": 1.5}
