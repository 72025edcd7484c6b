"""Mechanical translation of a .metal source into C++ for the emulator.

What changes (everything else is kept verbatim, line for line, so compiler errors and
barrier sites point at the .metal file):
- `#include "rlx/..."` (a header the kernel shares with the host code, e.g. its params struct)
  is inlined from csrc/include with `#line` directives, by tools/embed_metal.py's
  expand_includes, exactly as the source is embedded for Metal.
- `#include <metal_stdlib>` is dropped (the shim is included first), and so is `<cstdint>` (a
  shared header's host-side include, under `#ifndef __METAL_VERSION__`; the shim has it);
  any other include is an error.
- `[[...]]` attributes are stripped after the kernel signatures have been read from them.
- `device T*`, `constant T*`, `threadgroup T*` become bounds-checked `metal::Ptr<T>` (constant
  ones const); `device T&` / `constant T&` become plain references; `kernel`, `device`,
  `thread` disappear and `constant` becomes `const`.
- `1.5h` half literals become `metal::half(1.5f)`.
- Explicit instantiations `template [[host_name("name")]] kernel void f<T>(...);` are removed
  and become launchable entries named `name`.
- `thread T*` becomes a bounds-checked `metal::Ptr<T>` too, and private arrays
  (`float s[8];`, `float acc[2][2] = {...};`) become bounds-checked `metal::Array`s that decay to
  such pointers.
- Vector swizzles of 2 to 4 components (`v.xy`, `v.zyx`, `p->rgba`) become
  `.template swz<...>()` calls, or `swz_ref<...>()` where the swizzle is assigned to.
- Every `for` / `while` / `do-while` condition first calls `metal_emu::tick()` (the watchdog
  counts loop iterations, so a runaway loop stops with an error instead of hanging).
"""

import os
import re
import sys
from dataclasses import dataclass, field

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "tools"))
import embed_metal  # noqa: E402

# Includes the translation drops: the shim provides them (see the module docstring).
_DROPPED_INCLUDES = ("<metal_stdlib>", "<cstdint>")

BUILTINS = (
    "thread_position_in_grid",
    "thread_position_in_threadgroup",
    "threadgroup_position_in_grid",
    "threads_per_threadgroup",
    "threadgroups_per_grid",
    "threads_per_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
    "thread_execution_width",
    "dispatch_threads_per_threadgroup",
)


class TranslationError(ValueError):
    pass


@dataclass
class Param:
    name: str
    kind: str  # "buffer" | "threadgroup" | "builtin"
    index: int  # slot, or position in BUILTINS
    ctype: str = ""  # declared type, e.g. "uint3" or "device const float*"


@dataclass
class KernelDef:
    function: str
    params: list
    is_template: bool
    line: int


@dataclass
class Entry:
    """A launchable kernel: host name -> C++ expression naming the function."""

    name: str
    function: str
    template_args: str  # "" for a plain kernel
    params: list = field(default_factory=list)

    def buffers(self):
        return {p.index: p.name for p in self.params if p.kind == "buffer"}

    def threadgroup_memory(self):
        return {p.index: p.name for p in self.params if p.kind == "threadgroup"}


