"""The small-batch backward of the 8-bit-code codebook matmul on CUDA
(csrc/cuda/codebook_histogram.cuh: dx and dcodebook from histograms of the output gradient)
runs on the CPU: its device code is compiled with g++ against tests/cuda_emu/cuda_shim.h and
its outputs are compared with float64 references written here from the math. The cases cover
ragged rounds and chunks (N not a multiple of 32 or of the 512-row chunk), blocks with fewer
steps than warps and fewer batch rows than their share, 1 to 4 batch rows a block, row splits
(the last one short), several step and batch chunks, steps that mix codebooks (M = 2, 3),
colliding codes up to a whole warp of one code, every dtype, cp.async staging and element
loads, an inf and a NaN gradient, and warps run one at a time between barriers.
tests/test_codebook_cuda.py runs the kernel for real on a GPU. Broken copies of the header (a
colliding row never added, rows skipped, a chunk read before its copies land, a row split's
dx written over another's) must fail."""

import os
import subprocess

import pytest
import torch

from tests.cuda_emu import build_emulator
from tests.cuda_emu import build_mutant as _build_mutant
from tests.cuda_emu import dump as _dump

KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
STEPS, CHUNK = 16, 512  # kHistSteps, kHistChunk

# (dtype of x, B, N, G, M, E, D, code pattern, cp.async where the shapes allow, batch rows
# per block, chunks of output rows per row split)
ONE = 1 << 20  # chunks per split: one split
CASES = {
    "float_full_batch_ragged_rows": (torch.float32, 16, 70, 9, 1, 256, 8, "random", True, 4, ONE),
    "half_two_codebooks_two_chunks_async": (torch.float16, 6, 1040, 8, 2, 37, 8, "random", True,
                                            4, ONE),
    "half_two_codebooks_two_chunks_elements": (torch.float16, 6, 1040, 8, 2, 37, 8, "random",
                                               False, 4, ONE),
    "float_two_step_chunks_async": (torch.float32, 16, 1024, 32, 1, 256, 8, "random", True, 4, ONE),
    "bf16_three_codebooks_d4": (torch.bfloat16, 1, 33, 5, 3, 256, 4, "random", True, 4, ONE),
    "float_collisions_e2_d3": (torch.float32, 5, 64, 4, 1, 2, 3, "random", True, 4, ONE),
    "double_one_code_per_step": (torch.float64, 7, 96, 3, 2, 19, 5, "constant", True, 4, ONE),
    "half_single_row_short": (torch.float16, 2, 1, 7, 1, 256, 8, "random", True, 4, ONE),
    # fewer batch rows per block (devices with less shared memory)
    "double_two_rows_a_block_async": (torch.float64, 5, 600, 16, 1, 256, 8, "random", True, 2, ONE),
    "bf16_three_rows_a_block": (torch.bfloat16, 7, 300, 5, 2, 64, 8, "random", True, 3, ONE),
    "float_one_row_a_block": (torch.float32, 3, 90, 6, 2, 50, 8, "random", True, 1, ONE),
    # gradients with an inf (batch row 1) and a NaN (row 3)
    "float_nonfinite_gradients": (torch.float32, 5, 100, 16, 1, 64, 8, "nonfinite", True, 4, ONE),
    # row splits: 6 chunks in splits of 2 (the last chunk partial); 3 chunks in splits of 1
    "float_three_row_splits": (torch.float32, 3, 2600, 16, 1, 256, 8, "random", True, 4, 2),
    "half_row_splits_two_rows_a_block": (torch.float16, 5, 1100, 8, 2, 37, 8, "random", True, 2,
                                         1),
}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_hist"), "codebook_histogram_emu_main")


