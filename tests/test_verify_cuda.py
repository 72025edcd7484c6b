"""scripts/verify_cuda.sh's steps and reporting, run on a machine without a GPU against a
stand-in Python: it stops with a clear message where torch has no CUDA device; each of fla's
comparisons runs alone in its own process without pytest-xdist; a missing fla is a SKIP that
says how to get it; and one failing step hides no other."""

import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLA_CASES = ("False-False", "False-True", "True-False", "True-True")


@pytest.fixture
def fake_python(tmp_path):
    """A stand-in Python that records each call: CUDA present unless NO_CUDA, fla importable
    unless NO_FLA, no pytest-xdist, and fla's per-channel comparison on the chunked path fails
    when FAIL_FLA is set."""
    calls = tmp_path / "calls"
    py = tmp_path / "python"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$* PYTHONPATH=$PYTHONPATH" >> {calls}\n'
        'case "$*" in\n'
        '  -) cat > /dev/null; [ -z "$NO_CUDA" ];;\n'
        '  "-c import xdist") exit 1;;\n'
        '  "-c import fla.ops.gated_delta_rule") [ -z "$NO_FLA" ];;\n'
        '  *"test_matches_fla[True-True]"*) echo "1 passed"; [ -z "$FAIL_FLA" ];;\n'
        '  *"-m pytest"*) echo "12 passed";;\n'
        '  *) echo ok;;\n'
        'esac\n')
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PYTHON": str(py), "RLX_VERIFY_DIR": str(tmp_path / "logs")}
    for name in ("NO_CUDA", "NO_FLA", "FAIL_FLA"):
        env.pop(name, None)
    return calls, env


def _run(env):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "verify_cuda.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


def _pytest_calls(calls):
    return [c for c in calls.read_text().splitlines() if "-m pytest" in c]


def test_each_fla_comparison_runs_alone_without_xdist(fake_python):
    calls, env = fake_python
    result = _run(env)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = _pytest_calls(calls)
    bulk = [c for c in runs if "not matches_fla" in c]
    assert len(bulk) == 1 and " -x" not in f" {bulk[0]} " and " -n " not in f" {bulk[0]} "
    for case in FLA_CASES:
        alone = [c for c in runs if f"test_matches_fla[{case}]" in c]
        assert len(alone) == 1 and "-p no:xdist" in alone[0], (case, runs)
    assert len(runs) == 1 + len(FLA_CASES)
    benches = [c for c in calls.read_text().splitlines() if "benchmarks/" in c]
    assert any("--gate head" in c for c in benches) and any("--gate channel" in c
                                                           for c in benches)
    assert "FAIL" not in result.stdout and "SKIP" not in result.stdout


def test_one_failure_hides_no_other_step(fake_python):
    calls, env = fake_python
    result = _run({**env, "FAIL_FLA": "1"})
    assert result.returncode == 1
    assert "FAIL  fla_True-True" in result.stdout
    for step in ("build", "cuda_tests", "fla_False-False", "bench_codebook", "bench_gdn_head",
                 "bench_gdn_channel"):
        assert f"PASS  {step}" in result.stdout, (step, result.stdout)


def test_missing_fla_is_a_skip_that_says_how(fake_python):
    calls, env = fake_python
    result = _run({**env, "NO_FLA": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    skip = [line for line in result.stdout.splitlines() if line.startswith("SKIP  fla")]
    assert skip and "pip install fla-core" in skip[0]
    assert not any("matches_fla[" in c for c in _pytest_calls(calls))


def test_no_cuda_device_stops_before_building(fake_python):
    calls, env = fake_python
    result = _run({**env, "NO_CUDA": "1"})
    assert result.returncode == 2
    assert "no usable CUDA device" in result.stderr
    assert not any("setup.py" in c for c in calls.read_text().splitlines())


def test_the_callers_pythonpath_follows_the_tree(fake_python):
    """fla or pytest-xdist installed with pip --target stays importable in every step."""
    calls, env = fake_python
    env["PYTHONPATH"] = "/opt/fla-site"
    result = _run(env)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [c for c in calls.read_text().splitlines() if "-m pytest" in c or "bench" in c]
    assert runs
    for call in runs:
        assert call.endswith(" PYTHONPATH=.:/opt/fla-site"), call