def blank_comments(src):
    """Replaces comments by spaces (newlines kept), leaving string literals alone."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in src[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out.append(src[i : j + 1])
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _blank(text):
    return "".join(ch if ch == "\n" else " " for ch in text)


def _matching(src, i, open_ch, close_ch):
    """Index just past the bracket that closes src[i] (== open_ch)."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == open_ch:
            depth += 1
        elif src[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    raise TranslationError(f"unbalanced {open_ch}{close_ch} at offset {i}")


def split_top_level(text, sep=","):
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[{":
            depth += 1
        elif ch in ")>]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


_ATTR = re.compile(r"\[\[\s*(\w+)\s*(?:\(\s*([^()]*?)\s*\))?\s*\]\]")
_KERNEL = re.compile(r"(?:\bkernel\s+|\[\[\s*kernel\s*\]\]\s*)void\s+(\w+)\s*\(")
_INSTANTIATION = re.compile(r"\btemplate\s*\[\[\s*host_name\s*\(\s*\"([^\"]+)\"\s*\)\s*\]\]")
_TEMPLATE_BEFORE = re.compile(r"template\s*<[^;{}]*>\s*(?:\[\[[^\]]*\]\]\s*)*$")


_LINE_DIRECTIVE = re.compile(r'^[ \t]*#[ \t]*line[ \t]+(\d+)[^\n]*\n', re.M)


def _line_of(src, pos):
    """Line number of pos as a compiler reports it (after `#line N` the next line is N)."""
    last = None
    for m in _LINE_DIRECTIVE.finditer(src, 0, pos):
        last = m
    if last is None:
        return src.count("\n", 0, pos) + 1
    return int(last.group(1)) + src.count("\n", last.end(), pos)


def parse_params(plist, function, line):
    params = []
    for raw in split_top_level(plist):
        attrs = _ATTR.findall(raw)
        text = _ATTR.sub(" ", raw).strip()
        m = re.search(r"(\w+)\s*$", text)
        if not m:
            raise TranslationError(f"{function} (line {line}): cannot read parameter {raw!r}")
        name = m.group(1)
        ctype = " ".join(text[: m.start()].split())
        binding = None
        for attr, arg in attrs:
            if attr in ("buffer", "threadgroup"):
                binding = Param(name, attr, int(arg, 0), ctype)
            elif attr in BUILTINS:
                binding = Param(name, "builtin", BUILTINS.index(attr), ctype)
        if binding is None:
            raise TranslationError(
                f"{function} (line {line}): parameter '{name}' needs [[buffer(i)]], "
                f"[[threadgroup(i)]] or a supported built-in attribute"
            )
        params.append(binding)
    return params


def find_kernels(code):
    kernels = {}
    for m in _KERNEL.finditer(code):
        name = m.group(1)
        open_paren = m.end() - 1
        close = _matching(code, open_paren, "(", ")")
        line = _line_of(code, m.start())
        params = parse_params(code[open_paren + 1 : close - 1], name, line)
        before = code[max(0, m.start() - 400) : m.start()]
        before = before[max(before.rfind(";"), before.rfind("}")) + 1 :]
        kernels[name] = KernelDef(name, params, bool(_TEMPLATE_BEFORE.search(before)), line)
    return kernels


def translate(src, path="kernel.metal"):
    """Returns (cpp_text, entries) for one .metal source."""
    try:
        src = embed_metal.expand_includes(src, path, embed_metal.include_dir(_REPO))
    except FileNotFoundError as e:
        raise TranslationError(str(e)) from None
    code = blank_comments(src)
    for m in re.finditer(r"^[ \t]*#[ \t]*include\b(.*)$", code, flags=re.M):
        if m.group(1).strip() not in _DROPPED_INCLUDES:
            raise TranslationError(f"{path}:{_line_of(code, m.start())}: only <metal_stdlib> "
                                   "and the kernel's shared headers (\"rlx/...\") may be "
                                   f"included, found {m.group(1).strip()}")
    code = re.sub(r"^[ \t]*#[ \t]*include\s*(?:<metal_stdlib>|<cstdint>)", "", code, flags=re.M)

    kernels = find_kernels(code)
    entries = []
    for name, k in kernels.items():
        if not k.is_template:
            entries.append(Entry(name, name, "", k.params))
    # explicit instantiations with host names
    pieces, last = [], 0
    for m in _INSTANTIATION.finditer(code):
        end = code.find(";", m.end())
        if end < 0:
            where = f"{path}:{_line_of(code, m.start())}"
            raise TranslationError(f"{where}: unterminated instantiation")
        text = code[m.end() : end]
        found = None
        for fname in kernels:
            fm = re.search(r"\b" + fname + r"\s*<", text)
            if fm:
                lt = fm.end() - 1
                found = (fname, text[lt + 1 : _matching(text, lt, "<", ">") - 1].strip())
                break
        if found is None:
            raise TranslationError(f"{path}:{_line_of(code, m.start())}: host_name instantiation "
                                   "of a function that is not a kernel template")
        entries.append(Entry(m.group(1), found[0], found[1], kernels[found[0]].params))
        pieces.append(code[last : m.start()])
        pieces.append(_blank(code[m.start() : end + 1]))
        last = end + 1
    pieces.append(code[last:])
    code = "".join(pieces)

    names = [e.name for e in entries]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise TranslationError(f"{path}: kernel names defined twice: {sorted(dup)}")

    code = _ATTR.sub("", code)
    code = translate_address_spaces(code, path)
    code = checked_private_arrays(code)
    code = instrument_loops(code)
    code = translate_swizzles(code)
    code = re.sub(r"\b(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[hH]\b",
                  lambda m: f"metal::half({m.group(1)}{m.group(2) or ''}f)", code)
    return code, entries


_TYPE = r"(?:metal::)?\w+(?:\s*<[^<>;(){}]*(?:<[^<>;(){}]*>[^<>;(){}]*)*>)?"
_ADDR = re.compile(
    r"(\bconst\s+)?\b(device|constant|threadgroup|thread)\s+(const\s+)?("
    + _TYPE
    + r")(\s+const)?\s*([*&])"
)


def translate_address_spaces(code, path):
    def repl(m):
        const = bool(m.group(1) or m.group(3) or m.group(2) == "constant")
        t = ("const " if const else "") + m.group(4)
        if m.group(6) == "*":
            return f"metal::Ptr<{t}> "
        return f"{t}& "

    code = _ADDR.sub(repl, code)
    code = re.sub(r"\bkernel\s+void\b", "void", code)
    code = re.sub(r"\b(device|thread)\s+", "", code)
    code = re.sub(r"\bconstant\b", "const", code)
    m = re.search(r"\bthreadgroup\b", code)
    if m:
        raise TranslationError(
            f"{path}:{_line_of(code, m.start())}: threadgroup variables must be kernel "
            "parameters ([[threadgroup(i)]]), not declared in a function body"
        )
    return code


_SCALARS = "float half bfloat int uint short ushort char uchar bool long ulong".split()
_ARRAY_TYPES = _SCALARS + [f"{t}{n}" for t in _SCALARS for n in (2, 3, 4)]
_DECLARATOR = re.compile(r"\s*([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)+)")


def _split_commas(text):
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def checked_private_arrays(code):
    """`float a[4], b[N][2];` -> `metal::Array<float, (4), "a"> a; metal::Array<...> b;`.

    Only statements (after `;`, `{` or `}`) declaring arrays of a scalar, vector, struct or
    template-parameter type; an initializer is kept, its braces doubled (the Array wraps a C
    array). Anything else is left as written (and unchecked)."""
    types = set(_ARRAY_TYPES) | set(re.findall(r"\bstruct\s+(\w+)", code))
    for params in re.findall(r"\btemplate\s*<([^<>]*)>", code):
        types |= set(re.findall(r"\b(?:typename|class)\s+(\w+)", params))
    decl = re.compile(r"(?<=[;{}])(\s*)((?:(?:const|constexpr|static)\s+)*)("
                      + "|".join(sorted(map(re.escape, types), key=len, reverse=True))
                      + r")\s+([A-Za-z_]\w*\s*\[[^;={}]*)(=[^;]*)?;")

    def repl(m):
        lead, quals, typ, declarators, init = m.groups()
        parts = _split_commas(declarators)
        matches = [_DECLARATOR.fullmatch(d) for d in parts]
        if not all(matches) or (init and len(parts) > 1):
            return m.group(0)
        out = []
        for d in matches:
            name, dims = d.group(1), re.findall(r"\[([^\[\]]+)\]", d.group(2))
            t = typ
            for dim in reversed(dims):
                t = f'metal::Array<{t}, ({dim.strip()}), "{name}">'
            value = " = " + init[1:].strip().replace("{", "{{").replace("}", "}}") if init else ""
            out.append(f"{quals}{t} {name}{value};")
        return lead + " ".join(out)

    return decl.sub(repl, code)


_SWIZZLE = re.compile(r"(\.|->)\s*([xyzw]{2,4}|[rgba]{2,4})\b(?!\s*\()(\s*(?:[-+*/]?=)(?!=))?")
_COMPONENT = {c: i for i, c in enumerate("xyzw")} | {c: i for i, c in enumerate("rgba")}


def translate_swizzles(code):
    """`v.zyx` -> `v.template swz<2, 1, 0>()`; assigned-to swizzles get `swz_ref`."""

    def repl(m):
        idx = ", ".join(str(_COMPONENT[c]) for c in m.group(2))
        fn = "swz_ref" if m.group(3) else "swz"
        return f"{m.group(1)}template {fn}<{idx}>(){m.group(3) or ''}"

    return _SWIZZLE.sub(repl, code)


_LOOP = re.compile(r"\b(for|while)\s*\(")


def _split_semicolons(text):
    """Splits a for-header at its top-level semicolons (only brackets nest; `<` is a compare)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def instrument_loops(code):
    """Puts a watchdog tick in front of every loop condition, on the same line."""
    out, last = [], 0
    for m in _LOOP.finditer(code):
        if m.start() < last:  # inside a header already rewritten
            continue
        open_paren = m.end() - 1
        close = _matching(code, open_paren, "(", ")")
        inner = code[open_paren + 1 : close - 1]
        if m.group(1) == "while":
            header = f"metal_emu::tick() && ({inner})"
        else:
            parts = _split_semicolons(inner)
            if len(parts) != 3:  # range-based for over a fixed array: bounded, left alone
                continue
            cond = parts[1].strip()
            parts[1] = f" metal_emu::tick() && ({cond})" if cond else " metal_emu::tick()"
            header = ";".join(parts)
        out.append(code[last : open_paren + 1])
        out.append(header)
        last = close - 1
    out.append(code[last:])
    return "".join(out)


def generate(src, path="kernel.metal"):
    """Full C++ translation unit: shim, translated source, and the launch table."""
    code, entries = translate(src, path)
    out = ['#include "metal_emu/entry.h"', f'#line 1 "{path}"', code, "", "namespace {"]
    for i, e in enumerate(entries):
        binds = ", ".join(
            f'{{metal_emu::BindKind::{p.kind.capitalize()}, {p.index}, "{p.name}"}}'
            for p in e.params
        ) or '{metal_emu::BindKind::Buffer, -1, ""}'
        fn = f"&{e.function}<{e.template_args}>" if e.template_args else f"&{e.function}"
        out.append(f"const metal_emu::Binding bind_{i}[] = {{{binds}}};")
        out.append(f"void body_{i}(metal_emu::Runtime& rt) "
                   f"{{ metal_emu::invoke({fn}, rt, bind_{i}); }}")
    out.append("}  // namespace")
    table = ", ".join(f'{{"{e.name}", &body_{i}}}' for i, e in enumerate(entries))
    out.append(f"const metal_emu::KernelEntry rlx_emu_table[] = {{{table}{', ' if table else ''}"
               "{nullptr, nullptr}};")
    out.append(
        'extern "C" int rlx_emu_launch(const char* name, const metal_emu::LaunchDesc* d, '
        "char* err, size_t err_len) {\n"
        "  for (const auto* e = rlx_emu_table; e->name; ++e)\n"
        "    if (std::strcmp(e->name, name) == 0) return metal_emu::launch(e->name, e->body, *d, "
        "err, err_len);\n"
        '  std::snprintf(err, err_len, "no kernel named %s", name);\n'
        "  return 2;\n}"
    )
    return "\n".join(out) + "\n", entries
