"""The tensor-core codebook forward (csrc/cuda/codebook_mma.cuh) run on the CPU: its device code
is compiled with g++ against tests/cuda_emu/cuda_shim.h (one thread per CUDA thread, block
barriers, an mma.sync emulated per warp with the PTX fragment layout) and compared with a
float64 reference built from the math. This checks the fragment mapping, the code and x
indexing, the ragged tails and the cross-warp sum without a GPU; tests/test_codebook_cuda.py
runs the kernel for real."""

import subprocess

import pytest
import torch

from tests.cuda_emu import build_emulator


def float64_reference(x, idx, cb, scales, bias):
    """x @ W.T (· scales, + bias) in float64, W = the sum of the M codebooks' entries (D = 8)."""
    N, G, M = idx.shape
    W = sum(cb[m].double()[idx[:, :, m].long()] for m in range(M)).reshape(N, G * 8)
    want = x.double() @ W.T
    if scales is not None:
        want = want * scales.double()
    if bias is not None:
        want = want + bias.double()
    return want


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu"), "codebook_emu_main")


def _bits(t):
    return t.contiguous().view(torch.int16).numpy()


# (dtype, B, N, G, M, E, scales, bias, fast codes, row tiles per block, warps per block)
CASES = {
    "one_row_ragged_tile_half_window": (torch.float16, 1, 40, 40, 1, 256, True, True, True, 2, 16),
    "two_codebooks_ragged_groups": (torch.float16, 5, 16, 33, 2, 37, True, False, False, 2, 16),
    "three_rows_four_tiles": (torch.bfloat16, 3, 35, 48, 2, 256, False, True, True, 4, 16),
    "sixteen_rows_bf16": (torch.bfloat16, 16, 20, 16, 2, 256, False, True, True, 2, 16),
    "nine_rows_bias_only": (torch.bfloat16, 9, 17, 48, 1, 200, False, True, True, 4, 8),
    "more_windows_than_warps": (torch.float16, 3, 33, 272, 1, 256, True, True, True, 2, 16),
    "rounds_of_four_warps": (torch.float16, 2, 21, 200, 2, 256, True, True, True, 1, 4),
    "four_tiles_ragged_rows": (torch.float16, 12, 45, 72, 2, 256, True, True, True, 4, 8),
    "byte_codes_path": (torch.float16, 8, 18, 32, 1, 256, False, False, False, 2, 16),
    # K = 4160 > 4096 with two codebooks: rounds of cp.async groups, a ragged last window and
    # block, and enough products that a rounded entry sum would show
    "long_k_two_codebooks": (torch.float16, 3, 70, 520, 2, 256, True, True, True, 4, 16),
    "long_k_two_codebooks_bf16": (torch.bfloat16, 3, 70, 520, 2, 256, True, True, True, 4, 16),
}


@pytest.mark.parametrize("case", CASES)
def test_emulated_mma_forward_matches_reference(case, emulator, tmp_path):
    dtype, B, N, G, M, E, has_s, has_b, fast, row_tiles, warps = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(B, G * 8, generator=gen).to(dtype)
    cb = (torch.randn(M, E, 8, generator=gen) * 0.5).to(dtype)
    idx = torch.randint(0, E, (N, G, M), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    _bits(x).tofile(str(tmp_path / "x.bin"))
    _bits(cb).tofile(str(tmp_path / "cb.bin"))
    idx.numpy().tofile(str(tmp_path / "idx.bin"))
    _bits(scales).tofile(str(tmp_path / "scales.bin"))
    _bits(bias).tofile(str(tmp_path / "bias.bin"))
    kind = 0 if dtype == torch.float16 else 1
    args = [emulator, tmp_path, kind, B, N, G, M, E, int(has_s), int(has_b), int(fast),
            row_tiles, warps]
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = torch.from_file(str(tmp_path / "out.bin"), size=B * N, dtype=torch.int16)
    got = got.view(dtype).view(B, N).double()
    # W exactly (the M entries' sum is never rounded to the input dtype): only float32
    # accumulation and the output's rounding separate the kernel from the float64 math
    want = float64_reference(x, idx, cb, scales if has_s else None, bias if has_b else None)
    eps = torch.finfo(dtype).eps
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * scale * 0.05, msg=case)


@pytest.fixture(scope="module")
def lut_emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_lut"), "codebook_lut_emu_main")


# The lookup-table forward (csrc/cuda/codebook_lut.cuh):
# (dtype, B, N, G, M, E, scales, bias, 16-byte codes, rows per thread (0: the rule), SMs)
LUT_CASES = {
    "one_row_one_slice": (torch.float16, 1, 40, 32, 1, 256, True, True, True, 0, 132),
    "one_row_ragged_slice_bytes": (torch.float16, 1, 300, 45, 1, 256, True, False, False, 0, 132),
    "two_rows_two_codebooks_bf16": (torch.bfloat16, 2, 70, 48, 2, 200, False, True, True, 0, 132),
    "three_rows_float4_table": (torch.float16, 3, 33, 40, 1, 256, True, True, True, 0, 132),
    "four_rows_two_cb_ragged": (torch.bfloat16, 4, 65, 37, 2, 256, True, True, False, 0, 132),
    "float32_small_e": (torch.float32, 2, 50, 70, 2, 37, True, True, True, 0, 132),
    # two output rows per thread: the rule's choice on a 1-SM device, and forced
    "two_rows_per_thread_rule": (torch.float16, 1, 700, 64, 1, 256, True, True, True, 0, 1),
    "two_rows_per_thread_ragged": (torch.float32, 4, 530, 20, 2, 256, False, True, True, 2, 132),
    "long_k_many_slices": (torch.float16, 1, 20, 520, 1, 256, True, True, True, 0, 132),
}


