"""The params structs of the Metal kernels: one definition each, in a header that the kernel
source and the host code both include (csrc/include/rlx/mps_*_params.h), laid out alike by
every compiler that reads it: the host's C++ (the .mm code and the launch plans), the Metal
Shading Language (its C++14 base, as tests/test_metal_cxx14.py checks the kernels) and the
emulator's translation of the kernel sources. The expected layout is computed here from the
field list (natural alignment of fixed-width types); each compiler must agree with it."""

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.metal_emu import CXX, INCLUDE, REPO
from tests.metal_emu.translate import blank_comments, embed_metal, generate

HEADERS = sorted(glob.glob(str(REPO / "csrc" / "include" / "rlx" / "mps_*_params.h")))
KERNELS = sorted(glob.glob(str(REPO / "csrc" / "mps" / "kernels" / "*.metal")))
PRELUDE_DIR = REPO / "tests" / "metal_emu" / "cxx14"
# Types both languages define with one size and alignment (MSL: <metal_stdlib>; C++: <cstdint>)
SIZES = {"uint32_t": 4, "int32_t": 4, "float": 4, "uint64_t": 8, "int64_t": 8}


def structs_of(path):
    """{struct name: [(field, type), ...]} of a params header, in declaration order."""
    code = blank_comments(Path(path).read_text())
    out = {}
    for m in re.finditer(r"\bstruct\s+(\w+)\s*\{([^{}]*)\};", code):
        fields = []
        for decl in m.group(2).split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            typ, _, names = decl.partition(" ")
            fields += [(n.strip(), typ) for n in names.split(",")]
        out[m.group(1)] = fields
    return out


def layout(fields):
    """(offsets, size) by the C/MSL rules: each field at its alignment, the struct padded to
    the largest one."""
    off, offsets = 0, {}
    for name, typ in fields:
        a = SIZES[typ]
        off = (off + a - 1) // a * a
        offsets[name] = off
        off += a
    align = max(SIZES[t] for _, t in fields)
    return offsets, (off + align - 1) // align * align


ALL = [(os.path.basename(h), name, fields) for h in HEADERS
       for name, fields in structs_of(h).items()]


def checks(struct, fields):
    offsets, size = layout(fields)
    out = [f"static_assert(offsetof({struct}, {f}) == {offsets[f]} && sizeof({struct}::{f}) == "
           f"{SIZES[t]}, \"{struct}::{f}\");" for f, t in fields]
    return "\n".join(out + [f"static_assert(sizeof({struct}) == {size}, \"{struct}\");"])


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def test_every_kernel_params_struct_has_a_shared_header():
    assert HEADERS and KERNELS
    names = {name for _, name, _ in ALL}
    for k in KERNELS:
        code = blank_comments(Path(k).read_text())
        used = set(re.findall(r"\bconstant\s+(\w+)\s*&", code))
        assert used and used <= names, (k, used - names)
        for header in set(re.findall(r'#include "(rlx/mps_\w+_params\.h)"', code)):
            assert os.path.join(REPO, "csrc", "include", header) in HEADERS


@pytest.mark.parametrize("header,struct,fields", ALL, ids=[s for _, s, _ in ALL])
def test_one_definition(header, struct, fields):
    """The struct is defined once in the tree, and each kernel gets it from the header."""
    defs = []
    for ext in ("h", "mm", "cpp", "metal", "cu", "cuh"):
        for p in glob.glob(str(REPO / "csrc" / "**" / f"*.{ext}"), recursive=True):
            code = blank_comments(Path(p).read_text())
            defs += [p] * len(re.findall(r"\bstruct\s+" + struct + r"\s*\{", code))
    assert defs == [str(REPO / "csrc" / "include" / "rlx" / header)], defs
    assert all(t in SIZES for _, t in fields), fields


