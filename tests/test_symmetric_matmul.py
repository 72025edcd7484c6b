"""rlx::symmetric_matmul (the symmetric bf16 products of Muon's Newton–Schulz on CPU) against
a float32 reference: random shapes, both layouts, the c term, exact symmetry, opcheck, the
fallback path and bad input."""

import os
import platform
import subprocess
import sys

import pytest
import torch

import rlx_torch  # noqa: F401  (loads the ops)
from rlx_torch.ops.symmetric_matmul import symmetric_matmul

SHAPES = [(1, 1, 1), (2, 5, 3), (3, 8, 32), (2, 33, 17), (1, 40, 257), (4, 64, 64),
          (2, 100, 513), (2, 256, 256), (1, 256, 1024), (0, 4, 4), (2, 7, 0)]


def reference(a, b, c, alpha, beta, transposed, diag=0.0):
    a, b = a.float(), b.float()
    full = alpha * (a.mT @ b if transposed else a @ b.mT)
    if c is not None:
        full = full + beta * c.float()
    full = full + diag * torch.eye(full.shape[-1])
    return full.triu() + full.triu(1).mT


def operands(N, m, k, transposed, gen, with_c):
    shape = (N, k, m) if transposed else (N, m, k)
    a = torch.randn(shape, generator=gen).bfloat16()
    b = torch.randn(shape, generator=gen).bfloat16()
    c = None
    if with_c:
        s = torch.randn(N, m, m, generator=gen)
        c = (s + s.mT).bfloat16()
    return a, b, c


@pytest.mark.parametrize("N, m, k", SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("with_c", [False, True])
def test_matches_reference_and_is_symmetric(N, m, k, transposed, with_c):
    gen = torch.Generator().manual_seed(N * 1000 + m * 10 + k)
    a, b, c = operands(N, m, k, transposed, gen, with_c)
    out = symmetric_matmul(a, b, c, alpha=1.7, beta=-0.3, transposed=transposed, diag=2.5)
    ref = reference(a, b, c, 1.7, -0.3, transposed, 2.5)
    assert out.dtype == torch.bfloat16 and out.shape == (N, m, m)
    assert torch.equal(out, out.mT)
    # float32 sums in a different order, then one bf16 rounding: within 2 bf16 ulps of the
    # largest entry.
    tol = 2 ** -7 * max(ref.abs().max().item() if ref.numel() else 0.0, 1e-6)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)


def test_gram_product_matches_the_full_product():
    # a = b: every entry is the same dot product either way; the upper triangle decides.
    a = torch.randn(3, 45, 70).bfloat16()
    out = symmetric_matmul(a, a, None, 1.0, 0.0)
    torch.testing.assert_close(out.float(), (a.float() @ a.float().mT), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("N, m, k", [(1, 96, 2051), (3, 70, 33), (2, 256, 1024), (1, 33, 1)])
@pytest.mark.parametrize("transposed", [False, True])
def test_one_operand_for_both_sides(N, m, k, transposed):
    # a is b (X Xᵀ) packs the operand once for both sides of the product; the result is
    # bitwise that of two equal operands. k = 2051: several k blocks and an odd tail.
    gen = torch.Generator().manual_seed(m + k)
    a = torch.randn((N, k, m) if transposed else (N, m, k), generator=gen).bfloat16()
    out = symmetric_matmul(a, a, None, 1.0, 0.0, transposed=transposed)
    assert torch.equal(out, symmetric_matmul(a, a.clone(), None, 1.0, 0.0, transposed=transposed))
    ref = reference(a, a, None, 1.0, 0.0, transposed)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2 ** -7 * ref.abs().max().item())


