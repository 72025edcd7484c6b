"""The codebook forward's one-batch-row kernel (csrc/cpu/codebook_one_row.h: 1 or 2 rows of
uint8 codes) against a float64 reference written from the definition.

The shapes reach each part of its work partition and of the AVX2 copy's asm gather: several
64-step chunks (the last one short), steps that are not a multiple of the 8-step blocks, more
output rows than one 512-row chunk and a count that is not a multiple of the 4-row unroll,
rows split into parts when K is one chunk, E < 256, several codebooks, index rows of odd
length (unaligned 8-byte code loads), and codes at both ends of the table (0 and E - 1).
"""

import os
import subprocess
import sys

import pytest
import torch

import rlx_torch


def definition(x, indices, codebook, scales, bias):
    """out[..., j] = s_j * sum_{g, m, t} x[..., g*D + t] * C[m, I[j, g, m], t] + b_j, float64."""
    cb = codebook.double()
    if cb.dim() == 2:
        cb = cb[None]
    m_books, _, d = cb.shape
    idx = indices.long()
    if idx.dim() == 2:
        idx = idx[..., None]
    n, groups, _ = idx.shape
    weight = torch.zeros(n, groups, d, dtype=torch.float64)
    for m in range(m_books):
        weight += cb[m][idx[:, :, m]]  # [N, G, D]: entry I[j, g, m] of codebook m
    out = x.double().reshape(-1, groups * d) @ weight.reshape(n, groups * d).T
    if scales is not None:
        out = out * scales.double()
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], n), weight.reshape(n, groups * d)


def make(rows, n, groups, d, e, m, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lead = rows if isinstance(rows, tuple) else (rows,)
    x = torch.randn(*lead, groups * d, generator=gen).to(dtype)
    shape = (n, groups, m) if m > 1 else (n, groups)
    idx = torch.randint(0, e, shape, generator=gen, dtype=torch.uint8)
    flat = idx.view(-1)
    flat[::7] = e - 1  # the table's last entry (a wrong stride or offset reads another one)
    flat[3::11] = 0
    cb = torch.randn((m, e, d) if m > 1 else (e, d), generator=gen).to(dtype)
    s = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, idx, cb, s, b


def check(out, x, idx, cb, s, b):
    want, weight = definition(x, idx, cb, s, b)
    assert out.shape == want.shape
    if out.dtype == torch.float64:
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        return
    # float32: the error of a sum grows with the sum of its terms' magnitudes; 1e-5 of it is
    # far below one term (a lookup dropped or read from the wrong entry), and far above the
    # rounding of the few thousand float32 adds.
    bound = (x.double().abs().reshape(-1, weight.shape[1]) @ weight.abs().T)
    bound = (bound * s.double().abs()).reshape(want.shape)
    err = (out.double() - want).abs()
    assert bool((err <= 1e-5 * bound + 1e-6).all()), (err / (bound + 1e-30)).max().item()


# rows, N, K/D, D, E, M
SHAPES = [
    (1, 1030, 133, 4, 256, 1),  # 3 chunks (64, 64, 5 steps), 2 row chunks, row tail of 2
    (1, 1027, 70, 8, 100, 3),  # 21 groups = 63 steps a chunk (7-step tails), E < 256
    (2, 600, 16, 2, 256, 1),  # one chunk: rows split into 2 parts; 2 rows (2 one-row tiles)
    (1, 37, 5, 8, 256, 1),  # fewer steps than one block, fewer rows than one part
    (2, 45, 9, 3, 17, 2),
    (1, 70, 600, 1, 256, 1),  # 10 chunks
    (1, 513, 64, 8, 1, 1),  # E = 1: every code 0
    ((1, 1), 129, 24, 8, 256, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_one_row_forward_matches_the_definition(shape, dtype):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make(rows, n, groups, d, e, m, dtype=dtype)
    out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
    assert out.dtype == dtype
    check(out, x, idx, cb, s, b)
    raw = rlx_torch.codebook_matmul(x, idx, cb, None, None)
    check(raw, x, idx, cb, torch.ones_like(s), None)


def test_one_row_forward_half_inputs():
    x, idx, cb, s, b = make(1, 700, 70, 8, 256, 1)
    for dt in (torch.float16, torch.bfloat16):
        out = rlx_torch.codebook_matmul(x.to(dt), idx, cb.to(dt), s.to(dt), b.to(dt))
        want, _ = definition(x.to(dt), idx, cb.to(dt), s.to(dt), b.to(dt))
        scale = want.abs().max().item()
        torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2 * scale)


def test_one_row_forward_strided_inputs():
    _, idx, cb, s, b = make(1, 1030, 133, 4, 256, 2)
    row = torch.randn(1, 133 * 4)
    for x in (row.expand(2, -1),  # stride 0 between the two rows
              torch.randn(1, 133 * 8)[:, ::2],
              torch.randn(133 * 4, 3).t()[1:2]):  # column stride 3
        assert not x.is_contiguous()
        out = rlx_torch.codebook_matmul(x, idx, cb, s, b)
        check(out, x, idx, cb, s, b)
    idx_t = idx.transpose(0, 1).contiguous().transpose(0, 1)
    check(rlx_torch.codebook_matmul(row, idx_t, cb, s, b), row, idx, cb, s, b)


def test_one_row_forward_empty():
    x, idx, cb, s, b = make(1, 600, 16, 2, 256, 1)
    assert rlx_torch.codebook_matmul(x[:0], idx, cb, s, b).shape == (0, 600)
    assert rlx_torch.codebook_matmul(x, idx[:0], cb, s[:0], b[:0]).shape == (1, 0)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[5]], ids=str)
