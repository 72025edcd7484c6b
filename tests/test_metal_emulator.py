"""The Metal emulator itself: its semantics are right, and it catches planted kernel bugs
(a missing barrier, a divergent barrier, an out-of-bounds read)."""

import struct

import pytest
import torch

from tests.metal_emu import (
    EmulatorError,
    TranslationError,
    call_plan,
    compile_cpp,
    load,
    load_source,
)

ORDERS = ["forward", "reverse", "shuffle"]


@pytest.fixture(scope="module")
def lib():
    return load("tests/metal_emu/kernels/selftest.metal")


def test_lists_entries_with_bindings(lib):
    assert "round_trip_half" in lib.kernels and "round_trip_bfloat" in lib.kernels
    e = lib.entries["histogram"]
    assert e.buffers() == {0: "keys", 1: "counts", 2: "total", 3: "p"}
    assert lib.entries["tg_reverse"].threadgroup_memory() == {0: "tile"}


@pytest.mark.parametrize("order", ORDERS)
def test_barrier_makes_threadgroup_memory_visible(lib, order):
    x = torch.randn(3 * 40)
    out = torch.empty_like(x)
    lib.run("tg_reverse", 3, 40, [x, out], [40 * 4], order=order, seed=7)
    torch.testing.assert_close(out, x.view(3, 40).flip(1).reshape(-1), rtol=0, atol=0)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_catches_missing_barrier(lib, order):
    x = torch.randn(64)
    out = torch.empty_like(x)
    lib.run("tg_reverse_no_barrier", 1, 64, [x, out], [64 * 4], order=order)
    assert not torch.equal(out, x.flip(0)), "a missing barrier went unnoticed"


def test_catches_missing_barrier_in_tree_reduction(lib):
    x = torch.rand(128)
    good, bad = torch.zeros(1), torch.zeros(1)
    for order in ORDERS:
        lib.run("tree_sum", 1, 128, [x, good], [128 * 4], order=order, seed=1)
        torch.testing.assert_close(good[0], x.sum())
    lib.run("tree_sum_missing_barrier", 1, 128, [x, bad], [128 * 4], order="forward")
    assert not torch.allclose(bad[0], x.sum())


def test_catches_divergent_barrier(lib):
    out = torch.zeros(32)
    with pytest.raises(EmulatorError, match=r"barrier divergence: threads \[16,.*returned"):
        lib.run("divergent_barrier", 1, 32, [out])


def test_catches_threads_at_different_barriers(lib):
    out = torch.zeros(32)
    where = "threadgroup_barrier at tests/metal_emu/kernels/selftest.metal"
    with pytest.raises(EmulatorError, match=f"barrier divergence: thread 0 waits at {where}:76"
                       f".* but thread 31 at {where}:78"):
        lib.run("two_barriers", 1, 32, [out])


def test_catches_divergent_simdgroup_op(lib):
    out = torch.zeros(32)
    with pytest.raises(EmulatorError, match="simdgroup divergence"):
        lib.run("divergent_simd", 1, 32, [out])


def test_catches_out_of_bounds_read(lib):
    x = torch.randn(96)
    out = torch.zeros(96)
    with pytest.raises(EmulatorError, match=r"out-of-bounds access to x: bytes \[384, 388\) "
                       r"of a 384-byte buffer.*thread \(31,0,0\)"):
        lib.run("neighbour_diff", 3, 32, [x, out])
    # the same kernel over one thread fewer stays in bounds
    lib.run("neighbour_diff", 1, 95, [x, out])
    torch.testing.assert_close(out[:95], x[1:] - x[:-1])


