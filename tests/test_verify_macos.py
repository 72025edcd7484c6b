"""scripts/verify_macos.sh's reporting, run on Linux with stand-ins for macOS's tools: a missing
Metal toolchain is a SKIP that says how to get it, and one failing step hides no other."""

import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_TOOLCHAIN = ("error: cannot execute tool 'metal' due to missing Metal Toolchain; use: "
                "xcodebuild -downloadComponent MetalToolchain")


def _tool(folder, name, body):
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_mac(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    _tool(bin_dir, "uname", 'case "$1" in -s) echo Darwin;; -m) echo arm64;; *) echo Darwin;; esac')
    _tool(bin_dir, "sw_vers", "echo ProductVersion: 15.1")
    _tool(bin_dir, "sysctl", "echo Apple M1")
    # the stand-in Python: records each call; `pytest` of the MPS tests fails when asked to
    py = _tool(bin_dir, "python", f'echo "$*" >> {calls}\n'
               'case "$*" in\n'
               '  -) cat > /dev/null;;\n'
               '  *test_metal_mps_*) echo "1 failed, 9 passed"; [ -z "$FAIL_MPS" ];;\n'
               '  *"-m pytest"*) echo "300 passed";;\n'
               '  *) echo ok;;\n'
               'esac')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(py),
           "RLX_VERIFY_DIR": str(tmp_path / "logs")}
    return bin_dir, calls, env


def _run(env):
    return subprocess.run(["bash", os.path.join(ROOT, "scripts", "verify_macos.sh")], env=env,
                          capture_output=True, text=True, timeout=120)


def test_missing_metal_toolchain_is_a_skip_that_says_how(fake_mac):
    bin_dir, calls, env = fake_mac
    _tool(bin_dir, "xcrun", f'echo "{NO_TOOLCHAIN}" >&2; exit 1')
    result = _run(env)
    assert result.returncode == 0, result.stdout + result.stderr
    skip = [line for line in result.stdout.splitlines() if line.startswith("SKIP  metal_compile")]
    assert skip and "xcodebuild -downloadComponent MetalToolchain" in skip[0]
    assert "FAIL" not in result.stdout
    pytest_calls = [c for c in calls.read_text().splitlines() if "-m pytest" in c]
    assert len(pytest_calls) == 2
    full = [c for c in pytest_calls if "test_metal_mps_" not in c][0]
    assert " -x" not in f" {full} "  # one failure must not hide the rest


def test_a_failing_step_hides_no_other(fake_mac):
    bin_dir, calls, env = fake_mac
    _tool(bin_dir, "xcrun", 'for a; do case "$a" in *.air) : > "$a";; esac; done')
    result = _run({**env, "FAIL_MPS": "1"})
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "PASS  metal_compile" in lines
    assert any(line.startswith("FAIL  mps_tests") for line in lines)
    assert "PASS  full_suite" in lines and "PASS  bench" in lines


def test_a_kernel_that_does_not_compile_fails(fake_mac):
    bin_dir, calls, env = fake_mac
    # the probe compiles, a real kernel does not
    _tool(bin_dir, "xcrun", 'case "$*" in *probe.metal*) exit 0;; *) echo "error: bad" >&2; '
          'exit 1;; esac')
    result = _run(env)
    assert result.returncode == 1
    assert any(line.startswith("FAIL  metal_compile") for line in result.stdout.splitlines())


def test_metal_compile_off_macos_says_so(tmp_path):
    result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "metal_compile.sh"),
                             str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 3 and "only on macOS" in result.stderr
