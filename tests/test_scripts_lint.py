"""The shell scripts stay portable to macOS (tools/lint_scripts.py), and the lint can fail."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import lint_scripts  # noqa: E402
import with_lock  # noqa: E402


def test_every_script_passes():
    files = lint_scripts.checked_files()
    assert os.path.join(ROOT, "scripts", "build_dev.sh") in files
    assert os.path.join(ROOT, ".github", "workflows", "macos.yml") in files
    problems = [p for f in files for p in lint_scripts.lint_text(f, open(f).read())]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line,word", [
    ("flock build/x.lock make", "flock"),
    ("exec flock build/lock cmd", "flock"),
    ("JOBS=$(nproc)", "nproc"),
    ('HERE=$(readlink -f "$0")', "readlink"),
    ("ROOT=$(realpath ..)", "realpath"),
    ("sed -i 's/a/b/' f", "sed -i"),
    ("sed -E -i.bak 's/a/b/' f", "sed -i"),
    ("grep -oP '\\d+' f", "grep -P"),
    ("date -d yesterday", "date -d"),
    ("stat -c %s f", "stat -c"),
    ("timeout 60 make", "timeout"),
    ("ls | xargs -r rm", "xargs -r"),
    ("sha256sum f", "shasum"),
    ("tac log", "tac"),
    ("find . -printf '%p'", "find -printf"),
    ("base64 -w0 f", "base64 -w"),
    ("head -n -1 f", "negative count"),
    ("mapfile -t lines < f", "bash 4"),
    ("declare -A seen=()", "bash 4"),
    ('echo "${name,,}"', "bash 4"),
    ("make |& tee log", "bash 4"),
    ("rm -rf /tmp/rlx_wheel_venv", "/tmp"),
])
def test_each_rule_rejects_its_command(line, word):
    problems = lint_scripts.lint_text("scripts/x.sh", f"#!/usr/bin/env bash\n{line}\n")
    assert len(problems) == 1 and word in problems[0] and ":2:" in problems[0], problems


@pytest.mark.parametrize("text", [
    "if command -v nproc >/dev/null; then n=$(nproc); else n=2; fi\n",
    "# flock and nproc in a comment\n",
    'echo "ok"  # flock here is a comment\n',
    "python - <<'PY'\nimport subprocess; subprocess.run(['timeout', '1'])  # /tmp/x\nPY\n",
    "sed -e 's/a/b/' f > f.new && mv f.new f\n",
    'LOG="$TMPDIR/x"; mktemp -d\n',
    "n=$(getconf _NPROCESSORS_ONLN)\n",
])
def test_portable_or_guarded_uses_pass(text):
    assert lint_scripts.lint_text("scripts/x.sh", "#!/usr/bin/env bash\n" + text) == []


def test_linux_only_scripts_must_exit_elsewhere_first():
    marked = "#!/usr/bin/env bash\n# lint-scripts: linux-only\n"
    guard = '[ "$(uname -s)" = Linux ] || exit 0\n'
    assert lint_scripts.lint_text("scripts/x.sh", marked + guard + "n=$(nproc)\n") == []
    # the use before the uname test, or no test at all, is rejected
    assert lint_scripts.lint_text("scripts/x.sh", marked + "n=$(nproc)\n" + guard)
    assert lint_scripts.lint_text("scripts/x.sh", marked + "echo hi\n")
    # even there, no machine-wide /tmp paths
    assert lint_scripts.lint_text("scripts/x.sh", marked + guard + "cd /tmp/rlx\n")


def test_workflow_run_steps_are_checked():
    yml = ("jobs:\n  j:\n    steps:\n      - run: nproc\n      - name: x\n        run: |\n"
           "          echo ok\n          flock f cmd\n      - uses: a/b@v1\n        with:\n"
           "          nproc: 1\n")
    problems = lint_scripts.lint_text(".github/workflows/x.yml", yml)
    assert len(problems) == 2, problems
    assert ":4:" in problems[0] and "nproc" in problems[0]
    assert ":8:" in problems[1] and "flock" in problems[1]


def test_scripts_parse_as_bash():
    bash = shutil.which("bash")
    for path in lint_scripts.checked_files():
        if path.endswith(".yml"):
            continue
        result = subprocess.run([bash, "-n", path], capture_output=True, text=True)
        assert result.returncode == 0, (path, result.stderr)


def test_with_lock_serializes_and_runs_the_command(tmp_path):
    lock = tmp_path / "sub" / "build.lock"
    log = tmp_path / "log"
    # two holders in a row append start/end pairs that never interleave
    script = (f"echo start >> {log}; sleep 0.3; echo end >> {log}")
    procs = [subprocess.Popen([sys.executable, with_lock.__file__, str(lock), "sh", "-c", script])
             for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert log.read_text().split() == ["start", "end", "start", "end"]
    status = subprocess.run([sys.executable, with_lock.__file__, str(lock), "sh", "-c", "exit 3"])
    assert status.returncode == 3  # the command's own status
    assert with_lock.main([]) == 2