@pytest.mark.parametrize("transposed", [False, True])
def test_deterministic_across_threads_and_batches(transposed):
    # Each matrix's sums run in one fixed order whatever the thread count or the batch.
    gen = torch.Generator().manual_seed(7)
    m, k = 200, 300
    shape = (3, k, m) if transposed else (3, m, k)
    a = torch.randn(shape, generator=gen).bfloat16()
    b = torch.randn(shape, generator=gen).bfloat16()
    c = torch.randn(3, m, m, generator=gen).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = symmetric_matmul(a, b, c, 0.5, 2.0, transposed=transposed)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(threads, 2))
    try:
        many = symmetric_matmul(a, b, c, 0.5, 2.0, transposed=transposed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    for i in range(3):
        alone = symmetric_matmul(a[i:i + 1], b[i:i + 1], c[i:i + 1], 0.5, 2.0,
                                 transposed=transposed)
        assert torch.equal(alone, many[i:i + 1])


def test_non_contiguous_operands():
    base = torch.randn(2, 40, 90).bfloat16()
    a = base[:, :, 5:70]  # row stride 90
    c_base = torch.randn(2, 40, 40)
    c = (c_base + c_base.mT).bfloat16().mT  # a transposed view
    out = symmetric_matmul(a, a, c, 0.5, 2.0)
    torch.testing.assert_close(out.float(), reference(a, a, c, 0.5, 2.0, False), rtol=0,
                               atol=2 ** -7 * 60)


def test_opcheck():
    a, b, c = operands(2, 19, 37, False, torch.Generator().manual_seed(0), True)
    torch.library.opcheck(torch.ops.rlx.symmetric_matmul.default,
                          (a, b, c, 1.5, 0.5, False, 0.7))
    at, bt, _ = operands(2, 19, 37, True, torch.Generator().manual_seed(1), False)
    torch.library.opcheck(torch.ops.rlx.symmetric_matmul.default, (at, bt, None, 1.0, 0.0, True))
    out = torch.empty(2, 19, 19, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.rlx.symmetric_matmul_out.default,
                          (a, b, c, 1.5, 0.5, False, 0.7, out))


@pytest.mark.parametrize("transposed", [False, True])
def test_out_variant_writes_the_same_result_into_out(transposed):
    g = torch.Generator().manual_seed(3)
    a, b, c = operands(3, 45, 70, transposed, g, True)
    expected = symmetric_matmul(a, b, c, 1.25, -0.5, transposed, diag=0.5)
    out = torch.full_like(expected, float("nan"))
    got = symmetric_matmul(a, b, c, 1.25, -0.5, transposed, diag=0.5, out=out)
    assert got is out
    assert torch.equal(out, expected)
    empty = torch.empty(0, *expected.shape[1:], dtype=torch.bfloat16)
    assert symmetric_matmul(a[:0], b[:0], None, transposed=transposed, out=empty) is empty


def _bad_out_cases():
    a = torch.randn(2, 6, 9).bfloat16()
    c = torch.randn(2, 6, 6).bfloat16()
    return [
        ((a, a, None), torch.empty(2, 6, 6), "out must be a bfloat16"),
        ((a, a, None), torch.empty(2, 6, 7, dtype=torch.bfloat16), r"out must be \[N, m, m\]"),
        ((a, a, None), torch.empty(2, 6, 12, dtype=torch.bfloat16)[..., ::2],
         "out must be contiguous"),
        ((a, a, c), c, "out must not share memory"),
        ((a, a, None), torch.empty(2, 6, 6, dtype=torch.bfloat16), None),  # fine
        ((a, a, None), a.view(-1)[:72].view(2, 6, 6), "out must not share memory"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_out_cases())))
def test_bad_out_raises(case):
    args, out, message = _bad_out_cases()[case]
    if message is None:
        symmetric_matmul(*args, out=out)
        return
    with pytest.raises(RuntimeError, match=message):
        symmetric_matmul(*args, out=out)