@pytest.mark.parametrize("header,struct,fields", ALL, ids=[s for _, s, _ in ALL])
def test_host_layout(header, struct, fields, tmp_path):
    """As the host code sees it: through its launch-plan header, C++17."""
    plan = header.replace("_params.h", "_plan.h")
    assert (REPO / "csrc" / "include" / "rlx" / plan).exists()
    src = tmp_path / "host.cpp"
    src.write_text(f'#include <cstddef>\n#include "rlx/{plan}"\nusing rlx::mps::{struct};\n'
                   + checks(struct, fields) + "\n")
    proc = run([CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Werror",
                f"-I{REPO / 'csrc' / 'include'}", str(src)])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("metal_version", [300, 310])
@pytest.mark.parametrize("header,struct,fields", ALL, ids=[s for _, s, _ in ALL])
def test_metal_cxx14_layout(header, struct, fields, metal_version, tmp_path):
    """As MSL sees it: the header after the prelude's <metal_stdlib>, C++14, no <cstdint>."""
    src = tmp_path / "metal.cpp"
    src.write_text(f'#include <cstddef>\n#include "metal_prelude.h"\nusing namespace metal;\n'
                   f'#include "rlx/{header}"\nusing rlx::mps::{struct};\n'
                   + checks(struct, fields) + "\n")
    proc = run([CXX, "-std=c++14", "-pedantic-errors", "-fsyntax-only", "-x", "c++",
                f"-D__METAL_VERSION__={metal_version}", f"-I{PRELUDE_DIR}",
                f"-I{REPO / 'csrc' / 'include'}", str(src)])
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("kernel", KERNELS, ids=os.path.basename)
def test_emulator_layout(kernel, tmp_path):
    """As the emulator runs it: the kernel source translated (its header inlined), with every
    params struct it uses."""
    cpp, _ = generate(Path(kernel).read_text(), os.path.basename(kernel))
    used = set(re.findall(r"\bconstant\s+(\w+)\s*&", blank_comments(Path(kernel).read_text())))
    asserts = [checks(s, f) for _, s, f in ALL if s in used]
    assert asserts
    src = tmp_path / "emu.cpp"
    src.write_text("#include <cstddef>\n" + cpp + "\n" + "\n".join(asserts) + "\n")
    proc = run([CXX, "-std=c++20", "-fsyntax-only", "-w", f"-I{INCLUDE}", str(src)])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_divergent_header_fails(tmp_path):
    """A field that only one side sees (the old failure: two definitions drifting apart) is
    caught by the layout checks."""
    _, struct, fields = next(a for a in ALL if a[1] == "GdnParams")
    text = (REPO / "csrc" / "include" / "rlx" / "mps_gated_delta_params.h").read_text()
    bad = text.replace("  float scale;\n", "#ifndef __METAL_VERSION__\n  uint32_t extra;\n"
                       "#endif\n  float scale;\n")
    assert bad != text
    (tmp_path / "rlx").mkdir()
    (tmp_path / "rlx" / "mps_gated_delta_params.h").write_text(bad)
    src = tmp_path / "metal.cpp"
    body = checks(struct, fields)
    src.write_text('#include <cstddef>\n#include "rlx/mps_gated_delta_params.h"\n'
                   f"using rlx::mps::{struct};\n{body}\n")
    proc = run([CXX, "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", str(src)])
    assert proc.returncode != 0 and "GdnParams" in proc.stderr
    # the Metal side still agrees with the field list: only the host drifted
    metal = tmp_path / "metal14.cpp"
    metal.write_text('#include <cstddef>\n#include "metal_prelude.h"\nusing namespace metal;\n'
                     f'#include "rlx/mps_gated_delta_params.h"\nusing rlx::mps::{struct};\n'
                     f"{body}\n")
    proc = run([CXX, "-std=c++14", "-pedantic-errors", "-fsyntax-only", "-x", "c++",
                "-D__METAL_VERSION__=310", f"-I{PRELUDE_DIR}", f"-I{tmp_path}", str(metal)])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_embedded_sources_carry_the_header():
    for k in KERNELS:
        text = embed_metal.read_kernel(k, str(REPO))
        for header in re.findall(r'#include "(rlx/[^"]+)"', Path(k).read_text()):
            assert f'#line 1 "{header}"' in text
