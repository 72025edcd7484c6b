"""The MSL lint (tools/msl_lint.py) over every Metal source, and proof that it rejects each
construct it is meant to reject. Also checks the generated header that embeds the sources."""

import glob
import os
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
         "only <metal_stdlib> may be included"),
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


def test_embedded_header_holds_every_kernel_file(tmp_path):
    out = embed_metal.generate(ROOT, str(tmp_path))
    text = (tmp_path / "rlx" / "mps_kernels_embedded.h").read_text()
    assert out == str(tmp_path)
    kernel_files = embed_metal.kernel_files(ROOT)
    assert f"kNumSources = {len(kernel_files)};" in text
    for path in kernel_files:
        with open(path) as f:
            assert f.read() in text
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
