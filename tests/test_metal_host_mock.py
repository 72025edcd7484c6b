"""The Metal host code (csrc/mps/*.mm) run on Linux: built with clang against the mock Metal
runtime, the mock of PyTorch's MPS stream and the mock MPS device of tests/metal_emu/mock
(see tests/metal_emu/host.py), every dispatch executed by the emulator. The op-level checks of
the MPS test modules run here end to end, and the tests below pin down the host code's
contract with Metal and PyTorch: which encoder it uses, when it commits, its autorelease
pools, its compile options and its threadgroup sizes.

Needs clang++, libobjc and libBlocksRuntime (scripts/test.sh installs them): without them the
test fails in CI (CI=true) and skips locally."""

import os
import sys

import pytest
import torch

import tests.test_metal_mps_codebook as mps_codebook
import tests.test_metal_mps_gated_delta as mps_gdn
from tests.metal_emu import host
from tests.test_metal_codebook_emulator import make_inputs, make_inputs16
from tests.test_metal_gated_delta import Problem

# The op-level checks of the MPS test modules, run here on the mock device. Left to the real
# device: opcheck (FakeTensor's MPS paths) and the autograd entry points (the autograd engine
# asks torch's MPS hooks for the accelerator, and a CPU build of torch has none).
test_codebook_forward_matches_cpu = mps_codebook.test_forward_matches_cpu
test_codebook_backward_matches_cpu = mps_codebook.test_backward_matches_cpu
test_codebook_views_bind_at_their_storage_offset = (
    mps_codebook.test_views_bind_at_their_storage_offset)
test_codebook_empty_batch_and_errors = mps_codebook.test_empty_batch_and_errors
test_codebook_16bit_forward_and_backward_match_cpu = (
    mps_codebook.test_16bit_forward_and_backward_match_cpu)
test_gdn_forward_matches_cpu = mps_gdn.test_forward_matches_cpu
test_gdn_backward_matches_cpu = mps_gdn.test_backward_matches_cpu
test_gdn_non_contiguous_inputs = mps_gdn.test_non_contiguous_inputs_and_cpu_cu_seqlens
test_gdn_bad_inputs_raise_errors = mps_gdn.test_bad_inputs_raise_errors_naming_the_argument
test_gdn_checkpoint_tag = mps_gdn.test_backward_rejects_checkpoints_of_another_forward
test_gdn_malformed_backward_inputs = (
    mps_gdn.test_malformed_backward_inputs_get_the_shared_messages)
test_gdn_vw_is_the_cpu_forwards = mps_gdn.test_vw_is_the_cpu_forwards
test_gdn_l2norm_eps_matches_cpu = mps_gdn.test_l2norm_eps_matches_cpu
test_gdn_l2norm_eps_gradient_matches_float64_reference = (
    mps_gdn.test_l2norm_eps_gradient_matches_float64_reference)

MTL_LANGUAGE_VERSION_3_1 = (3 << 16) + 1
MTL_MATH_MODE_SAFE = 0
MTL_MATH_FP_FUNCTIONS_PRECISE = 1


def _require_tools():
    if sys.platform == "darwin":
        pytest.skip("on macOS the host code runs on the real Metal (tests/test_metal_mps_*.py)")
    missing = host.missing_tools()
    if missing:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the mock-runtime host tests need {', '.join(missing)} in CI")
        pytest.skip(f"not installed: {', '.join(missing)} (the CI run installs them)")


@pytest.fixture(scope="module")
def rt():
    _require_tools()
    return host.load()


@pytest.fixture(autouse=True)
def fresh_stream(rt):
    """Each test starts on an idle stream, as torch >= 2.9, with 1024-thread pipelines."""
    rt.reset()
    rt.set_torch_mode(209)
    rt.clear_max_threads()
    yield
    rt.clear_max_threads()
    assert rt.last_violation() == "" or rt.counters()["violations"] == 0, rt.last_violation()


def _codebook_case(batch, dtype=torch.float32, seed=0):
    return make_inputs(batch, 21, 6, 8, 2, 16, dtype, seed=seed)


def _close(got, want, tol):
    got, want = got.cpu().double(), want.double()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= tol * max(1.0, want.abs().max().item() if want.numel() else 0.0), err


