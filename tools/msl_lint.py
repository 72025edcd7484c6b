"""Lint for the Metal sources: rejects MSL that Metal or the CPU emulator would not accept.

Rules (see DESIGN.md, "Metal without a Mac"):
- no `double` (Apple GPUs have none), no `std::`, no include but <metal_stdlib>;
- no recursion (Metal forbids it), found through the call graph of the file's functions;
- no `threadgroup` variables declared in a function body: threadgroup memory is a
  `[[threadgroup(i)]]` kernel parameter sized by the launch plan;
- everything the emulator's translator requires (every kernel parameter has a binding
  attribute, host_name instantiations name a kernel template, ...).

Usage: python tools/msl_lint.py [files...]   (default: csrc/mps/kernels/*.metal); exit 1 on errors.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "static_assert"}


def _strip(src):
    from tests.metal_emu.translate import blank_comments

    code = blank_comments(src)
    # blank string literals too (host_name("...") text is not code)
    return re.sub(r'"(?:\\.|[^"\\])*"', lambda m: '"' + " " * (len(m.group()) - 2) + '"', code)


def _line(code, pos):
    return code.count("\n", 0, pos) + 1


def _functions(code):
    """{name: (body_start, body_end)} for top-level function definitions."""
    funcs, depth, i = {}, 0, 0
    head = re.compile(r"\b(\w+)\s*(?:<[^;{}()]*>)?\s*\(")
    while i < len(code):
        ch = code[i]
        if ch == "{":
            if depth == 0:
                # the text since the previous top-level ; or } holds the signature
                start = max(code.rfind(";", 0, i), code.rfind("}", 0, i)) + 1
                sig = code[start:i]
                m = None
                for cand in head.finditer(sig):
                    if cand.group(1) not in KEYWORDS and not m:
                        m = cand
                depth_end = _match_brace(code, i)
                if m and ")" in sig and not re.search(r"\b(struct|class|namespace|enum)\b", sig):
                    funcs.setdefault(m.group(1), []).append((i, depth_end))
                i = depth_end
                continue
        i += 1
    return funcs


def _match_brace(code, i):
    depth = 0
    for j in range(i, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


def _recursion(code, funcs):
    calls = {}
    for name, spans in funcs.items():
        found = set()
        for a, b in spans:
            for m in re.finditer(r"\b(\w+)\s*(?:<[^;{}()]*>)?\s*\(", code[a:b]):
                if m.group(1) in funcs:
                    found.add(m.group(1))
        calls[name] = found
    problems, state = [], {}

    def visit(f, path):
        state[f] = 1
        for g in sorted(calls[f]):
            if state.get(g) == 1:
                cycle = path[path.index(g):] + [g] if g in path else [f, g]
                problems.append((funcs[g][0][0], "recursion: " + " -> ".join(cycle)))
            elif g not in state:
                visit(g, path + [g])
        state[f] = 2

    for f in sorted(calls):
        if f not in state:
            visit(f, [f])
    return problems


def lint_source(src, path="<source>"):
    """Returns a list of 'path:line: message' strings."""
    from tests.metal_emu.translate import TranslationError, translate

    code = _strip(src)
    out = []

    def report(pos, msg):
        out.append(f"{path}:{_line(code, pos)}: {msg}")

    for m in re.finditer(r"\bdouble\b", code):
        report(m.start(), "`double` is not supported on Apple GPUs; use float")
    for m in re.finditer(r"\bstd\s*::", code):
        report(m.start(), "`std::` is not available in Metal; use metal:: functions")
    for m in re.finditer(r"^[ \t]*#[ \t]*include\b(.*)$", code, flags=re.M):
        if m.group(1).strip() != "<metal_stdlib>":
            report(m.start(), f"only <metal_stdlib> may be included, not {m.group(1).strip()}")
    funcs = _functions(code)
    for spans in funcs.values():
        for a, b in spans:
            body = code[a:b]
            for m in re.finditer(r"\bthreadgroup\s+(?!\w[\w:<>, ]*\s*[*&])[\w:<>]+\s+\w+", body):
                report(a + m.start(), "threadgroup variable declared in a function body; pass "
                       "threadgroup memory as a [[threadgroup(i)]] kernel parameter")
    for pos, msg in _recursion(code, funcs):
        report(pos, msg)
    if not out:
        try:
            translate(src, path)
        except TranslationError as e:
            out.append(f"{path}: {e}")
    return out


def lint_files(paths):
    problems = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            problems += lint_source(f.read(), os.path.relpath(p, ROOT))
    return problems


def default_files():
    kdir = os.path.join(ROOT, "csrc", "mps", "kernels")
    if not os.path.isdir(kdir):
        return []
    return sorted(os.path.join(kdir, f) for f in os.listdir(kdir) if f.endswith(".metal"))


if __name__ == "__main__":
    files = sys.argv[1:] or default_files()
    problems = lint_files(files)
    print("\n".join(problems) if problems else f"msl lint: {len(files)} file(s) clean")
    sys.exit(1 if problems else 0)
