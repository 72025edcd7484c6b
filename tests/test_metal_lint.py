"""The MSL lint (tools/msl_lint.py) over every Metal source, and proof that it rejects each
construct it is meant to reject. Also checks the generated header that embeds the sources."""

import glob
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import embed_metal  # noqa: E402
import msl_lint  # noqa: E402

METAL_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "mps", "kernels", "*.metal"))) + sorted(
    glob.glob(os.path.join(ROOT, "tests", "metal_emu", "kernels", "*.metal"))
)

GOOD = """#include <metal_stdlib>
using namespace metal;
inline float twice(float x) { return 2.0f * x; }
kernel void k(device float* x [[buffer(0)]], threadgroup float* tile [[threadgroup(0)]],
              uint i [[thread_position_in_grid]]) {
  threadgroup float* row = tile + 1;  // a pointer into threadgroup memory is fine
  row[0] = twice(x[i]);             // "double" in a comment or std:: in a string is fine
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x[i] = row[0];
}
"""


def test_metal_files_exist():
    assert METAL_FILES, "no .metal files found"


@pytest.mark.parametrize("path", METAL_FILES, ids=os.path.basename)
def test_every_metal_file_is_clean(path):
    assert msl_lint.lint_files([path]) == []


def test_clean_source_passes():
    assert msl_lint.lint_source(GOOD, "good.metal") == []


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("return 2.0f * x;", "return double(2) * x;", "`double` is not supported"),
        ("return 2.0f * x;", "return std::max(x, 0.0f);", "`std::` is not available"),
        ("using namespace metal;", '#include "common.h"\nusing namespace metal;',
         "only <metal_stdlib> and a shared params header"),
        ("using namespace metal;", "#include <cstdint>\nusing namespace metal;",
         "only <metal_stdlib> and a shared params header"),
        ("using namespace metal;", '#include "rlx/mps_nothing_params.h"\nusing namespace metal;',
         "is not a file under"),
        ("return 2.0f * x;", "return x > 1.0f ? twice(x / 2.0f) : x;", "recursion: twice -> twice"),
        ("threadgroup float* row = tile + 1;", "threadgroup float row[4];",
         "threadgroup variable declared in a function body"),
        ("uint i [[thread_position_in_grid]]", "uint i", "parameter 'i' needs"),
        ("uint i [[thread_position_in_grid]]",
         "uint2 i [[thread_position_in_grid]], uint3 n [[threadgroups_per_grid]]",
         "need the same number of components"),
        ("uint i [[thread_position_in_grid]]",
         "uint i [[thread_position_in_grid]], ushort n [[threads_per_grid]]",
         "need the same type"),
    ],
)
def test_lint_rejects(old, new, message):
    assert old in GOOD
    problems = msl_lint.lint_source(GOOD.replace(old, new), "bad.metal")
    assert any(message in p for p in problems), problems


def test_lint_finds_mutual_recursion():
    src = GOOD.replace(
        "inline float twice(float x) { return 2.0f * x; }",
        "float odd(float x);\ninline float even(float x) { return x < 1 ? x : odd(x - 1); }\n"
        "inline float odd(float x) { return even(x - 1); }\n"
        "inline float twice(float x) { return even(x); }",
    )
    problems = msl_lint.lint_source(src, "bad.metal")
    assert any("recursion: even -> odd -> even" in p for p in problems), problems


PARAMS_GOOD = GOOD.replace("using namespace metal;", 'using namespace metal;\n'
                           '#include "rlx/mps_gated_delta_params.h"\n'
                           "using rlx::mps::GdnParams;").replace(
    "uint i [[thread_position_in_grid]]",
    "constant GdnParams& p [[buffer(1)]], uint i [[thread_position_in_grid]]")


def test_params_struct_comes_from_the_shared_header():
    assert msl_lint.lint_source(PARAMS_GOOD, "good.metal") == []
    # the struct written into the kernel source again (a second definition) is rejected
    local = PARAMS_GOOD.replace('#include "rlx/mps_gated_delta_params.h"\n'
                                "using rlx::mps::GdnParams;",
                                "struct GdnParams {\n  uint tokens;\n};")
    problems = msl_lint.lint_source(local, "bad.metal")
    assert len(problems) == 1 and "params struct GdnParams (kernel k) is defined in the " \
        "kernel source" in problems[0] and problems[0].startswith("bad.metal:3:"), problems
    # the rules apply to the inlined header too; line numbers stay the kernel file's
    bad = PARAMS_GOOD.replace("row[0] = twice(x[i]);", "row[0] = twice(x[i]) + double(1);")
    problems = msl_lint.lint_source(bad, "bad.metal")
    assert problems == ["bad.metal:9: `double` is not supported on Apple GPUs; use float"], \
        problems


