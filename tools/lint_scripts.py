"""Lint: the shell scripts must run on macOS too (bash 3.2, BSD tools), so GNU-only commands
and bash-4 features are rejected unless guarded, and no script may use a machine-wide fixed
path that two checkouts would share.

Checked: scripts/*.sh, .ci/run and the `run:` steps of .github/workflows/*.yml. A use passes
when the same line guards it with `command -v TOOL` (for example
`if command -v nproc >/dev/null; then ...`), or when the file is marked Linux-only with a line
`# lint-scripts: linux-only` and exits early elsewhere (a `uname` test before the first use).
Heredoc bodies (Python, for instance) are not shell and are skipped.

    python tools/lint_scripts.py            # exits 1 and lists each problem
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINUX_ONLY = "# lint-scripts: linux-only"

# (tool named by `command -v`, pattern, why and what to use instead)
RULES = [
    ("flock", r"\bflock\b", "flock is not on macOS: use tools/with_lock.py"),
    ("nproc", r"\bnproc\b",
     "nproc is not on macOS: use getconf _NPROCESSORS_ONLN or python's os.cpu_count()"),
    ("readlink", r"\breadlink\s+-\w*f",
     "readlink -f is GNU-only (macOS < 12.3): use $(cd DIR && pwd)"),
    ("realpath", r"\brealpath\b", "realpath is missing on macOS < 13: use $(cd DIR && pwd)"),
    ("sed", r"\bsed\b[^|;&]*\s(-\w*i\b|--in-place)",
     "sed -i takes a suffix argument on macOS: write to a temporary file and mv it"),
    ("grep", r"\bgrep\b[^|;&]*\s(-\w*P|--perl-regexp)", "grep -P is GNU-only: use grep -E"),
    ("date", r"\bdate\b[^|;&]*\s(-d|--date)\b", "date -d is GNU-only"),
    ("stat", r"\bstat\b[^|;&]*\s(-c|--format|--printf)\b", "stat -c is GNU-only (BSD: stat -f)"),
    ("timeout", r"(^|[;&|(]|\bthen|\bdo|\bexec)\s*timeout\s",
     "timeout is not on macOS (GNU coreutils)"),
    ("xargs", r"\bxargs\b[^|;&]*\s(-\w*r\b|--no-run-if-empty)", "xargs -r is GNU-only"),
    ("sha256sum", r"\b(sha256sum|sha1sum|md5sum)\b",
     "not on macOS: use shasum -a 256 (or python -m hashlib)"),
    ("tac", r"(^|[;&|(]|\bthen|\bdo)\s*tac\b", "tac is not on macOS: use tail -r or python"),
    ("find", r"\bfind\b[^|;&]*\s-printf\b", "find -printf is GNU-only"),
    ("base64", r"\bbase64\b[^|;&]*\s-w", "base64 -w is GNU-only"),
    ("head", r"\bhead\s+(-n\s*|-c\s*|-)-\d", "head with a negative count is GNU-only"),
    ("bash4", r"\b(mapfile|readarray|coproc)\b", "a bash 4 builtin: macOS has bash 3.2"),
    ("bash4", r"\b(declare|local|typeset)\s+-\w*[An]",
     "associative arrays and namerefs need bash 4"),
    ("bash4", r"\$\{[^}]*(,,|\^\^)[^}]*\}", "case conversion ${x,,} needs bash 4"),
    ("bash4", r"\|&|&>>", "|& and &>> need bash 4"),
    ("tmp", r"(?<![\w$}])/tmp/", "a fixed path under /tmp is shared by every checkout on the "
     "machine: use a folder in the checkout (build/) or mktemp -d"),
]
_COMPILED = [(tool, re.compile(pattern), why) for tool, pattern, why in RULES]
_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def _code(line: str) -> str:
    """The line without its comment (a # at the start or after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t;"):
            return line[:i]
    return line


def shell_lines(path: str, text: str) -> list[tuple[int, str]]:
    """(line number, shell code) of a script, or of a workflow's `run:` steps."""
    lines = text.splitlines()
    if path.endswith((".yml", ".yaml")):
        picked, block_indent = [], None
        for no, line in enumerate(lines, 1):
            indent = len(line) - len(line.lstrip())
            if block_indent is not None:
                if line.strip() and indent < block_indent:
                    block_indent = None
                else:
                    picked.append((no, line))
                    continue
            m = re.match(r"\s*(?:-\s+)?run:\s*(.*)$", line)
            if m:
                if m.group(1).strip() in ("|", ">", "|-", ">-"):
                    block_indent = indent + 1
                else:
                    picked.append((no, m.group(1)))
        return picked
    return list(enumerate(lines, 1))


def lint_text(path: str, text: str) -> list[str]:
    """Problems in one file, as 'path:line: message'."""
    problems = []
    linux_only = LINUX_ONLY in text
    seen_uname = False
    heredoc_end = None
    for no, line in shell_lines(path, text):
        if heredoc_end is not None:
            if line.strip() == heredoc_end:
                heredoc_end = None
            continue
        code = _code(line)
        m = _HEREDOC.search(code)
        if m:
            heredoc_end = m.group(2)
        if "uname" in code:
            seen_uname = True
        for tool, pattern, why in _COMPILED:
            if not pattern.search(code):
                continue
            if tool != "tmp" and re.search(rf"command\s+-v\s+{re.escape(tool)}\b", code):
                continue
            if linux_only and seen_uname and tool != "tmp":
                continue
            problems.append(f"{os.path.relpath(path, ROOT)}:{no}: {why}: {line.strip()}")
    if linux_only and not seen_uname:
        problems.append(f"{os.path.relpath(path, ROOT)}: marked linux-only but never tests uname")
    return problems


def checked_files(root: str = ROOT) -> list[str]:
    """Every file this lint covers."""
    files = sorted(glob.glob(os.path.join(root, "scripts", "*.sh")))
    files += [p for p in [os.path.join(root, ".ci", "run")] if os.path.exists(p)]
    files += sorted(glob.glob(os.path.join(root, ".github", "workflows", "*.yml")))
    return files


def main() -> int:
    """Lints every checked file; prints the problems; returns 1 if there are any."""
    problems = []
    for path in checked_files():
        with open(path) as f:
            problems += lint_text(path, f.read())
    print("\n".join(problems) if problems else f"{len(checked_files())} files: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