def test_out_of_bounds_on_views_and_threadgroup_memory(lib):
    # a view binds only its own extent, so reading past it is caught even inside the storage
    big = torch.randn(200)
    out = torch.zeros(64)
    with pytest.raises(EmulatorError, match="out-of-bounds access to x"):
        lib.run("neighbour_diff", 1, 64, [big[10:74], out])
    with pytest.raises(EmulatorError, match="out-of-bounds access to scratch"):
        lib.run("uses_tg_memory", 1, 64, [out], [48 * 4])
    with pytest.raises(EmulatorError, match="needs a multiple of 16"):
        lib.run("uses_tg_memory", 1, 63, [out], [63 * 4])
    with pytest.raises(EmulatorError, match="more than the 32 KiB"):
        lib.run("uses_tg_memory", 1, 64, [out], [32768, 16])
    with pytest.raises(EmulatorError, match=r"threadgroup\(0\) memory for parameter 'scratch'"):
        lib.run("uses_tg_memory", 1, 64, [out])


def test_unbound_and_short_buffers(lib):
    keys = torch.zeros(4, dtype=torch.int32)
    counts = torch.zeros(4, dtype=torch.int32)
    total = torch.zeros(1)
    with pytest.raises(EmulatorError, match=r"buffer\(3\) for parameter 'p' is not bound"):
        lib.run("histogram", 1, 4, [keys, counts, total])
    with pytest.raises(EmulatorError, match="holds 4 bytes, the kernel reads 8"):
        lib.run("histogram", 1, 4, [keys, counts, total, struct.pack("I", 4)])
    with pytest.raises(EmulatorError, match="empty grid"):
        lib.run("histogram", 0, 4, [keys, counts, total, struct.pack("If", 4, 1.0)])
    with pytest.raises(ValueError, match="contiguous"):
        lib.run("tg_reverse", 1, 4, [torch.zeros(4, 2)[:, 0], torch.zeros(4)], [16])


@pytest.mark.parametrize("threads", [32, 48, 70])
def test_simd_collectives(lib, threads):
    x = torch.randn(threads)
    out = torch.zeros(threads * 8)
    lib.run("simd_ops", 1, threads, [x, out], order="shuffle", seed=threads)
    got = out.view(threads, 8)
    for lo in range(0, threads, 32):
        g = x[lo : lo + 32]
        n = len(g)
        r = got[lo : lo + 32]
        torch.testing.assert_close(r[:, 0], g.sum().expand(n))
        torch.testing.assert_close(r[:, 1], g.max().expand(n))
        torch.testing.assert_close(r[:, 2], torch.cumsum(g, 0) - g)
        torch.testing.assert_close(r[:, 3], torch.cumsum(g, 0))
        # lanes past the end of a partial simdgroup read as NaN (undefined on a GPU)
        pad = torch.cat([g, torch.full((32 - n,), float("nan"))])
        down = torch.cat([pad[1:], pad[-1:]])[:n]
        torch.testing.assert_close(r[:, 4], down, equal_nan=True)
        torch.testing.assert_close(r[:, 6], pad.view(16, 2).flip(1).reshape(-1)[:n],
                                   equal_nan=True)
        torch.testing.assert_close(r[:, 5], g[0].expand(n))
        torch.testing.assert_close(r[:, 7], g.sum().expand(n))


def test_shuffle_from_inactive_lane_is_poison(lib):
    out = torch.zeros(40)
    lib.run("shuffle_inactive", 1, 40, [out])
    assert (out[:32] == 31).all() and out[32:].isnan().all()


def test_atomics(lib):
    keys = torch.randint(0, 5, (300,), dtype=torch.int32)
    counts = torch.zeros(5, dtype=torch.int32)
    total = torch.zeros(1)
    lib.run("histogram", 5, 64, [keys, counts, total, struct.pack("If", 300, 0.5)],
            order="shuffle")
    assert counts.tolist() == torch.bincount(keys, minlength=5).tolist()
    assert total.item() == 150.0


