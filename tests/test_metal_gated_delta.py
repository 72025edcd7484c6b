"""The gated delta rule Metal kernels (csrc/mps/kernels/gated_delta.metal), run on the CPU by
the Metal emulator through the same launch plans as the host code
(csrc/include/rlx/mps_gated_delta_plan.h), against the CPU op and the plain-PyTorch
reference: forward (o, final state, checkpoints) and backward (the whole packed buffer).

Nothing here runs on an Apple GPU; tests/test_mps_gated_delta.py does that on a Mac."""

import ctypes
import struct

import pytest
import torch

from rlx_torch.ops import reference
from rlx_torch.ops.gated_delta import unpack_gradients
from tests.metal_emu import EmulatorError, call_plan, compile_cpp, load

KERNELS = "csrc/mps/kernels/gated_delta.metal"
PLANS = "tests/test_metal_gated_delta_plans.cpp"
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# fp32 state throughout; half inputs only change how q, k, v, o and grad_o are stored.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def emu():
    return load(KERNELS), compile_cpp(PLANS)


class Problem:
    """One gated delta rule call: inputs, and the plan arguments the host code would derive."""

    def __init__(self, B, T, H, HV, K, V, dtype=torch.float32, per_channel=False,
                 cu_seqlens=None, initial_state=False, chunk=64, scale=None, seed=0):
        gen = torch.Generator().manual_seed(seed)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen)

        self.B, self.T, self.H, self.HV, self.K, self.V = B, T, H, HV, K, V
        self.dtype, self.chunk, self.per_channel = dtype, chunk, per_channel
        # l2-normalized q, k as in practice (keeps the recurrence stable: |k| = 1, beta < 1)
        self.q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
        self.k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(dtype)
        self.v = rnd(B, T, HV, V).to(dtype)
        gshape = (B, T, HV, K) if per_channel else (B, T, HV)
        self.g = torch.nn.functional.logsigmoid(rnd(*gshape) + 2.0)
        self.beta = torch.rand(B, T, HV, generator=gen)
        self.cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64)
        self.N = B if cu_seqlens is None else len(cu_seqlens) - 1
        self.h0 = rnd(self.N, HV, K, V) * 0.5 if initial_state else None
        self.scale = K**-0.5 if scale is None else scale
        lengths = [T] * B if cu_seqlens is None else [
            cu_seqlens[i + 1] - cu_seqlens[i] for i in range(self.N)]
        self.max_chunks = max([(n + chunk - 1) // chunk for n in lengths], default=0)
        self.keeps_vw = chunk > 0 and not per_channel  # rlx::gdn_keeps_vw

    def plan_args(self, has_grad_final, max_threads=1024, budget=128 << 20):
        scale_bits = struct.unpack("<I", struct.pack("<f", self.scale))[0]
        return [self.B, self.T, self.H, self.HV, self.K, self.V, self.N, self.max_chunks,
                self.chunk, int(self.per_channel), int(self.cu is not None),
                int(self.h0 is not None), int(has_grad_final), scale_bits,
                DTYPE_CODE[self.dtype], max_threads, budget]

    def cpu_forward(self):
        return torch.ops.rlx.gated_delta_fwd(self.q, self.k, self.v, self.g, self.beta,
                                             self.scale, self.h0, self.cu, self.chunk)[:3]

    def cpu_backward(self, checkpoints, grad_o, grad_final):
        return torch.ops.rlx.gated_delta_bwd(self.q, self.k, self.v, self.g, self.beta,
                                             self.scale, self.h0, self.cu, checkpoints, grad_o,
                                             grad_final, self.chunk)

    def _dummy(self, t):
        return t if t is not None else torch.zeros(2, dtype=torch.int64)

    def emu_forward(self, emu, order="forward", seed=0, max_threads=1024):
        lib, plans = emu
        plan = call_plan(plans.plan_gdn_forward, *self.plan_args(False, max_threads))
        slots = torch.ops.rlx.gated_delta_checkpoint_slots(self.N, self.B * self.T, self.chunk)
        o = torch.full_like(self.v, float("nan"))
        final = torch.full((self.N, self.HV, self.K, self.V), float("nan"))
        ckpt = torch.full((slots, self.HV, self.K, self.V), float("nan"))
        vw = torch.full(self.v.shape if self.keeps_vw else (2,), float("nan"))
        if 0 not in plan.threadgroups:
            lib.run_plan(plan, {0: self.q, 1: self.k, 2: self.v, 3: self.g, 4: self.beta,
                                5: self._dummy(self.h0), 6: self._dummy(self.cu), 7: o,
                                8: final, 9: ckpt, 11: vw}, order=order, seed=seed)
        self.emu_vw = vw if self.keeps_vw else None
        return o, final, ckpt

    def emu_backward(self, emu, checkpoints, grad_o, grad_final, order="forward", seed=0,
                     max_threads=1024, budget=128 << 20):
        lib, plans = emu
        args = self.plan_args(grad_final is not None, max_threads, budget)
        sizes = (ctypes.c_int64 * 6)()
        plans.gdn_backward_sizes.restype = ctypes.c_int
        assert plans.gdn_backward_sizes((ctypes.c_int64 * len(args))(*args), len(args),
                                        sizes) == 0
        n_windows, partial_floats, carry_floats = sizes[0], sizes[1], sizes[2]
        layout = torch.ops.rlx.gated_delta_bwd_layout(
            self.B, self.T, self.H, self.HV, self.K, self.V, self.N, self.per_channel,
            self.h0 is not None)
        packed = torch.full((layout[-1],), float("nan"))  # every element must be written
        partials = torch.full((max(partial_floats, 1),), float("nan"))
        carry = torch.full((max(carry_floats, 1),), float("nan"))
        common = {0: self.q, 1: self.k, 2: self.v, 3: self.g, 4: self.beta,
                  5: self._dummy(self.cu), 6: checkpoints, 7: grad_o,
                  8: self._dummy(grad_final), 9: packed, 10: partials, 11: carry}
        for w in range(n_windows):
            bwd = call_plan(plans.plan_gdn_backward, *args, w)
            lib.run_plan(bwd, common, order=order, seed=seed + w)
            red = call_plan(plans.plan_gdn_reduce, *args, w)
            lib.run_plan(red, {0: self._dummy(self.cu), 1: partials, 2: packed},
                         order=order, seed=seed + w)
        return packed, sizes


def close(actual, expected, tol, what):
    actual, expected = actual.double(), expected.double()
    assert not actual.isnan().any(), f"{what}: NaN (an element was never written)"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    bound = tol * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def written_slots(p):
    """Checkpoint slots the forward op specifies (others are unspecified)."""
    lengths = ([p.T] * p.B if p.cu is None else (p.cu[1:] - p.cu[:-1]).tolist())
    bos = 0
    slots = []
    for n, length in enumerate(lengths):
        base = n + bos // p.chunk
        slots += [base + j for j in range((length + p.chunk - 1) // p.chunk)]
        bos += length
    return slots


def check_forward(emu, p, order="forward", seed=0, max_threads=1024):
    o, final, ckpt = p.emu_forward(emu, order, seed, max_threads)
    o_ref, final_ref, ckpt_ref = p.cpu_forward()
    tol = TOL[p.dtype]
    close(o, o_ref, tol, "o")
    close(final, final_ref, 2e-5, "final_state")
    slots = written_slots(p)
    close(ckpt[slots], ckpt_ref[slots], 2e-5, "checkpoints")
    unused = sorted(set(range(ckpt.shape[0])) - set(slots))
    assert torch.equal(ckpt[unused], torch.zeros_like(ckpt[unused])), "unused slots not zero"
    # vw: the same output as the CPU forward's, full-size exactly when it keeps one
    vw_ref = torch.ops.rlx.gated_delta_fwd(p.q, p.k, p.v, p.g, p.beta, p.scale, p.h0, p.cu,
                                           p.chunk)[3]
    assert (vw_ref.shape == p.v.shape) == p.keeps_vw, vw_ref.shape
    if p.keeps_vw:
        close(p.emu_vw, vw_ref, 2e-5, "vw")
    return o, final, ckpt_ref


def check_backward(emu, p, grad_final=True, order="forward", seed=0, budget=128 << 20,
                   max_threads=1024):
    _, final_ref, ckpt_ref = p.cpu_forward()
    gen = torch.Generator().manual_seed(seed + 1)
    grad_o = torch.randn(p.v.shape, generator=gen).to(p.dtype)
    gfin = torch.randn(final_ref.shape, generator=gen) if grad_final else None
    packed, sizes = p.emu_backward(emu, ckpt_ref, grad_o, gfin, order, seed,
                                   max_threads, budget)
    packed_ref = p.cpu_backward(ckpt_ref, grad_o, gfin)
    views = unpack_gradients(packed, p.q, p.v, p.g, p.h0, p.cu)
    refs = unpack_gradients(packed_ref, p.q, p.v, p.g, p.h0, p.cu)
    for name, a, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), views, refs, strict=True):
        if e is not None:
            close(a, e, 5e-5, name)
    assert packed.numel() == packed_ref.numel()
    return sizes


# ---- forward --------------------------------------------------------------------------------

FORWARD_CASES = {
    "basic": dict(B=2, T=9, H=1, HV=1, K=16, V=8),
    "odd_kv": dict(B=1, T=13, H=2, HV=2, K=37, V=5, chunk=4),
    "gva": dict(B=1, T=7, H=1, HV=3, K=33, V=6, initial_state=True),
    "k256": dict(B=1, T=3, H=1, HV=1, K=256, V=3, initial_state=True),
    "per_channel": dict(B=1, T=11, H=1, HV=2, K=40, V=7, per_channel=True, chunk=5),
    "varlen": dict(B=1, T=17, H=1, HV=2, K=20, V=9, cu_seqlens=[0, 5, 5, 17],
                   initial_state=True, chunk=4),
}


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_forward_matches_cpu_op(emu, case):
    check_forward(emu, Problem(**FORWARD_CASES[case], seed=len(case)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_forward_half_types(emu, dtype):
    p = Problem(B=1, T=10, H=1, HV=2, K=35, V=6, dtype=dtype, initial_state=True, chunk=3)
    check_forward(emu, p)


def test_forward_matches_reference(emu):
    p = Problem(B=1, T=12, H=2, HV=4, K=24, V=10, per_channel=True,
                cu_seqlens=[0, 7, 12], initial_state=True, chunk=4, scale=0.3)
    o, final, _ = p.emu_forward(emu, order="shuffle", seed=5)
    o_ref, final_ref = reference.gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, p.scale, p.h0,
                                                  True, p.cu)
    close(o, o_ref, 2e-5, "o")
    close(final, final_ref, 2e-5, "final_state")


def test_forward_empty_batch_dispatches_nothing(emu):
    p = Problem(B=0, T=5, H=1, HV=1, K=8, V=4)
    o, final, _ = p.emu_forward(emu)
    assert o.numel() == 0 and final.numel() == 0


def test_zero_length_sequences_pass_the_state_through(emu):
    p = Problem(B=2, T=0, H=1, HV=2, K=8, V=4, initial_state=True)
    o, final, _ = p.emu_forward(emu)
    assert o.numel() == 0 and torch.equal(final, p.h0)
    check_backward(emu, p)  # dstate = grad_final_state


# ---- backward -------------------------------------------------------------------------------

BACKWARD_CASES = {
    "basic": dict(B=2, T=9, H=1, HV=1, K=16, V=8, chunk=4),
    "odd_kv_state": dict(B=1, T=11, H=1, HV=1, K=37, V=9, initial_state=True, chunk=4),
    "gva": dict(B=1, T=6, H=2, HV=4, K=12, V=5, initial_state=True, chunk=4),
    "per_channel": dict(B=1, T=8, H=1, HV=2, K=40, V=6, per_channel=True, chunk=3,
                        initial_state=True),
    "varlen": dict(B=1, T=13, H=1, HV=2, K=20, V=19, cu_seqlens=[0, 6, 6, 13],
                   initial_state=True, chunk=4),
    "vblocks_gva_per_channel": dict(B=2, T=5, H=1, HV=2, K=70, V=21, per_channel=True,
                                    chunk=64),
    "k256": dict(B=1, T=3, H=1, HV=1, K=256, V=2, per_channel=True, chunk=2,
                 initial_state=True),
}


@pytest.mark.parametrize("case", sorted(BACKWARD_CASES))
def test_backward_matches_cpu_op(emu, case):
    check_backward(emu, Problem(**BACKWARD_CASES[case], seed=len(case)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_half_types(emu, dtype):
    p = Problem(B=1, T=7, H=1, HV=2, K=33, V=5, dtype=dtype, initial_state=True, chunk=3)
    check_backward(emu, p)


def test_backward_empty_batch(emu):
    p = Problem(B=0, T=4, H=1, HV=1, K=8, V=4)
    packed, sizes = p.emu_backward(emu, torch.zeros(0, 1, 8, 4), torch.zeros(0, 4, 1, 4), None)
    assert packed.numel() == 0 and sizes[0] == 0


def test_qwen_head_size(emu):
    # K = V = 128 as in Qwen3-Next / Qwen3.5: 6 simdgroups, 22 V-blocks, sub-chunks of 8.
    p = Problem(B=1, T=40, H=1, HV=2, K=128, V=128, chunk=16, initial_state=True,
                dtype=torch.bfloat16)
    check_forward(emu, p)
    sizes = check_backward(emu, p)
    assert (sizes[3], sizes[4]) == (6, 8)


def test_backward_without_grad_final_state(emu):
    check_backward(emu, Problem(B=1, T=8, H=1, HV=1, K=8, V=4, chunk=3), grad_final=False)


def test_backward_windows_carry_the_state(emu):
    # A tiny partial budget forces one chunk per window: dS crosses windows through `carry`,
    # and sequences of different lengths join at different windows.
    p = Problem(B=1, T=14, H=1, HV=2, K=9, V=5, cu_seqlens=[0, 3, 14], initial_state=True,
                chunk=2, seed=3)
    sizes = check_backward(emu, p, budget=1)
    assert sizes[0] == 6 and sizes[5] == 1  # windows, chunks per window


def test_backward_small_threadgroups(emu):
    # A pipeline limited to 64 threads: 2 simdgroups per threadgroup, so 3 V-blocks of V=5.
    p = Problem(B=1, T=6, H=1, HV=1, K=10, V=5, chunk=4, initial_state=True)
    sizes = check_backward(emu, p, max_threads=64)
    assert sizes[3] == 2
    check_forward(emu, p, max_threads=64)


@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_schedule_orders_do_not_change_results(emu, order):
    # Threads resumed in other orders between barriers: a missing barrier would show here.
    p = Problem(B=1, T=7, H=1, HV=2, K=36, V=7, per_channel=True, initial_state=True, chunk=3)
    check_forward(emu, p, order=order, seed=11)
    check_backward(emu, p, order=order, seed=11)


def test_backward_is_deterministic(emu):
    p = Problem(B=1, T=6, H=1, HV=2, K=20, V=9, chunk=4, initial_state=True)
    _, final_ref, ckpt = p.cpu_forward()
    grad_o = torch.randn(p.v.shape)
    a, _ = p.emu_backward(emu, ckpt, grad_o, None, order="shuffle", seed=1)
    b, _ = p.emu_backward(emu, ckpt, grad_o, None, order="shuffle", seed=2)
    assert torch.equal(a, b)


def test_kernel_bounds_are_checked(emu):
    # A checkpoint buffer one slot short must be reported, not read past.
    p = Problem(B=1, T=6, H=1, HV=1, K=8, V=4, chunk=2)
    _, _, ckpt = p.cpu_forward()
    with pytest.raises(EmulatorError, match="out-of-bounds"):
        p.emu_backward(emu, ckpt[:-2].contiguous(), torch.randn(p.v.shape), None)


# ---- launch plans ---------------------------------------------------------------------------


def backward_sizes(plans, p, max_threads=1024, budget=128 << 20):
    args = p.plan_args(True, max_threads, budget)
    out = (ctypes.c_int64 * 6)()
    assert plans.gdn_backward_sizes((ctypes.c_int64 * len(args))(*args), len(args), out) == 0
    return dict(zip(("windows", "partial_floats", "carry_floats", "simdgroups", "sub",
                     "window_chunks"), out, strict=True))


@pytest.mark.parametrize("K", [1, 31, 64, 128, 200, 256])
@pytest.mark.parametrize("per_channel", [False, True])
def test_backward_plan_fits_threadgroup_memory(emu, K, per_channel):
    _, plans = emu
    p = Problem(B=1, T=300, H=1, HV=2, K=K, V=128, per_channel=per_channel)
    plan = call_plan(plans.plan_gdn_backward, *p.plan_args(True), 0)
    sizes = backward_sizes(plans, p)
    kp = 32 * ((K + 31) // 32)
    row = 2 * kp + (kp if per_channel else 1) + 1
    nsg, sub = sizes["simdgroups"], sizes["sub"]
    assert plan.threads == (32 * nsg, 1, 1)
    assert plan.threadgroup_memory[0] >= 4 * (sub * nsg * kp + nsg * row)
    assert plan.threadgroup_memory[0] <= 32768 and plan.threadgroup_memory[0] % 16 == 0
    assert sub >= 8  # the recomputation stays bounded: C (C / sub + 1) / 2 steps per chunk
    assert plan.threadgroups == ((128 + nsg - 1) // nsg, 2, 1)


def test_backward_plan_windows_bound_the_partials(emu):
    _, plans = emu
    p = Problem(B=3, T=1000, H=1, HV=2, K=64, V=64, chunk=64)
    one = backward_sizes(plans, p)
    assert one["windows"] == 1 and one["carry_floats"] == 0
    budget = 4 << 20
    many = backward_sizes(plans, p, budget=budget)
    assert many["windows"] > 1 and many["partial_floats"] * 4 <= budget
    assert many["carry_floats"] == 3 * 2 * 64 * 64
    assert many["windows"] == -(-p.max_chunks // many["window_chunks"])


def test_forward_plan_respects_the_pipeline_thread_limit(emu):
    _, plans = emu
    p = Problem(B=2, T=3, H=1, HV=3, K=8, V=10)
    assert call_plan(plans.plan_gdn_forward, *p.plan_args(False, 1024)).threads == (128, 1, 1)
    plan = call_plan(plans.plan_gdn_forward, *p.plan_args(False, 32))
    assert plan.threads == (32, 1, 1) and plan.threadgroups == (10, 3, 2)


# ---- random sweep ---------------------------------------------------------------------------


def random_problem(seed):
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    def between(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    H, G = between(1, 2), pick(1, 2, 3)
    cu = None
    B, T = between(1, 2), between(0, 19)
    if pick(False, True):
        cuts = sorted(between(0, T) for _ in range(between(0, 3)))
        cu, B = [0, *cuts, T], 1
    return Problem(B=B, T=T, H=H, HV=H * G, K=pick(1, between(2, 70), 129, 256),
                   V=between(1, 23), dtype=pick(torch.float32, torch.float16, torch.bfloat16),
                   per_channel=pick(False, True), cu_seqlens=cu, initial_state=pick(False, True),
                   chunk=pick(1, between(2, 7), 64), scale=pick(None, 0.7), seed=seed)


@pytest.mark.parametrize("seed", range(10))
def test_random_shapes(emu, seed):
    p = random_problem(seed)
    order = ("forward", "reverse", "shuffle")[seed % 3]
    check_forward(emu, p, order=order, seed=seed)
    check_backward(emu, p, grad_final=seed % 2 == 0, order=order, seed=seed,
                   budget=(128 << 20) if seed % 4 else 1)


@pytest.mark.parametrize("max_threads", [64, 1024])
def test_these_tests_catch_the_second_barrier_removed(emu, max_threads):
    # Planted bug: the file's second threadgroup_barrier (gated_delta_bwd's "red is rewritten
    # next step") is removed from a copy of the source. The forward kernel has no barrier.
    # Without it a simdgroup that runs ahead through its next simd_sum overwrites its row of
    # `red` while other simdgroups still add up the current step's rows.
    from pathlib import Path

    from tests.metal_emu import REPO, load_source

    barrier = "threadgroup_barrier(mem_flags::mem_threadgroup);"
    text = (Path(REPO) / KERNELS).read_text()
    second = text.index(barrier, text.index(barrier) + len(barrier))
    assert text.rfind("kernel void", 0, second) == text.index("kernel void gated_delta_bwd(")
    lib = load_source(text[:second] + text[second + len(barrier):], "gated_delta_no_barrier_2")
    p = Problem(B=1, T=6, H=1, HV=1, K=10, V=5, chunk=4, initial_state=True)
    for order in ["forward", "reverse", "shuffle"]:
        check_backward(emu, p, order=order, max_threads=max_threads)  # the real kernel passes
        with pytest.raises((AssertionError, EmulatorError)):
            check_backward((lib, emu[1]), p, order=order, max_threads=max_threads)