def _dump(t, path):
    if t.dtype == torch.float32:
        t.contiguous().numpy().tofile(str(path))
    else:
        _bits(t).tofile(str(path))


@pytest.mark.parametrize("case", LUT_CASES)
def test_emulated_lut_forward_matches_reference(case, lut_emulator, tmp_path):
    dtype, B, N, G, M, E, has_s, has_b, wide, rpt, sms = LUT_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(B, G * 8, generator=gen).to(dtype)
    cb = (torch.randn(M, E, 8, generator=gen) * 0.5).to(dtype)
    idx = torch.randint(0, E, (N, G, M), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(N, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for name, t in (("x", x), ("cb", cb), ("scales", scales), ("bias", bias)):
        _dump(t, tmp_path / f"{name}.bin")
    idx.numpy().tofile(str(tmp_path / "idx.bin"))
    kind = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[dtype]
    args = [lut_emulator, tmp_path, kind, B, N, G, M, E, int(has_s), int(has_b), int(wide), rpt,
            sms]
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    if dtype == torch.float32:
        got = torch.from_file(str(tmp_path / "out.bin"), size=B * N, dtype=torch.float32)
    else:
        got = torch.from_file(str(tmp_path / "out.bin"), size=B * N, dtype=torch.int16).view(dtype)
    got = got.view(B, N).double()
    want = float64_reference(x, idx, cb, scales if has_s else None, bias if has_b else None)
    # float32 tables and sums: half outputs are within their own rounding; float32 within a
    # few ulps of the sum's magnitude per slice
    eps = torch.finfo(dtype).eps
    scale = want.abs().max().item()
    atol = eps * scale * (0.05 if dtype != torch.float32 else 8.0)
    torch.testing.assert_close(got, want, rtol=eps if dtype != torch.float32 else 1e-5,
                               atol=atol, msg=case)


@pytest.fixture(scope="module")
def gemv_emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_gemv"), "codebook_gemv_emu_main")


# The one-row forward (csrc/cuda/codebook_gemv.cuh): parts of 128 groups (4 per lane), passes
# of 8 rows, 16 warps a block. (dtype, N, G, M, E, scales, bias, 4-byte code loads, rows per
# block (0: the rule), SMs)
GEMV_CASES = {
    # one part; N neither a multiple of the block's rows nor of a pass
    "one_part_ragged_rows": (torch.float16, 37, 128, 1, 256, True, True, True, 16, 132),
    # G = 45: one ragged part (lanes past K), codes read byte by byte
    "ragged_part_byte_codes_bf16": (torch.bfloat16, 45, 45, 1, 256, True, False, True, 8, 132),
    # two parts, the second ragged (72 groups), two codebooks, E < 256
    "two_codebooks_small_e": (torch.float16, 50, 200, 2, 37, True, True, True, 16, 132),
    # 9 parts on 8 part warps: warp 0 takes parts 0 and 8 (x reloaded), the last ragged
    "more_parts_than_warps": (torch.float16, 20, 1100, 1, 256, False, True, True, 8, 132),
    # 5 parts on 4 part warps, 6 passes on 4 row warps: a warp's items change pass and part
    "parts_and_passes_bf16": (torch.bfloat16, 90, 600, 2, 256, True, True, True, 48, 132),
    # the codes' rows not at multiples of 8 bytes (G odd): byte loads in every part
    "two_codebooks_byte_codes": (torch.float16, 33, 257, 2, 256, True, True, True, 8, 132),
    # the rows-per-block rule on a 4-SM device (80 rows a block, 10 passes), E = 255
    "rule_shape": (torch.bfloat16, 300, 64, 1, 255, False, False, True, 0, 4),
    "no_scales_no_bias_wide_off": (torch.float16, 17, 160, 1, 256, False, False, False, 8, 132),
}


@pytest.mark.parametrize("case", GEMV_CASES)
def test_emulated_gemv_forward_matches_reference(case, gemv_emulator, tmp_path):
    dtype, N, G, M, E, has_s, has_b, wide, rows, sms = GEMV_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(1, G * 8, generator=gen).to(dtype)
    cb = (torch.randn(M, E, 8, generator=gen) * 0.5).to(dtype)
    idx = torch.randint(0, E, (N, G, M), generator=gen, dtype=torch.uint8)
    flat = idx.view(-1)
    flat[::5] = 0  # the first and the last entry of every codebook
    flat[2::7] = E - 1
    scales = (torch.rand(N, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    for name, t in (("x", x), ("cb", cb), ("scales", scales), ("bias", bias)):
        _bits(t).tofile(str(tmp_path / f"{name}.bin"))
    idx.numpy().tofile(str(tmp_path / "idx.bin"))
    kind = 0 if dtype == torch.float16 else 1
    args = [gemv_emulator, tmp_path, kind, N, G, M, E, int(has_s), int(has_b), int(wide), rows,
            sms]
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = torch.from_file(str(tmp_path / "out.bin"), size=N, dtype=torch.int16)
    got = got.view(dtype).view(1, N).double()
    # float32 products and sums: only they and the output's rounding separate the kernel from
    # the float64 math
    want = float64_reference(x, idx, cb, scales if has_s else None, bias if has_b else None)
    eps = torch.finfo(dtype).eps
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * scale * 0.05,
                               msg=lambda m: f"{case}: {m}\n{proc.stdout}")