def run_case(name, tmp_path, exe, env=None):
    """The kernel's dx [B, K] and dC [M, E, D] (parts added in float64) and their float64
    references."""
    dtype, B, N, G, M, E, D, pattern, vec, bpb, split_chunks = CASES[name]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(len(name))
    if pattern == "constant":  # every row of a step has the same code: 32 ranks a round
        codes = torch.randint(0, E, (1, G, M), generator=gen).expand(N, G, M).contiguous()
    else:
        codes = torch.randint(0, E, (N, G, M), generator=gen)
        codes.view(-1)[::5] = E - 1
    x = torch.randn(B, G * D, generator=gen, dtype=torch.float64).to(dtype)
    gs = torch.randn(B, N, generator=gen, dtype=torch.float64).to(acc)
    if pattern == "nonfinite":
        gs[1, 7] = float("inf")
        gs[3, 50] = float("nan")
    cb = torch.randn(M, E, D, generator=gen, dtype=torch.float64).to(acc)
    _dump(codes.to(torch.uint8), tmp_path / "codes.bin")
    _dump(x, tmp_path / "x.bin")
    _dump(gs, tmp_path / "gs.bin")
    _dump(cb, tmp_path / "cb.bin")
    proc = subprocess.run([str(a) for a in [exe, tmp_path, KIND[dtype], B, N, G, M, E, D,
                                            int(vec), bpb, split_chunks]],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    chunks = -(-N // CHUNK)
    splits = -(-chunks // split_chunks)
    blocks = -(-(G * M) // STEPS) * -(-B // bpb) * splits
    dx_parts = torch.from_file(str(tmp_path / "dx.bin"), size=splits * M * B * G * D,
                               dtype=acc)
    dc_parts = torch.from_file(str(tmp_path / "dc.bin"), size=blocks * M * E * D, dtype=acc)
    got_dx = dx_parts.view(splits * M, B, G * D).double().sum(0)
    got_dc = dc_parts.view(blocks, M, E, D).double().sum(0)
    # references from the math: W[j, g*D + t] = sum_m C[m, code, t]; dx = gs W; dC scatters
    # dW = gs^T x by code
    cb64, gs64, x64 = cb.double(), gs.double(), x.double()
    w = sum(cb64[m][codes[:, :, m]] for m in range(M)).reshape(N, G * D)
    want_dx = gs64 @ w
    dw = (gs64.T @ x64).reshape(N * G, D)
    want_dc = torch.zeros(M, E, D, dtype=torch.float64)
    for m in range(M):
        want_dc[m].index_add_(0, codes[:, :, m].reshape(-1), dw)
    return got_dx, want_dx, got_dc, want_dc


def assert_close(got, want, acc, what):
    tol = 1e-12 if acc == torch.float64 else 2e-6
    scale = want[want.isfinite()].abs().max().item()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, equal_nan=True, msg=what)


@pytest.mark.parametrize("case", CASES)
def test_emulated_histogram_backward_matches_reference(case, emulator, tmp_path):
    got_dx, want_dx, got_dc, want_dc = run_case(case, tmp_path, emulator)
    acc = torch.float64 if CASES[case][0] == torch.float64 else torch.float32
    assert_close(got_dx, want_dx, acc, f"{case}: dx")
    assert_close(got_dc, want_dc, acc, f"{case}: dcodebook")


def test_emulated_histogram_backward_serial_warps(emulator, tmp_path):
    # Warps one at a time between barriers: a pass reading another warp's histogram before
    # the block barrier would read the NaN that shared memory starts as.
    env = dict(os.environ, RLX_EMU_SERIAL_WARPS="1")
    got_dx, want_dx, got_dc, want_dc = run_case("half_two_codebooks_two_chunks_async", tmp_path,
                                                emulator, env)
    assert_close(got_dx, want_dx, torch.float32, "dx")
    assert_close(got_dc, want_dc, torch.float32, "dcodebook")


# ---- broken copies of the header must fail ----

MUTANTS = {  # name: (text, broken text, case, the outputs it must break)
    # the last lane of a round's largest group of colliding codes never adds
    "last_rank": ("for (unsigned k = 0; k < top; ++k)", "for (unsigned k = 0; k + 1 < top; ++k)",
                  "half_two_codebooks_two_chunks_async", ("dx", "dc")),
    # every other round of rows skipped
    "skipped_rows": ("r0 < kHistChunk && j0 + r0 < N; r0 += 32)",
                     "r0 < kHistChunk && j0 + r0 < N; r0 += 64)",
                     "half_two_codebooks_two_chunks_async", ("dx", "dc")),
    # a chunk read while its copies may still be in flight
    "early_read": ("async_wait<1>();", "async_wait<2>();", "half_two_codebooks_two_chunks_async",
                   ("dx", "dc")),
    # every row split's dx written to the first split's part
    "split_dx_overwritten": ("dx_parts[((static_cast<int64_t>(split) * M + m)",
                             "dx_parts[((static_cast<int64_t>(0) * M + m)",
                             "float_three_row_splits", ("dx",)),
}


def build_mutant(tmp_path, name):
    old, new = MUTANTS[name][:2]
    return _build_mutant(tmp_path, "codebook_histogram_emu_main", "codebook_histogram.cuh", old,
                         new)


@pytest.mark.parametrize("mutant", MUTANTS)
def test_broken_histogram_fails(mutant, tmp_path):
    exe = build_mutant(tmp_path, mutant)
    case, broken = MUTANTS[mutant][2:]
    got_dx, want_dx, got_dc, want_dc = run_case(case, tmp_path, exe)
    outputs = {"dx": (got_dx, want_dx), "dc": (got_dc, want_dc)}
    for name in broken:
        got, want = outputs[name]
        assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), name
