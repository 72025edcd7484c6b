"""Dense weights from codebook indices, and the index dtypes codebooks use."""

from __future__ import annotations

import torch

__all__ = ["dequantize", "index_dtype", "max_entries", "pack_indices"]

_MAX_ENTRIES = 1 << 16


def max_entries() -> int:
    """The largest number of entries a codebook may have (16-bit indices).

    Example::

        >>> rlx_torch.quant.max_entries()
        65536
    """
    return _MAX_ENTRIES


def index_dtype(num_entries: int) -> torch.dtype:
    """The dtype of indices into a codebook of ``num_entries`` entries: uint8 up to 256 entries,
    else int16 (read as unsigned 16-bit, so 65,536 entries fit).

    Example::

        >>> rlx_torch.quant.index_dtype(256), rlx_torch.quant.index_dtype(65536)
        (torch.uint8, torch.int16)
    """
    if not 1 <= num_entries <= _MAX_ENTRIES:
        raise ValueError(f"num_entries must be in [1, {_MAX_ENTRIES}], got {num_entries}")
    return torch.uint8 if num_entries <= 256 else torch.int16


def pack_indices(values: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Integer ``values`` in ``[0, num_entries)`` stored as :func:`index_dtype` (int16 holds
    32768..65535 as their unsigned bit patterns, i.e. negative numbers).

    Example::

        >>> rlx_torch.quant.pack_indices(torch.tensor([0, 40000]), 65536)
        tensor([     0, -25536], dtype=torch.int16)
    """
    dtype = index_dtype(num_entries)
    if dtype == torch.int16:
        values = torch.where(values >= 1 << 15, values - (1 << 16), values)
    return values.to(dtype)


def _as_long(indices: torch.Tensor) -> torch.Tensor:
    if indices.dtype in (torch.uint8, torch.uint16):
        return indices.long()
    if indices.dtype == torch.int16:
        return indices.long() & 0xFFFF  # 16-bit indices are unsigned: -1 means 65535
    raise ValueError(f"dequantize: indices must be uint8, int16 or uint16, got {indices.dtype}")


def dequantize(
    indices: torch.Tensor, codebook: torch.Tensor, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """The dense weight ``W[j, g*D + t] = scales[j] * sum_m codebook[m, indices[j, g, m], t]``.

    ``indices`` is ``[N, K/D]`` with ``codebook`` ``[E, D]``, or ``[N, K/D, M]`` with ``[M, E, D]``;
    uint8, int16 (read as unsigned 16-bit) or uint16. Returns ``[N, K]`` in the codebook's
    dtype, differentiable in ``codebook`` and ``scales``. Builds the whole matrix: for
    products, use ``rlx_torch.codebook_matmul``, which does not.

    Example::

        >>> idx = torch.randint(0, 16, (4, 2), dtype=torch.uint8)
        >>> rlx_torch.quant.dequantize(idx, torch.randn(16, 8)).shape
        torch.Size([4, 16])
    """
    if indices.dim() not in (2, 3) or codebook.dim() != indices.dim():
        raise ValueError(
            "dequantize: indices/codebook must be [N, K/D]/[E, D] or [N, K/D, M]/[M, E, D], "
            f"got {tuple(indices.shape)} and {tuple(codebook.shape)}"
        )
    idx = _as_long(indices)
    if idx.dim() == 2:
        idx, codebook = idx.unsqueeze(-1), codebook.unsqueeze(0)
    n, groups, num_codebooks = idx.shape
    if codebook.shape[0] != num_codebooks:
        raise ValueError(
            f"dequantize: indices have M={num_codebooks} codebooks, codebook has "
            f"{codebook.shape[0]}"
        )
    entries, dim = codebook.shape[1], codebook.shape[2]
    if idx.device.type != "meta" and idx.numel() and int(idx.max()) >= entries:
        raise ValueError(f"dequantize: indices must be < E={entries}, got {int(idx.max())}")
    # One gather over the M codebooks laid end to end, then a sum over M.
    offsets = torch.arange(num_codebooks, device=idx.device) * entries
    flat = codebook.reshape(num_codebooks * entries, dim)
    weight = flat[(idx + offsets).reshape(-1)].reshape(n, groups, num_codebooks, dim).sum(2)
    weight = weight.reshape(n, groups * dim)
    if scales is not None:
        weight = weight * scales.reshape(n, 1)
    return weight