def _mps(ts):
    return [None if t is None else t.to("mps") for t in ts]


def test_mock_rejects_a_second_encoder_on_legacy_torch(rt):
    """The mock models both behaviours of torch::mps::get_command_buffer(): with torch 2.5-2.8
    a new encoder on it next to PyTorch's open one breaks Metal's rule; from 2.9 it works."""
    rt.set_torch_mode(205)
    rt.pytorch_kernel()
    assert rt.coalescing_open()
    err = rt.encode_on_own_encoder()
    assert err is not None and "already encoding to this command buffer" in err
    rt.reset()
    rt.set_torch_mode(209)
    rt.pytorch_kernel()
    assert rt.encode_on_own_encoder() is None
    assert not rt.coalescing_open()


@pytest.mark.parametrize("torch_mode", [205, 209], ids=["torch2.5-2.8", "torch2.9+"])
@pytest.mark.parametrize("batch", [3, 40], ids=["matvec", "tiled"])
def test_ops_right_after_a_pytorch_kernel(rt, torch_mode, batch):
    """PyTorch's Metal kernels leave their compute encoder open; ours must encode correctly
    behind them with every torch version (the crash of torch 2.5-2.8 lived here)."""
    rt.set_torch_mode(torch_mode)
    x, indices, codebook, scales, bias = _codebook_case(batch, seed=batch)
    want = torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
    xm, im, cm, sm, bm = _mps([x, indices, codebook, scales, bias])
    y = xm * 1  # a PyTorch kernel
    assert rt.coalescing_open()
    got = torch.ops.rlx.codebook_matmul(y, im, cm, sm, bm)
    assert rt.counters()["violations"] == 0, rt.last_violation()
    _close(got, want, 1e-5)

    p = Problem(B=1, T=19, H=1, HV=2, K=16, V=8, chunk=8, seed=2)
    ref = torch.ops.rlx.gated_delta_fwd(p.q, p.k, p.v, p.g, p.beta, p.scale, None, None, 8)
    q = p.q.to("mps") + 0  # again behind a PyTorch kernel
    assert rt.coalescing_open()
    out = torch.ops.rlx.gated_delta_fwd(q, *_mps([p.k, p.v, p.g, p.beta]), p.scale, None, None, 8)
    _close(out[0], ref[0], 1e-5)


def test_ops_commit_nothing(rt):
    """Like PyTorch's kernels, ours leave committing to PyTorch: no command buffer per op."""
    x, indices, codebook, scales, bias = _mps(_codebook_case(40))
    torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
    p = Problem(B=1, T=9, H=1, HV=2, K=16, V=8, chunk=4, seed=1)
    args = _mps([p.q, p.k, p.v, p.g, p.beta])
    _, _, ckpt, _ = torch.ops.rlx.gated_delta_fwd(*args, p.scale, None, None, 4)
    grad_o = args[2] * 1
    c = rt.counters()
    assert c["commits"] == 0 and c["user_commits"] == 0, c
    assert rt.coalescing_open()  # our dispatches went into PyTorch's encoder
    torch.ops.rlx.gated_delta_bwd(*args, p.scale, None, None, ckpt, grad_o, None, 4)
    c = rt.counters()
    assert c["dispatches"] >= 4
    # The backward reads the checkpoints' 4-byte tag back to the host before it encodes
    # (a PyTorch copy, so PyTorch commits once); it commits nothing of its own.
    assert c["commits"] == 1 and c["user_commits"] == 0, c