def test_embedded_header_holds_every_kernel_file(tmp_path):
    out = embed_metal.generate(ROOT, str(tmp_path))
    text = (tmp_path / "rlx" / "mps_kernels_embedded.h").read_text()
    assert out == str(tmp_path)
    kernel_files = embed_metal.kernel_files(ROOT)
    assert f"kNumSources = {len(kernel_files)};" in text
    for path in kernel_files:
        embedded = embed_metal.read_kernel(path, ROOT)
        assert embedded in text
        # Metal compiles the source at run time without include paths: the shared headers
        # are inlined (once each), the kernel's own text kept around them
        assert not re.search(r'^\s*#\s*include\s*"', embedded, flags=re.M), path
        with open(path) as f:
            own = f.read()
        for header in re.findall(r'^#include "(rlx/[^"]+)"', own, flags=re.M):
            with open(os.path.join(ROOT, "csrc", "include", header)) as f:
                body = f.read().replace("#pragma once", "")
            assert embedded.count(f'#line 1 "{header}"\n') == 1 and body.rstrip() in embedded


def test_expand_includes_keeps_line_numbers_and_includes_once(tmp_path):
    (tmp_path / "rlx").mkdir()
    (tmp_path / "rlx" / "a.h").write_text("#pragma once\nstruct A { int x; };\n")
    (tmp_path / "rlx" / "b.h").write_text('#pragma once\n#include "rlx/a.h"\nstruct B {};\n')
    src = 'one\n#include "rlx/b.h"\n#include "rlx/a.h"\nfour\n'
    out = embed_metal.expand_includes(src, "k.metal", str(tmp_path))
    assert out == ('one\n#line 1 "rlx/b.h"\n\n#line 1 "rlx/a.h"\n\nstruct A { int x; };\n'
                   '#line 3 "rlx/b.h"\nstruct B {};\n#line 3 "k.metal"\n\nfour\n'), out
    with pytest.raises(FileNotFoundError, match="not a file under"):
        embed_metal.expand_includes('#include "../secret.h"\n', "k.metal", str(tmp_path))
    with pytest.raises(ValueError, match="delimiter"):
        embed_metal.render([("x.metal", 'a )RLX_METAL" b')])


HOST_FILES = msl_lint.host_files()

HOST_GOOD = """
void f(dispatch_queue_t q, id<MTLDevice> d, NSString* s) {
  dispatch_sync(q, ^{
    @autoreleasepool {
      run();  // dispatch_sync(q, ^{ ... }) in a comment is fine
    }
  });
  @autoreleasepool {
    id<MTLLibrary> lib = [d newLibraryWithSource:s options:nil error:nil];
  }
}
"""


def test_host_files_exist():
    assert any(p.endswith(".mm") for p in HOST_FILES)


@pytest.mark.parametrize("path", HOST_FILES, ids=os.path.basename)
def test_every_host_file_is_clean(path):
    assert msl_lint.lint_files([path]) == []


def test_host_lint_accepts_pools():
    assert msl_lint.lint_host_source(HOST_GOOD) == []


@pytest.mark.parametrize("bad,message", [
    (HOST_GOOD.replace("    @autoreleasepool {\n      run();", "    {\n      run();"),
     "dispatch_sync block without @autoreleasepool"),
    (HOST_GOOD.replace("dispatch_sync(q, ^{", "dispatch_sync(q, ^() {").replace(
        "@autoreleasepool {\n      run();", "{\n      run();"),
     "dispatch_sync block without @autoreleasepool"),
    (HOST_GOOD.replace("  @autoreleasepool {\n    id<MTLLibrary>", "  {\n    id<MTLLibrary>"),
     "newLibraryWithSource: outside @autoreleasepool"),
])
def test_host_lint_rejects_missing_pools(bad, message):
    problems = msl_lint.lint_host_source(bad, "x.mm")
    assert len(problems) == 1 and message in problems[0], problems


def test_math_with_a_fast_variant_names_its_precision():
    precise = GOOD.replace("row[0] = twice(x[i]);",
                           "row[0] = precise::exp(x[i]) + fast::log(x[i]);")
    assert msl_lint.lint_source(precise) == []
    for f in ("exp", "log", "pow", "divide"):
        bare = GOOD.replace("row[0] = twice(x[i]);", f"row[0] = {f}(x[i], x[i]);")
        problems = msl_lint.lint_source(bare, "k.metal")
        assert len(problems) == 1 and f"bare {f}()" in problems[0], problems
