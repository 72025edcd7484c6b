"""Lint for the Metal sources: rejects MSL that Metal or the CPU emulator would not accept.

Rules (see DESIGN.md, "Metal without a Mac"):
- no `double` (Apple GPUs have none), no `std::`, no include but <metal_stdlib> and the
  kernel's params header shared with the host code ("rlx/mps_*_params.h" in csrc/include,
  checked with the source it is inlined into, as tools/embed_metal.py embeds it);
- a struct passed as a kernel's `constant T&` params is not defined in the .metal file: it
  lives in that shared header, the one definition the host code uses too;
- no recursion (Metal forbids it), found through the call graph of the file's functions;
- no `threadgroup` variables declared in a function body: threadgroup memory is a
  `[[threadgroup(i)]]` kernel parameter sized by the launch plan;
- exp, log, pow, divide and the other functions whose fast variant is less accurate are
  written precise::f or fast::f: macOS 15 makes the fast variants the default of a bare f;
- everything the emulator's translator requires (every kernel parameter has a binding
  attribute, host_name instantiations name a kernel template, ...).

Host code (csrc/mps/*.mm, *.h; setup.py compiles them without ARC, so an autoreleased object
outside a pool of ours is never freed):
- every `dispatch_sync(queue, ^{ ... })` block starts with `@autoreleasepool`;
- every call that builds Metal objects (newLibraryWithSource, newFunctionWithName,
  newComputePipelineStateWithFunction) sits inside an `@autoreleasepool { ... }`.

Usage: python tools/msl_lint.py [files...]   (default: csrc/mps/kernels/*.metal and the host
code); .metal files get the MSL rules, .mm/.h files the host rules; exit 1 on errors.
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
    from tests.metal_emu.translate import _line_of

    return _line_of(code, pos)  # honours the #line directives of inlined headers


_PARAMS_HEADER = re.compile(r"rlx/mps_\w+_params\.h")


def _include_problems(src, path):
    """Includes of the file as written: <metal_stdlib>, or a shared params header."""
    from tests.metal_emu.translate import blank_comments

    code = blank_comments(src)
    out = []
    for m in re.finditer(r"^[ \t]*#[ \t]*include\b(.*)$", code, flags=re.M):
        what = m.group(1).strip()
        header = what[1:-1] if what.startswith('"') and what.endswith('"') else None
        if what == "<metal_stdlib>" or (header and _PARAMS_HEADER.fullmatch(header)):
            continue
        out.append(f"{path}:{code.count(chr(10), 0, m.start()) + 1}: only <metal_stdlib> and "
                   f"a shared params header (\"rlx/mps_*_params.h\") may be included, not {what}")
    return out


def _params_struct_problems(code, path):
    """Kernel params structs (`constant T& p [[buffer(i)]]`) defined in the kernel file."""
    from tests.metal_emu.translate import TranslationError, find_kernels

    try:
        kernels = find_kernels(code)
    except TranslationError:
        return []  # reported by the translation below
    out, seen = [], set()
    for name, k in kernels.items():
        for p in k.params:
            m = re.fullmatch(r"constant\s+(?:const\s+)?(\w+)\s*&", p.ctype)
            if not m or m.group(1) in seen:
                continue
            seen.add(m.group(1))
            d = re.search(r"\bstruct\s+" + m.group(1) + r"\s*\{", code)
            if d:
                out.append(f"{path}:{_line(code, d.start())}: params struct {m.group(1)} "
                           f"(kernel {name}) is defined in the kernel source: define it in a "
                           "header shared with the host code (rlx/mps_<kernel>_params.h) and "
                           "include that")
    return out


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


# Metal's rules for kernel position attributes (MSL specification, "Kernel function input
# attributes"): vector-typed ones agree on the component count, and these groups share a type.
_POSITION_FAMILY = ("thread_position_in_grid", "threads_per_grid", "thread_position_in_threadgroup",
                    "threads_per_threadgroup", "threadgroup_position_in_grid",
                    "dispatch_threads_per_threadgroup", "threadgroups_per_grid")
_SAME_TYPE = (("thread_position_in_grid", "threads_per_grid"),
              ("thread_position_in_threadgroup", "threads_per_threadgroup",
               "dispatch_threads_per_threadgroup"))


def _builtin_types(code):
    from tests.metal_emu.translate import BUILTINS, find_kernels

    for name, k in find_kernels(code).items():
        yield name, k.line, {BUILTINS[p.index]: p.ctype.replace("const ", "").strip()
                             for p in k.params if p.kind == "builtin"}


def _attribute_type_problems(code, path):
    out = []
    for kernel, line, types in _builtin_types(code):
        where = f"{path}:{line}: kernel {kernel}"
        widths = {a: int(t[-1]) for a, t in types.items()
                  if a in _POSITION_FAMILY and t[-1:] in "234"}
        if len(set(widths.values())) > 1:
            out.append(f"{where}: vector position attributes need the same number of "
                       f"components, got {widths}")
        for group in _SAME_TYPE:
            got = {a: types[a] for a in group if a in types}
            if len(set(got.values())) > 1:
                out.append(f"{where}: {', '.join(got)} need the same type, got {got}")
        pos = types.get("thread_position_in_threadgroup", "")
        if pos.startswith("uint") and types.get("thread_index_in_threadgroup", "uint") != "uint":
            out.append(f"{where}: thread_index_in_threadgroup must be uint when "
                       "thread_position_in_threadgroup is")
    return out


_FAST_VARIANTS = ("exp", "exp2", "exp10", "log", "log2", "log10", "pow", "powr", "divide",
                  "tanh", "sin", "cos", "tan")


def lint_source(src, path="<source>", host_params=True):
    """Returns a list of 'path:line: message' strings. host_params: the kernels' params come
    from host code (csrc/mps/kernels), so their structs must be in a shared header (the
    emulator's self-test kernels, launched from Python, define theirs in place)."""
    from tests.metal_emu.translate import TranslationError, embed_metal, translate

    out = _include_problems(src, path)
    if host_params:
        out += _params_struct_problems(_strip(src), path)
    if out:
        return out
    try:  # the rules below apply to the text as embedded: shared headers inlined
        src = embed_metal.expand_includes(src, path, embed_metal.include_dir(ROOT))
    except FileNotFoundError as e:
        return [f"{path}: {e}"]
    code = _strip(src)

    def report(pos, msg):
        out.append(f"{path}:{_line(code, pos)}: {msg}")

    for m in re.finditer(r"\bdouble\b", code):
        report(m.start(), "`double` is not supported on Apple GPUs; use float")
    for m in re.finditer(r"\bstd\s*::", code):
        report(m.start(), "`std::` is not available in Metal; use metal:: functions")
    for m in re.finditer(r"(?<![\w:.])(" + "|".join(_FAST_VARIANTS) + r")\s*\(", code):
        report(m.start(), f"bare {m.group(1)}(): write precise::{m.group(1)} (or fast::) so "
               "the accuracy does not depend on the library's math mode")
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
            out += _attribute_type_problems(_strip(src), path)
        except TranslationError as e:
            out.append(f"{path}: {e}")
    return out


_BUILDS_OBJECTS = ("newLibraryWithSource", "newFunctionWithName",
                   "newComputePipelineStateWithFunction")


def lint_host_source(src, path="<source>"):
    """Autorelease rules of the Objective-C++ host code; 'path:line: message' strings."""
    code = _strip(src)
    pools = []
    for m in re.finditer(r"@autoreleasepool\s*\{", code):
        pools.append((m.end() - 1, _match_brace(code, m.end() - 1)))
    out = []
    for m in re.finditer(r"\bdispatch_sync\s*\(", code):
        block = re.compile(r"\^\s*(?:\([^()]*\)\s*)?\{").search(code, m.end())
        if block is None:
            continue
        body = code[block.end():].lstrip()
        if not body.startswith("@autoreleasepool"):
            out.append(f"{path}:{_line(code, m.start())}: dispatch_sync block without "
                       "@autoreleasepool (encoders and other autoreleased objects would never "
                       "be freed)")
    for name in _BUILDS_OBJECTS:
        for m in re.finditer(r"\b" + name + r"\s*:", code):
            if not any(a < m.start() < b for a, b in pools):
                out.append(f"{path}:{_line(code, m.start())}: {name}: outside "
                           "@autoreleasepool")
    return out


def lint_files(paths):
    problems = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            text = f.read()
        rel = os.path.relpath(p, ROOT)
        if p.endswith(".metal"):
            host_params = os.path.dirname(os.path.abspath(p)) == KERNEL_DIR
            problems += lint_source(text, rel, host_params)
        else:
            problems += lint_host_source(text, rel)
    return problems


def host_files():
    mdir = os.path.join(ROOT, "csrc", "mps")
    if not os.path.isdir(mdir):
        return []
    return sorted(os.path.join(mdir, f) for f in os.listdir(mdir) if f.endswith((".mm", ".h")))


KERNEL_DIR = os.path.join(ROOT, "csrc", "mps", "kernels")


def default_files():
    kdir = KERNEL_DIR
    if not os.path.isdir(kdir):
        return host_files()
    return sorted(os.path.join(kdir, f) for f in os.listdir(kdir)
                  if f.endswith(".metal")) + host_files()


if __name__ == "__main__":
    files = sys.argv[1:] or default_files()
    problems = lint_files(files)
    print("\n".join(problems) if problems else f"msl lint: {len(files)} file(s) clean")
    sys.exit(1 if problems else 0)
