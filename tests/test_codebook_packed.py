"""rlx::codebook_pack_indices + rlx::codebook_matmul_packed (the packed 16-bit CPU forward)
and CodebookLinear's opt-in use of them, against a float64 reference written from the math:
out[b, n] = s[n] * sum_{g,t} x[b, g*D + t] * C[I[n, g], t] + bias[n]."""

import pytest
import torch
from torch.library import opcheck

import rlx_torch  # noqa: F401
from rlx_torch.nn import CodebookLinear

OPS = torch.ops.rlx


def reference(x, codes, codebook, scales=None, bias=None):
    """float64 math: codes as int64 in [0, E)."""
    n, groups = codes.shape
    w = codebook.double()[codes].reshape(n, groups * codebook.shape[-1])
    out = x.double() @ w.T
    if scales is not None:
        out = out * scales.double()
    if bias is not None:
        out = out + bias.double()
    return out


def as_int16(codes):
    return (codes - 65536 * (codes >= 32768)).to(torch.int16)


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(n, k, e, d=8, seed=0, idx_dtype=torch.int16):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, e, (n, k // d), generator=g)
    idx = as_int16(codes) if idx_dtype == torch.int16 else codes.to(torch.uint16)
    codebook = torch.randn(e, d, generator=g)
    return codes, idx, codebook


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize(
    "n,k,e,slice_entries,block_rows",
    [(37, 40, 65536, 0, 0), (300, 136, 5000, 700, 64), (64, 8, 3, 0, 7), (129, 264, 65536, 1, 1)],
)
def test_matches_float64_math(rows, n, k, e, slice_entries, block_rows):
    codes, idx, codebook = make(n, k, e, seed=rows + n)
    x = torch.randn(rows, k)
    scales, bias = torch.randn(n), torch.randn(n)
    packed = OPS.codebook_pack_indices(idx, e, slice_entries, block_rows)
    out = OPS.codebook_matmul_packed(x, packed, idx, codebook, scales, bias)
    ref = reference(x, codes, codebook, scales, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    assert rel_err(out, ref) < 1e-6
    plain = OPS.codebook_matmul(x, idx, codebook, scales, bias)
    assert rel_err(plain, ref) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_codebook(dtype):
    codes, idx, codebook = make(70, 96, 65536, seed=3, idx_dtype=torch.uint16)
    cb = codebook.to(dtype)
    x = torch.randn(4, 96)
    packed = OPS.codebook_pack_indices(idx, 65536)
    out = OPS.codebook_matmul_packed(x, packed, idx, cb, None, None)
    assert rel_err(out, reference(x, codes, cb)) < 1e-6


def test_leading_dims_strides_and_empty():
    codes, idx, codebook = make(50, 64, 1000, seed=4)
    packed = OPS.codebook_pack_indices(idx, 1000)
    base = torch.randn(3, 2, 128)[..., ::2]  # non-contiguous
    out = OPS.codebook_matmul_packed(base, packed, idx, codebook, None, None)
    assert out.shape == (3, 2, 50)
    assert rel_err(out, reference(base.reshape(6, 64), codes, codebook).reshape(3, 2, 50)) < 1e-6
    x0 = torch.randn(1, 64).expand(4, 64)  # stride 0
    assert rel_err(OPS.codebook_matmul_packed(x0, packed, idx, codebook, None, None),
                   reference(x0, codes, codebook)) < 1e-6
    empty = OPS.codebook_matmul_packed(torch.randn(0, 64), packed, idx, codebook, None, None)
    assert empty.shape == (0, 50)


def test_other_dtypes_and_many_rows_take_the_plain_op():
    codes, idx, codebook = make(33, 48, 300, seed=5)
    packed = OPS.codebook_pack_indices(idx, 300)
    x64 = torch.randn(2, 48, dtype=torch.float64)
    out = OPS.codebook_matmul_packed(x64, packed, idx, codebook.double(), None, None)
    assert (out - reference(x64, codes, codebook)).abs().max() < 1e-12
    x = torch.randn(40, 48)
    assert rel_err(OPS.codebook_matmul_packed(x, packed, idx, codebook, None, None),
                   reference(x, codes, codebook)) < 1e-6


def test_deterministic_across_thread_counts():
    _, idx, codebook = make(600, 256, 65536, seed=6)
    x = torch.randn(1, 256)
    packed = OPS.codebook_pack_indices(idx, 65536, 0, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.codebook_matmul_packed(x, packed, idx, codebook, None, None)
        torch.set_num_threads(max(2, threads))
        many = OPS.codebook_matmul_packed(x, packed, idx, codebook, None, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_bad_inputs_raise():
    _, idx, codebook = make(20, 32, 100, seed=7)
    packed = OPS.codebook_pack_indices(idx, 100)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="indices must be < num_entries"):
        OPS.codebook_pack_indices(idx, 10)
    with pytest.raises(ValueError, match="int16 or uint16"):
        OPS.codebook_pack_indices(idx.to(torch.uint8), 100)
    other = OPS.codebook_pack_indices(idx[:10], 100)
    with pytest.raises(ValueError, match="not the layout of these indices"):
        OPS.codebook_matmul_packed(x, other, idx, codebook, None, None)
    with pytest.raises(ValueError, match="not the layout of these indices"):
        OPS.codebook_matmul_packed(x, packed, idx, torch.randn(200, 8), None, None)
    with pytest.raises(ValueError, match="packed must be a 1-d int32"):
        OPS.codebook_matmul_packed(x, packed.float(), idx, codebook, None, None)
    with pytest.raises(ValueError, match="codebook must have x's dtype"):
        OPS.codebook_matmul_packed(x.double(), packed, idx, codebook, None, None)


def test_autograd_is_the_plain_ops():
    codes, idx, codebook = make(9, 16, 70, seed=8)
    packed = OPS.codebook_pack_indices(idx, 70)
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    cb = codebook.double().requires_grad_()
    s = torch.randn(9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    fn = lambda *a: OPS.codebook_matmul_packed(a[0], packed, idx, *a[1:])  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, cb, s, b))
    assert torch.autograd.gradgradcheck(fn, (x, cb, s, b))
    assert torch.autograd.gradcheck(fn, (x, cb, s, b), check_forward_ad=True,
                                    check_backward_ad=False, check_undefined_grad=False)


def test_opcheck():
    _, idx, codebook = make(11, 24, 400, seed=9)
    packed = OPS.codebook_pack_indices(idx, 400)
    args = (torch.randn(2, 24), packed, idx, codebook, torch.randn(11), torch.randn(11))
    opcheck(OPS.codebook_matmul_packed.default, args)
    opcheck(OPS.codebook_pack_indices.default, (idx, 400),
            test_utils=("test_schema", "test_faketensor"))


def test_compile():
    codes, idx, codebook = make(13, 32, 500, seed=10)
    packed = OPS.codebook_pack_indices(idx, 500)
    fn = torch.compile(lambda x: OPS.codebook_matmul_packed(x, packed, idx, codebook, None, None),
                       fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 32)
    assert rel_err(fn(x), reference(x, codes, codebook)) < 1e-6


def test_codebook_linear_cache_follows_indices():
    torch.manual_seed(11)
    layer = CodebookLinear(64, 40, entry_dim=8, num_entries=65536)
    layer.cpu_packed_forward = True
    x = torch.randn(2, 64)
    with torch.no_grad():
        first = layer(x)
        codes = layer.indices.to(torch.int64) % 65536
        ref = reference(x, codes, layer.codebook, layer.scales, layer.bias)
        assert rel_err(first, ref) < 1e-6
        packed = layer._packed_indices._packed
        assert packed is not None
        layer(x)
        assert layer._packed_indices._packed is packed  # reused
        new = torch.randint(0, 65536, layer.indices.shape)
        layer.indices.copy_(as_int16(new))  # in place: _version changes
        out = layer(x)
        assert layer._packed_indices._packed is not packed
        assert rel_err(out, reference(x, new, layer.codebook, layer.scales, layer.bias)) < 1e-6
    # With gradients the layer takes the plain op and trains as before.
    y = layer(x)
    y.sum().backward()
    assert layer.codebook.grad is not None