def test_half_and_bfloat_conversions_match_torch(lib):
    special = torch.tensor([0.0, -0.0, 65504.0, 65520.0, 65519.99, 6e-8, 3e-8, 2.98e-8, 1e-10,
                            float("inf"), -float("inf"), 1e30, 2.0**-24, 1.5 * 2.0**-24,
                            2.5 * 2.0**-24, 0.1, -3.3e38])
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    from_half = bits.view(torch.float16).float()
    from_bf = bits.view(torch.bfloat16).float()
    x = torch.cat([special, torch.randn(2000) * 10.0 ** torch.randint(-9, 6, (2000,)),
                   from_half[~from_half.isnan()], from_bf[~from_bf.isnan()]])
    x = torch.cat([x, torch.zeros((-x.numel()) % 50)])  # whole threadgroups of 50
    for name, dtype in [("round_trip_half", torch.float16), ("round_trip_bfloat", torch.bfloat16)]:
        y = torch.empty(x.shape, dtype=dtype)
        back = torch.empty_like(x)
        lib.run(name, x.numel() // 50, 50, [x, y, back])
        ref = x.to(dtype)
        assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), name
        assert torch.equal(back, ref.float())
    nan = torch.full((32,), float("nan"))
    y = torch.empty(32, dtype=torch.float16)
    lib.run("round_trip_half", 1, 32, [nan, y, torch.empty(32)])
    assert y.isnan().all()


def test_half_arithmetic_rounds_each_operation(lib):
    a = torch.randn(256).half()
    b = torch.randn(256).half()
    out = torch.empty_like(a)
    lib.run("half_madd", 4, 64, [a, b, out])
    assert torch.equal(out, (a * b) + 1.0)  # torch also rounds the product to half first


