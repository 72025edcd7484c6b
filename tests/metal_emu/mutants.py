"""Barrier mutants: removes each barrier of a .metal file in turn and runs tests against the
mutant. A mutant that survives (the tests still pass) is a barrier the tests do not prove
necessary: either it is not needed, or the tests miss the race it prevents.

    python -m tests.metal_emu.mutants csrc/mps/kernels/codebook.metal \\
        tests/test_metal_codebook_emulator.py [more pytest arguments]

The tests must load the file with `tests.metal_emu.load(path)`; while a mutant runs, that call
returns the mutant instead (see mutant_plugin.py). Slow (one pytest run per barrier): a tool
for kernel authors, not part of the test suite.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from . import BUILD, REPO
from .translate import blank_comments

BARRIER = re.compile(r"\b(?:threadgroup|simdgroup)_barrier\s*\([^;]*\)\s*;")


def barrier_mutants(text):
    """[(line, text without that barrier)] for every barrier call outside comments."""
    code = blank_comments(text)
    return [(code.count("\n", 0, m.start()) + 1, text[: m.start()] + text[m.end() :])
            for m in BARRIER.finditer(code)]


def resolve(path):
    p = Path(path)
    return (p if p.is_absolute() else REPO / p).resolve()


def run(metal, pytest_args, out=sys.stdout):
    """Runs pytest_args once per mutant; returns {line: "killed" | "survived" | "error (rc)"}."""
    target = resolve(metal)
    folder = BUILD / "mutants"
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for line, text in barrier_mutants(target.read_text()):
        mutant = folder / f"{target.stem}_line{line}.metal"
        mutant.write_text(text)
        env = dict(os.environ, RLX_EMU_MUTANT_TARGET=str(target), RLX_EMU_MUTANT_FILE=str(mutant),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "tests.metal_emu.mutant_plugin",
             *pytest_args], cwd=REPO, env=env, capture_output=True, text=True)
        verdict = {0: "survived", 1: "killed"}.get(proc.returncode, f"error ({proc.returncode})")
        results[line] = verdict
        tail = [s for s in proc.stdout.splitlines() if s.strip()][-1:] or [""]
        print(f"{target.relative_to(REPO) if target.is_relative_to(REPO) else target}:{line}: "
              f"barrier removed -> {verdict} | {tail[0]}", file=out, flush=True)
    return results


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = run(argv[0], argv[1:])
    return 0 if all(v == "killed" for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
