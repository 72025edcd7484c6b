"""rlx_torch.quant: dense weights from indices (against an element-by-element float64 loop),
k-means edge cases, and the docstring examples of quant and CodebookLinear."""


import pytest
import torch

from rlx_torch.nn import CodebookLinear
from rlx_torch.quant import dequantize, kmeans


def dense_weight_float64(indices, codebook, scales):
    """W[j, g*D + t] = scales[j] * sum_m codebook[m, indices[j, g, m], t], element by element."""
    idx = indices.long() % 65536  # int16 indices are unsigned
    if idx.dim() == 2:
        idx, codebook = idx[..., None], codebook[None]
    n, groups, m = idx.shape
    d = codebook.shape[-1]
    w = torch.zeros(n, groups * d, dtype=torch.float64)
    for j in range(n):
        for g in range(groups):
            for c in range(m):
                w[j, g * d : (g + 1) * d] += codebook[c, int(idx[j, g, c])].double()
    return w * scales.double()[:, None] if scales is not None else w


@pytest.mark.parametrize("num_codebooks,num_entries", [(1, 11), (2, 11), (3, 256), (1, 40000)])
def test_dequantize_matches_float64(num_codebooks, num_entries):
    layer = CodebookLinear(
        24, 10, entry_dim=3, num_entries=num_entries, num_codebooks=num_codebooks
    ).double()
    with torch.no_grad():
        layer.scales.uniform_(0.5, 2)
    if num_entries > 256:  # indices >= 32768 are stored as negative int16
        assert layer.indices.dtype == torch.int16 and int(layer.indices.min()) < 0
    want = dense_weight_float64(layer.indices, layer.codebook.detach(), layer.scales.detach())
    torch.testing.assert_close(layer.dequantize(), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.weight, want, rtol=1e-12, atol=1e-12)
    unscaled = dense_weight_float64(layer.indices, layer.codebook.detach(), None)
    torch.testing.assert_close(dequantize(layer.indices, layer.codebook), unscaled)
    if num_entries > 256:  # the same indices as uint16
        as_uint16 = (layer.indices.long() % 65536).to(torch.int32).to(torch.uint16)
        torch.testing.assert_close(dequantize(as_uint16, layer.codebook), unscaled)
    dense = layer.dequantize()
    dense.square().sum().backward()  # differentiable in codebook and scales
    assert layer.codebook.grad is not None and layer.scales.grad is not None


def test_dequantize_rejects_bad_input():
    cb = torch.randn(8, 4)
    with pytest.raises(ValueError, match="indices must be < E=8"):
        dequantize(torch.full((2, 3), 8, dtype=torch.uint8), cb)
    with pytest.raises(ValueError, match="uint8, int16 or uint16"):
        dequantize(torch.zeros(2, 3, dtype=torch.int32), cb)
    with pytest.raises(ValueError, match="indices/codebook"):
        dequantize(torch.zeros(2, 3, 1, dtype=torch.uint8), cb)
    with pytest.raises(ValueError, match="M=2"):
        dequantize(torch.zeros(2, 3, 2, dtype=torch.uint8), cb[None])


def test_kmeans_of_no_vectors_keeps_dtype():
    centroids, codes = kmeans(torch.zeros(0, 4, dtype=torch.float64), 8, iters=3)
    assert centroids.shape == (8, 4) and centroids.dtype == torch.float64 and codes.numel() == 0