def test_builtin_positions_in_3d_grid(lib):
    tg, th = (3, 2, 2), (5, 4, 2)
    tpg = [t * h for t, h in zip(tg, th, strict=True)]
    out = torch.zeros(tpg[0] * tpg[1] * tpg[2] * 8, dtype=torch.int32)
    lib.run("positions", tg, th, [out], order="reverse")
    o = out.view(tpg[2], tpg[1], tpg[0], 8)
    for z, y, x in [(0, 0, 0), (3, 7, 14), (1, 5, 6)]:
        lx, ly, lz = x % 5, y % 4, z % 2
        index = lx + 5 * ly + 20 * lz
        assert o[z, y, x].tolist() == [
            x, y, z, lx + 100 * ly + 10000 * lz,
            x // 5 + 100 * (y // 4) + 10000 * (z // 2), 3 + 200 + 20000, index, index // 32]


def test_translation_errors():
    with pytest.raises(TranslationError, match="only <metal_stdlib> and the kernel's shared"):
        load_source('#include <metal_stdlib>\n#include <vector>\n', "bad_include")
    with pytest.raises(TranslationError, match='#include "foo.h" is not a file under'):
        load_source('#include <metal_stdlib>\n#include "foo.h"\n', "bad_include")
    with pytest.raises(TranslationError, match="threadgroup variables must be kernel parameters"):
        load_source("kernel void k(device float* x [[buffer(0)]]) {\n"
                    "  threadgroup float tile[32];\n  x[0] = tile[0];\n}\n", "bad_tg")
    with pytest.raises(TranslationError, match="parameter 'x' needs"):
        load_source("kernel void k(device float* x) { x[0] = 1; }\n", "bad_attr")


def test_compile_errors_point_at_the_metal_source():
    from tests.metal_emu import CompileError

    with pytest.raises(CompileError, match=r"broken\.metal:3"):
        load_source("kernel void k(device float* x [[buffer(0)]]) {\n"
                    "  float y = 1.0f;\n  x[0] = undefined_name;\n}\n", "broken")


def test_plans_from_cpp_headers(lib):
    # the plan comes from C++ (rlx/mps_launch.h vocabulary), exactly as the .mm host code gets it
    plans = compile_cpp("tests/metal_emu/kernels/selftest_plan.cpp")
    plan = call_plan(plans.plan_tg_reverse, 130, 64)
    assert plan.kernel == "tg_reverse" and plan.threadgroups == (3, 1, 1)
    assert plan.threads == (64, 1, 1) and plan.threadgroup_memory == [256]
    plan = call_plan(plans.plan_histogram, 300)
    keys = torch.randint(0, 7, (300,), dtype=torch.int32)
    counts = torch.zeros(7, dtype=torch.int32)
    total = torch.zeros(1)
    lib.run_plan(plan, {0: keys, 1: counts, 2: total}, order="shuffle", seed=5)
    assert counts.tolist() == torch.bincount(keys, minlength=7).tolist()
    assert total.item() == 300 * 0.25
    with pytest.raises(ValueError, match="rejected arguments"):
        call_plan(plans.plan_histogram, -1)


# ---- simdgroups run independently between threadgroup barriers -------------------------------


def test_simd_collective_waits_only_for_its_own_simdgroup(lib):
    counter = torch.zeros(1, dtype=torch.int32)
    tickets = torch.zeros(96, 2, dtype=torch.int32)
    lib.run("simd_tickets", 1, 96, [counter, tickets], order="forward")
    # simdgroup 0 finishes (both tickets) before simdgroup 1 starts: it ran ahead
    assert tickets[:32, 0].tolist() == list(range(32))
    assert tickets[:32, 1].tolist() == list(range(32, 64))
    assert tickets[32:64, 0].min().item() == 64
    lib.run("simd_tickets", 1, 96, [counter.zero_(), tickets], order="reverse")
    assert tickets[64:, 1].max().item() == 63 and tickets[:32, 0].min().item() == 128
    starts = set()
    for seed in range(6):  # shuffle interleaves simdgroups at collectives, differently per seed
        lib.run("simd_tickets", 1, 96, [counter.zero_(), tickets], order="shuffle", seed=seed)
        assert sorted(tickets.flatten().tolist()) == list(range(192))
        assert (tickets[:, 1] > tickets[:, 0]).all()
        starts.add(tuple(tickets[::32, 0].tolist()))
    assert len(starts) > 1
    again = torch.zeros_like(tickets)
    lib.run("simd_tickets", 1, 96, [counter.zero_(), again], order="shuffle", seed=5)
    assert torch.equal(again, tickets)  # a seed reproduces its schedule


@pytest.mark.parametrize("threads", [64, 70, 128])
def test_simd_reduction_through_threadgroup_memory(lib, threads):
    rows = 5
    x = torch.randn(rows, threads)
    nsg = (threads + 31) // 32
    want = x.sum(1, keepdim=True).expand(rows, nsg)
    for order in ORDERS:
        out = torch.full((rows, nsg), float("nan"))
        lib.run("simd_row_sums", 1, threads, [x, out, struct.pack("I", rows)], [16 * 4],
                order=order, seed=threads)
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize("threads", [64, 70, 128])
def test_catches_missing_barrier_after_simd_reduction(lib, threads):
    # The race needs a simdgroup to run ahead through its next simd_sum while the others still
    # read threadgroup memory: forward and reverse both do (lowest / highest simdgroup first).
    rows = 5
    x = torch.randn(rows, threads)
    nsg = (threads + 31) // 32
    want = x.sum(1, keepdim=True).expand(rows, nsg)
    for order in ["forward", "reverse"]:
        out = torch.full((rows, nsg), float("nan"))
        lib.run("simd_row_sums_missing_barrier", 1, threads, [x, out, struct.pack("I", rows)],
                [16 * 4], order=order)
        assert not torch.allclose(out, want), f"missing barrier went unnoticed ({order})"
    caught = 0
    for seed in range(4):
        out = torch.full((rows, nsg), float("nan"))
        lib.run("simd_row_sums_missing_barrier", 1, threads, [x, out, struct.pack("I", rows)],
                [16 * 4], order="shuffle", seed=seed)
        caught += not torch.allclose(out, want)
    assert caught > 0


# ---- watchdog --------------------------------------------------------------------------------


def test_watchdog_stops_an_infinite_loop(lib):
    out = torch.zeros(8)
    loop = r"loop at tests/metal_emu/kernels/selftest\.metal:\d+"
    with pytest.raises(EmulatorError, match=r"kernel spin_forever: watchdog: step budget of "
                       r"100000 exceeded after 100001 steps.*" + loop + r".*thread \(0,0,0\)"):
        lib.run("spin_forever", 1, 8, [out], max_steps=100_000)
    with pytest.raises(EmulatorError, match=r"kernel spin_forever: watchdog: time limit of "
                       r"0\.2\d* s exceeded"):
        lib.run("spin_forever", 2, 8, [out], timeout=0.2)


@pytest.mark.parametrize("order", ORDERS)
def test_watchdog_stops_a_spin_wait(lib, order):
    flag = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(EmulatorError, match=r"kernel spin_wait: watchdog: step budget.*"
                       r"thread \(0,0,0\)"):
        lib.run("spin_wait", 1, 40, [flag], order=order, max_steps=20_000)


def test_watchdog_lets_bounded_loops_finish(lib):
    out = torch.zeros(40, 3, dtype=torch.int32)
    lib.run("bounded_loops", 1, 40, [out], max_steps=10_000, timeout=30)
    tid = torch.arange(40)
    assert out[:, 0].tolist() == (tid + 3).tolist()
    assert out[:, 1].tolist() == torch.maximum(2 * ((tid + 1) // 2), torch.tensor(2)).tolist()
    assert out[:, 2].tolist() == [6 + (t).bit_length() for t in range(40)]
    with pytest.raises(ValueError, match="max_steps must be a positive int"):
        lib.run("bounded_loops", 1, 40, [out], max_steps=0)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        lib.run("bounded_loops", 1, 40, [out], timeout=-1)


# ---- vectors ---------------------------------------------------------------------------------


def _vector_ops_reference(x):
    v = x
    w = v[:, [3, 2, 1, 0]].clone()  # v.wzyx
    w[:, 0:2] = v[:, 2:3]  # w.xy = v.zz
    w[:, 2:4] += v[:, 0:2]  # w.zw += v.xy
    w[:, 0:2] *= 2  # w.yx *= 2
    c = v[:, [2, 1, 0]]  # v.bgr
    gt = v > 0
    r1 = w.clone()
    r1[:, 3] += c[:, 0] + c[:, 1] + x[:, 1]
    r2 = v.clamp(-0.5, 0.5)
    r2[:, 0:2] = v[:, :2] + (w[:, :2] - v[:, :2]) * 0.25
    r2[:, 2] = (torch.where(gt, v, 0).sum(1) + 100.0 * gt.all(1)
                + 1000.0 * (v[:, :3] < -1).any(1))
    return torch.stack([r1, r2], 1)


@pytest.mark.parametrize("kind", ["float", "half"])
def test_swizzles_comparisons_and_vector_math(lib, kind):
    x = torch.randn(64, 4)
    x[0] = torch.tensor([0.5, 1.0, 2.0, 3.0])  # all(v > 0)
    x[1, 0] = -3.0  # any(v.xyz < -1)
    if kind == "half":
        x = x.half().float()
    out = torch.zeros(64, 2, 4)
    lib.run(f"vector_ops_{kind}", 2, 32, [x, out], order="reverse")
    tol = 0 if kind == "float" else 2e-2
    torch.testing.assert_close(out, _vector_ops_reference(x), rtol=tol, atol=tol)
    assert out[0, 1, 2] > 100 and out[1, 1, 2] > 500


def test_swizzle_errors_are_compile_errors():
    from tests.metal_emu import CompileError

    with pytest.raises(CompileError, match="swizzle names a component this vector does not have"):
        load_source("using namespace metal;\nkernel void k(device float2* x [[buffer(0)]]) {\n"
                    "  x[0] = x[0].yz;\n}\n", "bad_swizzle")
    with pytest.raises(CompileError, match="a swizzle that is written to repeats a component"):
        load_source("using namespace metal;\nkernel void k(device float2* x [[buffer(0)]]) {\n"
                    "  float2 v = x[0];\n  v.xx = float2(1.0f);\n  x[0] = v;\n}\n",
                    "bad_swizzle_write")


# ---- barrier mutants (tests/metal_emu/mutants.py) --------------------------------------------

_TWO_BARRIERS = """#include <metal_stdlib>
using namespace metal;
// threadgroup_barrier(mem_flags::mem_threadgroup); in a comment is not a mutant
kernel void flip(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                 threadgroup float* t [[threadgroup(0)]],
                 uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  t[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = t[n - 1 - tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // not needed: nothing follows
}
"""

_FLIP_TEST = """import torch
from tests.metal_emu import load

def test_flip():
    x = torch.randn(64)
    out = torch.empty(64)
    load({path!r}).run("flip", 1, 64, [x, out], [256])
    assert torch.equal(out, x.flip(0))
"""


def test_barrier_mutants_find_the_barrier_tests_do_not_need(tmp_path):
    import io

    from tests.metal_emu.mutants import barrier_mutants, run

    mutants = barrier_mutants(_TWO_BARRIERS)
    assert [line for line, _ in mutants] == [8, 10]
    assert all(t.count("threadgroup_barrier") == 2 for _, t in mutants)  # comment + the other
    metal = tmp_path / "flip.metal"
    metal.write_text(_TWO_BARRIERS)
    (tmp_path / "test_flip.py").write_text(_FLIP_TEST.format(path=str(metal)))
    log = io.StringIO()
    assert run(metal, [str(tmp_path / "test_flip.py")], out=log) == {8: "killed",
                                                                      10: "survived"}
    assert "flip.metal:10: barrier removed -> survived" in log.getvalue()


def test_private_arrays_are_bounds_checked(lib):
    out = torch.zeros(6)
    four = struct.pack("I", 4)
    lib.run("private_arrays", 1, 6, [out, four, four], order="shuffle")
    tid = torch.arange(6.0)
    squares_dot_weights = 0 * 1 + 1 * 2 + 4 * 3 + 9 * 4
    want = tid + 1 + squares_dot_weights + torch.tensor([4.0, 5, 6])[tid.long() % 3] * 10
    torch.testing.assert_close(out, want)
    with pytest.raises(EmulatorError, match=r"out-of-bounds index 4 into private array 'sq' of "
                       r"4 elements.*thread \(0,0,0\)"):
        lib.run("private_arrays", 1, 6, [out, struct.pack("I", 5), four])
    # inside the helper the array is a `thread float*` that knows the array's extent
    with pytest.raises(EmulatorError, match=r"out-of-bounds access to sq: bytes \[16, 20\) of a "
                       r"16-byte buffer"):
        lib.run("private_arrays", 1, 6, [out, four, struct.pack("I", 5)])


def test_faults_in_a_kernel_thread_are_errors_not_crashes(lib):
    out = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(EmulatorError, match=r"kernel divide_by_zero: arithmetic fault \(SIGFPE\)"
                       r".*thread \(3,0,0\)"):
        lib.run("divide_by_zero", 1, 8, [out], order="reverse")
    lib.run("divide_by_zero", 1, 3, [out])  # the handlers are restored and work again
    assert out[:3].tolist() == [-33, -50, -100]
    with pytest.raises(EmulatorError, match=r"kernel huge_private_array: stack overflow: this "
                       r"thread's private memory.*256 KiB"):
        lib.run("huge_private_array", 1, 4, [torch.zeros(4)])
