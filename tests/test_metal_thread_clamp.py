"""The codebook launch plans under a pipeline limit below the kernels' preferred 128/256
threads per threadgroup (maxTotalThreadsPerThreadgroup drops for register-heavy kernels):
every plan stays within the limit in whole simdgroups, still covers the whole output, and a
clamped plan computes the same result in the emulator. The host code on the mock runtime
(tests/test_metal_host_mock.py::test_pipelines_with_few_threads) checks the same end to end,
gated delta rule included."""

import pytest
import torch

from tests.metal_emu import call_plan, compile_cpp, load
from tests.test_metal_codebook_emulator import make_inputs

LIMITS = [32, 64, 96, 128, 256, 1024]


@pytest.fixture(scope="module")
def plans():
    return compile_cpp("tests/metal_emu/plans/codebook_plans.cpp")


def _shape(batch, index_bytes=1):  # rows, K, N, groups, M, E, D, scales, bias, dtype, index bytes
    return [batch, 48, 37, 6, 2, 16, 8, 1, 1, 0, index_bytes]


@pytest.mark.parametrize("index_bytes", [1, 2], ids=["uint8", "16bit"])
@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("batch", [3, 40])
def test_plans_stay_within_the_limit(plans, batch, limit, index_bytes):
    s = _shape(batch, index_bytes)
    launches = {
        "forward": call_plan(plans.plan_codebook_forward, *s, 0, limit),
        "dx": call_plan(plans.plan_codebook_dx, *s, limit),
        "dscale": call_plan(plans.plan_codebook_dscale_dbias, *s, 1, 1, limit),
    }
    if index_bytes == 2:  # grad_codebook of 16-bit indices: codebook_sorted.metal
        launches["sorted"] = call_plan(plans.plan_codebook_dcodebook_sorted, *s, limit)
    else:
        launches["reduce"] = call_plan(plans.plan_codebook_dcodebook_reduce, *s, limit)
    for name, p in launches.items():
        threads = p.threads[0] * p.threads[1] * p.threads[2]
        assert threads <= limit and threads % 32 == 0, (name, p.threads)
    fwd = launches["forward"]
    assert ("_u16_" in fwd.kernel) == (index_bytes == 2)
    assert ("_u16_" in launches["dx"].kernel) == (index_bytes == 2)
    if limit < 256:  # the tiled kernels need 256 threads: the matrix-vector ones take over
        assert "_mv_" in fwd.kernel and "_mv_" in launches["dx"].kernel
        simdgroups = fwd.threads[0] // 32
        assert fwd.threadgroups[0] * simdgroups * 4 >= 37 and fwd.threadgroups[1] == batch
    if index_bytes == 2:  # one thread per (key, 8-wide chunk of an entry)
        assert launches["sorted"].threadgroups[0] * launches["sorted"].threads[0] >= 2 * 16 * 1
    else:
        assert launches["reduce"].threadgroups[0] * launches["reduce"].threads[0] >= 2 * 16 * 8
    assert launches["dscale"].threadgroups[0] * launches["dscale"].threads[0] >= 37


@pytest.mark.parametrize("limit", [32, 64])
def test_a_clamped_forward_plan_computes_the_same(plans, limit):
    lib = load("csrc/mps/kernels/codebook.metal")
    x, indices, codebook, scales, bias = make_inputs(40, 37, 6, 8, 2, 16, torch.float32, seed=5)
    want = torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
    plan = call_plan(plans.plan_codebook_forward, 40, 48, 37, 6, 2, 16, 8, 1, 1, 0, 1, 0,
                     limit)
    out = torch.empty(40, 37)
    lib.run_plan(plan, {0: x, 1: indices.contiguous(), 2: codebook.contiguous(), 3: scales,
                        4: bias, 5: out}, order="shuffle", seed=limit)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