def test_one_row_forward_same_bits_for_any_thread_count(shape):
    rows, n, groups, d, e, m = shape
    x, idx, cb, s, b = make(rows, n, groups, d, e, m, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rlx_torch.codebook_matmul(x, idx, cb, s, b)
        for k in (2, max(threads, 3)):
            torch.set_num_threads(k)
            for _ in range(3):
                assert torch.equal(rlx_torch.codebook_matmul(x, idx, cb, s, b), one)
    finally:
        torch.set_num_threads(threads)


def test_one_row_rows_agree_with_the_batched_kernel():
    # A row computed alone (one-row kernel) and inside a batch of 40 (the 32-row tiles).
    x, idx, cb, s, b = make(40, 1030, 133, 4, 256, 1)
    alone = torch.cat([rlx_torch.codebook_matmul(x[i:i + 1], idx, cb, s, b) for i in range(3)])
    batched = rlx_torch.codebook_matmul(x, idx, cb, s, b)[:3]
    torch.testing.assert_close(alone, batched, rtol=1e-5, atol=1e-4)


def test_byte_plane_lookups_give_the_float_permutes_bits(tmp_path):
    # On CPUs with AVX-512 VBMI the one-row gather looks up 64 rows at a time through the
    # tables' byte planes (csrc/cpu/codebook_byte_lookup.h); RLX_NO_VBMI=1 keeps the float
    # permutes. Both sum each row in step order: the same bits, for every shape (whole 64-row
    # blocks, the rows after them, E < 256, several codebooks).
    code = (
        "import sys, torch, rlx_torch\n"
        "from tests.test_codebook_one_row import SHAPES, make\n"
        "outs = []\n"
        "for shape in SHAPES:\n"
        "    x, idx, cb, s, b = make(*shape)\n"
        "    outs.append(torch.ops.rlx.codebook_matmul(x, idx, cb, s, b))\n"
        "torch.save(outs, sys.argv[1])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for flag in ("0", "1"):
        path = tmp_path / f"vbmi_off_{flag}.pt"
        env = dict(os.environ, RLX_NO_VBMI=flag, PYTHONPATH=root)
        child = subprocess.run([sys.executable, "-c", code, str(path)], env=env, cwd=root,
                               capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        results[flag] = torch.load(path)
    for shape, a, b in zip(SHAPES, results["0"], results["1"], strict=True):
        assert torch.equal(a, b), shape
        check(a, *make(*shape))
