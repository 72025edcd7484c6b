"""The CUDA kernels for 16-bit codes (csrc/cuda/codebook_codes16.cuh: the small-batch forward,
the dequantize kernel and the sorted-segment dcodebook kernel) run on the CPU: their device code
is compiled with g++ against tests/cuda_emu/cuda_shim.h and compared with float64 references
written here from the math. Codes are written as int16 bit patterns (AQLM's layout, negative
for codes >= 32768); the kernels read them as uint16. tests/test_codebook_cuda.py runs the
kernels for real on a GPU. Broken copies of the header (a butterfly missing a step, a segment
missing its last element) must fail these comparisons."""

import os
import subprocess

import pytest
import torch

from tests.cuda_emu import build_emulator
from tests.cuda_emu import build_mutant as _build_mutant
from tests.cuda_emu import dump as _dump

KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_codes16"), "codebook_codes16_emu_main")


def _read(path, n, dtype):
    if dtype in (torch.float16, torch.bfloat16):
        return torch.from_file(str(path), size=n, dtype=torch.int16).view(dtype)
    return torch.from_file(str(path), size=n, dtype=dtype)


def _run(exe, args, env=None):
    proc = subprocess.run([str(a) for a in [exe, *args]], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def make_codes(n, groups, m, e, gen):
    """[N, G, M] codes as int16 (values >= 32768 negative), with 0 and E - 1 in every
    codebook's share and, for E > 32768, negative int16 patterns."""
    codes = torch.randint(0, e, (n, groups, m), generator=gen, dtype=torch.int64)
    flat = codes.view(-1)
    flat[::7] = 0
    flat[3::11] = e - 1
    if e > 32768:
        flat[5::13] = 32768 + torch.randint(0, e - 32768, flat[5::13].shape, generator=gen)
    return (codes - 65536 * (codes >= 32768)).to(torch.int16)


def codes_as_long(codes):
    return codes.to(torch.int64) % 65536


def dense_weight(codes, cb):
    """float64 [N, G*D]: W[j, g*D + t] = sum_m C[m, code, t]."""
    idx = codes_as_long(codes)
    n, groups, m = idx.shape
    w = sum(cb[k].double()[idx[:, :, k]] for k in range(m))
    return w.reshape(n, groups * cb.shape[-1])


# (dtype, B, N, G, M, E, D, scales, bias, 16-byte loads)
FORWARD_CASES = {
    "one_row_1x16_half": (torch.float16, 1, 37, 45, 1, 65536, 8, True, True, True),
    "one_row_1x16_bf16_bias_only": (torch.bfloat16, 1, 20, 33, 1, 65536, 8, False, True, True),
    "three_rows_2x16_float": (torch.float32, 3, 41, 40, 2, 65536, 8, True, False, True),
    "eight_rows_small_e_half": (torch.float16, 8, 19, 70, 2, 300, 8, True, True, True),
    "three_rows_d4_bf16": (torch.bfloat16, 3, 33, 50, 1, 65536, 4, True, True, False),
    "eight_rows_d4_float_small_e": (torch.float32, 8, 26, 37, 2, 300, 4, False, False, False),
    "one_row_element_loads_half": (torch.float16, 1, 35, 41, 2, 300, 8, True, True, False),
    "three_rows_element_loads_float": (torch.float32, 3, 17, 65, 1, 65536, 8, False, True, False),
    "two_rows_no_groups_past_a_warp": (torch.bfloat16, 2, 9, 5, 1, 300, 8, True, True, True),
}


def forward_case(name, tmp_path, emulator, out_acc=False, env=None):
    dtype, B, N, G, M, E, D, has_s, has_b, vec = FORWARD_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    x = torch.randn(B, G * D, generator=gen).to(dtype)
    cb = (torch.randn(M, E, D, generator=gen) * 0.5).to(dtype)
    codes = make_codes(N, G, M, E, gen)
    scales = (torch.rand(N, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for fname, t in (("x", x), ("cb", cb), ("scales", scales), ("bias", bias), ("codes", codes)):
        _dump(t, tmp_path / f"{fname}.bin")
    _run(emulator, [tmp_path, "forward", KIND[dtype], B, N, G, M, E, D, int(has_s), int(has_b),
                    int(vec), int(out_acc)], env)
    out_dtype = torch.float32 if out_acc else dtype
    got = _read(tmp_path / "out.bin", B * N, out_dtype).view(B, N).double()
    want = x.double() @ dense_weight(codes, cb).T
    if has_s:
        want = want * scales.double()
    if has_b:
        want = want + bias.double()
    return got, want, out_dtype


def assert_forward_close(got, want, out_dtype, msg):
    # float32 products and sums: a half output is within its own rounding of the float64
    # math; a float32 one within a few ulps of the sums' magnitude
    scale = want.abs().max().item()
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=msg)
    else:
        eps = torch.finfo(out_dtype).eps
        torch.testing.assert_close(got, want, rtol=eps, atol=eps * scale * 0.05, msg=msg)


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_emulated_forward_matches_reference(case, emulator, tmp_path):
    got, want, out_dtype = forward_case(case, tmp_path, emulator)
    assert_forward_close(got, want, out_dtype, case)


@pytest.mark.parametrize("case", ["one_row_1x16_half", "eight_rows_small_e_half"])
def test_emulated_raw_forward_in_float32(case, emulator, tmp_path):
    # the accumulation-type output that grad_scales reads (half x: float32 out, no rounding)
    got, want, out_dtype = forward_case(case, tmp_path, emulator, out_acc=True)
    assert out_dtype == torch.float32
    assert_forward_close(got, want, out_dtype, case)


def test_emulated_forward_with_serial_warps(emulator, tmp_path):
    # warps one at a time (cuda_shim.h): the kernels share nothing between warps, so the
    # results must not change
    env = dict(os.environ, RLX_EMU_SERIAL_WARPS="1")
    got, want, out_dtype = forward_case("three_rows_2x16_float", tmp_path, emulator, env=env)
    assert_forward_close(got, want, out_dtype, "serial warps")
    again, _, _ = forward_case("three_rows_2x16_float", tmp_path, emulator)
    assert torch.equal(got, again)


# (dtype, N, G, M, E, D, scales, 16-byte loads and stores)
DEQUANT_CASES = {
    "1x16_half_scaled": (torch.float16, 37, 45, 1, 65536, 8, True, True),
    "2x16_bf16_element_stores": (torch.bfloat16, 21, 33, 2, 65536, 8, True, False),
    "small_e_float_d4": (torch.float32, 19, 70, 2, 300, 4, False, False),
    "small_e_float_d8": (torch.float32, 13, 40, 1, 300, 8, True, True),
}


@pytest.mark.parametrize("case", DEQUANT_CASES)
def test_emulated_dequantize_matches_reference(case, emulator, tmp_path):
    dtype, N, G, M, E, D, has_s, vec = DEQUANT_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    cb = (torch.randn(M, E, D, generator=gen) * 0.5).to(dtype)
    codes = make_codes(N, G, M, E, gen)
    scales = (torch.rand(N, generator=gen) + 0.5).to(dtype)
    for fname, t in (("cb", cb), ("scales", scales), ("codes", codes)):
        _dump(t, tmp_path / f"{fname}.bin")
    _run(emulator, [tmp_path, "dequant", KIND[dtype], N, G, M, E, D, int(has_s), int(vec)])
    got = _read(tmp_path / "out.bin", N * G * D, dtype).view(N, G * D).double()
    want = dense_weight(codes, cb)
    if has_s:
        want = want * scales.double().unsqueeze(1)
    # one rounding to x's dtype (float32 sums and product before it)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=eps, atol=1e-30, msg=case)


def segments(codes, e):
    """The host code's sort: positions f = (j*G + g)*M + m sorted stably by m*E + code, and the
    offsets where each key's segment starts."""
    m = codes.shape[-1]
    keys = (codes_as_long(codes) + torch.arange(m) * e).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    offsets = torch.searchsorted(sorted_keys, torch.arange(m * e + 1)).to(torch.int32)
    return order, offsets


# (dtype of x, B, N, G, M, E, D, from x, blocks)
DCODEBOOK_CASES = {
    "from_x_1x16_half": (torch.float16, 3, 12, 37, 1, 65536, 8, True, 4),
    "from_x_2x16_float_d4": (torch.float32, 16, 11, 21, 2, 65536, 4, True, 3),
    "from_x_small_e_bf16_collisions": (torch.bfloat16, 5, 40, 33, 2, 37, 8, True, 2),
    "from_dw_small_e_d12": (torch.float32, 20, 30, 25, 1, 300, 12, False, 5),
    "from_dw_1x16_collisions": (torch.float32, 40, 45, 50, 1, 65536, 8, False, 1),
}


def dcodebook_case(name, tmp_path, exe):
    dtype, B, N, G, M, E, D, from_x, blocks = DCODEBOOK_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    codes = make_codes(N, G, M, E, gen)
    if "collisions" in name:  # long segments: several positions per lane
        codes = (codes_as_long(codes) % 5 + (E - 5 if E > 32768 else 0)).to(torch.int64)
        codes = (codes - 65536 * (codes >= 32768)).to(torch.int16)
    order, offsets = segments(codes, E)
    _dump(order, tmp_path / "order.bin")
    _dump(offsets, tmp_path / "offsets.bin")
    if from_x:
        x = torch.randn(B, G * D, generator=gen).to(dtype)
        gs = torch.randn(B, N, generator=gen)
        _dump(x, tmp_path / "x.bin")
        _dump(gs, tmp_path / "gs.bin")
        dw = gs.double().T @ x.double()
    else:
        dw32 = torch.randn(N, G * D, generator=gen)
        _dump(dw32, tmp_path / "dw.bin")
        dw = dw32.double()
    _run(exe, [tmp_path, "dcodebook", KIND[dtype], B, N, G, M, E, D, int(from_x), blocks])
    got = _read(tmp_path / "out.bin", M * E * D, torch.float32).view(M, E, D).double()
    want = torch.zeros(M, E, D, dtype=torch.float64)
    idx = codes_as_long(codes)
    per_code = dw.reshape(N * G, D)
    for k in range(M):
        want[k].index_add_(0, idx[:, :, k].reshape(-1), per_code)
    return got, want


@pytest.mark.parametrize("case", DCODEBOOK_CASES)
def test_emulated_dcodebook_matches_reference(case, emulator, tmp_path):
    got, want = dcodebook_case(case, tmp_path, emulator)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=case)


# ---- broken copies of the header must fail ----

MUTANTS = {
    # the butterfly without its first step: lanes 16-31 never reach lane 0's total
    "butterfly_step": ("for (int off = kLanes / 2; off > 0; off /= 2)",
                       "for (int off = kLanes / 4; off > 0; off /= 2)"),
    # each segment's last position left out
    "segment_element": ("for (int64_t i = begin + lane; i < end; i += kLanes)",
                        "for (int64_t i = begin + lane; i + 1 < end; i += kLanes)"),
}


def build_mutant(tmp_path, name):
    old, new = MUTANTS[name]
    return _build_mutant(tmp_path, "codebook_codes16_emu_main", "codebook_codes16.cuh", old, new)


def test_broken_butterfly_fails(tmp_path):
    exe = build_mutant(tmp_path, "butterfly_step")
    got, want, out_dtype = forward_case("eight_rows_small_e_half", tmp_path, exe)
    with pytest.raises(AssertionError):
        assert_forward_close(got, want, out_dtype, "mutant")
    got, want = dcodebook_case("from_x_small_e_bf16_collisions", tmp_path, exe)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_dropped_segment_element_fails(tmp_path):
    exe = build_mutant(tmp_path, "segment_element")
    got, want = dcodebook_case("from_x_small_e_bf16_collisions", tmp_path, exe)
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