def test_objects_are_autoreleased_only_inside_pools(rt):
    """setup.py compiles without ARC: every autoreleased object (strings when building
    pipelines, encoders) must land in a pool of ours, or it is never freed on a Mac."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x, indices, codebook, scales, bias = _mps(_codebook_case(40, dtype))
        torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
        torch.ops.rlx.codebook_matmul(x[:3], indices, codebook, scales, bias)
    assert rt.counters()["autoreleased_without_pool"] == 0


def test_library_compile_options(rt):
    """The language version is explicit (3.1: the bfloat kernels), and math is IEEE-safe with
    precise functions (macOS 15's default would be fast functions)."""
    x, indices, codebook, scales, bias = _mps(_codebook_case(3))
    torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
    rec = rt.compile_record()
    assert rec["libraries"] >= 1
    assert rec["language_version_set"] and rec["language_version"] == MTL_LANGUAGE_VERSION_3_1
    assert rec["math_mode"] == MTL_MATH_MODE_SAFE
    assert rec["fp_functions"] == MTL_MATH_FP_FUNCTIONS_PRECISE


@pytest.mark.parametrize("max_threads", [32, 64, 96])
def test_pipelines_with_few_threads(rt, max_threads):
    """Plans clamp threadgroups to the pipeline's maxTotalThreadsPerThreadgroup (which a
    register-heavy kernel may lower below 256) instead of failing."""
    rt.set_max_threads(max_threads)
    x, indices, codebook, scales, _ = _codebook_case(40, seed=max_threads)
    grad_out = torch.randn(40, 21)
    mask = [True, True, True, True]
    want = torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)
    got = torch.ops.rlx.codebook_matmul_backward(*_mps([grad_out, x, indices, codebook, scales]),
                                                 mask)
    for g, w in zip(got, want, strict=True):
        _close(g, w, 1e-4)
    fwd = torch.ops.rlx.codebook_matmul(*_mps([x, indices, codebook, scales]), None)
    _close(fwd, torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, None), 1e-5)

    # 16-bit indices: the _u16 kernels and codebook_sorted.metal's grad_codebook
    x, indices, codebook, scales, _ = make_inputs16(40, 21, 6, 8, 2, 300, torch.float32,
                                                    seed=max_threads)
    want = torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)
    got = torch.ops.rlx.codebook_matmul_backward(*_mps([grad_out, x, indices, codebook, scales]),
                                                 mask)
    for g, w in zip(got, want, strict=True):
        _close(g, w, 1e-4)
    fwd = torch.ops.rlx.codebook_matmul(*_mps([x, indices, codebook, scales]), None)
    _close(fwd, torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, None), 1e-5)

    p = Problem(B=1, T=21, H=1, HV=2, K=40, V=12, chunk=8, seed=3)
    _, _, ckpt, _ = torch.ops.rlx.gated_delta_fwd(p.q, p.k, p.v, p.g, p.beta, p.scale, None,
                                                  None, 8)
    grad_o = torch.randn(p.v.shape)
    ref = torch.ops.rlx.gated_delta_bwd(p.q, p.k, p.v, p.g, p.beta, p.scale, None, None, ckpt,
                                        grad_o, None, 8)
    m = _mps([p.q, p.k, p.v, p.g, p.beta])
    o = torch.ops.rlx.gated_delta_fwd(*m, p.scale, None, None, 8)
    _close(o[0], torch.ops.rlx.gated_delta_fwd(p.q, p.k, p.v, p.g, p.beta, p.scale, None, None,
                                               8)[0], 1e-5)
    packed = torch.ops.rlx.gated_delta_bwd(*m, p.scale, None, None, ckpt.to("mps"),
                                           grad_o.to("mps"), None, 8)
    _close(packed, ref, 2e-4)
    assert rt.counters()["violations"] == 0


def test_l2norm_backward_within_its_pipelines_thread_limit(rt):
    """The l2norm kernel shares the reduction's threadgroup size: a low limit on its own
    pipeline (float16: no other test builds it first) lowers both, instead of a dispatch over
    the limit (a Metal rule violation here)."""
    rt.set_max_threads(32, "gated_delta_bwd_l2norm_f16")
    p = Problem(B=1, T=11, H=1, HV=2, K=20, V=6, chunk=4, dtype=torch.float16, seed=4)
    ins = (p.q, p.k, p.v, p.g, p.beta)
    eps = 0.1
    _, final, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*ins, p.scale, None, None, 4, eps)
    grad_o = torch.randn(p.v.shape).half()
    ref = torch.ops.rlx.gated_delta_bwd(*ins, p.scale, None, None, ckpt, grad_o, None, 4, eps,
                                        vw)
    got = torch.ops.rlx.gated_delta_bwd(*_mps(ins), p.scale, None, None, ckpt.to("mps"),
                                        grad_o.to("mps"), None, 4, eps, vw.to("mps"))
    _close(got, ref, 5e-4)
    assert rt.counters()["violations"] == 0