def test_is_native_matches_the_cpu_flags():
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        flags = open("/proc/cpuinfo").read()
    else:
        pytest.skip("needs /proc/cpuinfo to know the CPU's flags")
    # Under user-mode emulation (the arm64 tests on an x86-64 host) /proc/cpuinfo is the host's:
    # the native kernel exists only in an x86-64 build.
    expected = platform.machine() == "x86_64" and all(
        f in flags.split() for f in ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
    assert torch.ops.rlx.symmetric_matmul_is_native() == expected


def test_fallback_path_gives_the_same_contract():
    # RLX_NO_AVX512_BF16=1 (read once per process) forces the baddbmm fallback.
    code = (
        "import torch, rlx_torch\n"
        "from rlx_torch.ops.symmetric_matmul import symmetric_matmul\n"
        "assert not torch.ops.rlx.symmetric_matmul_is_native()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for t in (False, True):\n"
        "    a = torch.randn(2, 30, 41, generator=g).bfloat16()\n"
        "    s = torch.randn(2, 41 if t else 30, 41 if t else 30, generator=g)\n"
        "    c = (s + s.mT).bfloat16()\n"
        "    out = symmetric_matmul(a, a, c, 1.5, 0.5, t, diag=3.0)\n"
        "    af = a.float()\n"
        "    full = 1.5 * (af.mT @ af if t else af @ af.mT) + 0.5 * c.float()\n"
        "    full += 3.0 * torch.eye(full.shape[-1])\n"
        "    assert torch.equal(out, out.mT)\n"
        "    err = (out.float() - full).abs().max().item()\n"
        "    assert err <= 2 ** -7 * full.abs().max().item(), err\n"
        "print('ok')\n"
    )
    env = dict(os.environ, RLX_NO_AVX512_BF16="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(4, 5).bfloat16(),) * 2 + (None,), "a must be"),
        ((torch.randn(1, 4, 5).bfloat16(), torch.randn(1, 4, 6).bfloat16(), None),
         "b must have a's shape"),
        ((torch.randn(1, 4, 5), torch.randn(1, 4, 5), None), "must be bfloat16"),
        ((torch.randn(1, 4, 5).bfloat16(),) * 2 + (torch.randn(1, 5, 5).bfloat16(),),
         "c must be"),
        ((torch.randn(1, 4, 5).bfloat16(),) * 2 + (torch.randn(1, 4, 4),), "c must be"),
    ],
)
def test_bad_input_raises(args, message):
    with pytest.raises(RuntimeError, match=message):
        symmetric_matmul(*args)


# Inputs whose float32 sums are exact (small multiples of 2^-3, k = 16), so the float64
# reference rounded once to bf16 is the exact expected output of every path.
_EXACT_CODE = """
import torch, rlx_torch
from rlx_torch.ops.symmetric_matmul import symmetric_matmul
g = torch.Generator().manual_seed(0)
for t in (False, True):
    for with_c in (False, True):
        shape = (3, 16, 37) if t else (3, 37, 16)
        a = (torch.randint(-8, 9, shape, generator=g) / 8).bfloat16()
        m = shape[2] if t else shape[1]
        s = torch.randint(-64, 65, (3, m, m), generator=g).double()
        c = (s + s.mT).bfloat16() if with_c else None
        out = symmetric_matmul(a, a, c, 1.5, 0.5, t, diag=0.375)
        ad = a.double()
        full = 1.5 * (ad.mT @ ad if t else ad @ ad.mT) + 0.375 * torch.eye(m, dtype=torch.double)
        if with_c:
            full = full + 0.5 * c.double()
        assert torch.equal(out, full.bfloat16()), (t, with_c, (out.double() - full).abs().max())
        into = torch.full_like(out, float("nan"))
        symmetric_matmul(a, a, c, 1.5, 0.5, t, diag=0.375, out=into)
        assert torch.equal(into, out), (t, with_c)
# 257 + 0.75: once rounded 258; rounding 257 first (to 256, ties to even) gives 256.
a = torch.tensor([[[16.0, 1.0]]]).bfloat16()
assert symmetric_matmul(a, a, None, 1.0, 0.0, False, diag=0.75).item() == 258.0
empty = torch.zeros(2, 3, 0).bfloat16()
c = torch.full((2, 3, 3), 257.0).bfloat16()  # 256 in bf16
assert torch.equal(symmetric_matmul(empty, empty, c, 1.0, 1.0, False, diag=1.5),
                   (256.0 + 1.5 * torch.eye(3)).expand(2, 3, 3).bfloat16())
print("ok")
"""


@pytest.mark.parametrize("fallback", [False, True])
def test_every_path_rounds_once(fallback):
    # The native kernel and the fallback both sum in float32 and round each output once
    # (the fallback once rounded the diagonal twice: bf16 product, then bf16 diagonal add).
    env = dict(os.environ)
    if fallback:
        env["RLX_NO_AVX512_BF16"] = "1"
    result = subprocess.run([sys.executable, "-c", _EXACT_CODE], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
