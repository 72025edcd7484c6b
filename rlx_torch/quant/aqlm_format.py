"""AQLM's tensor layout, to and from ``CodebookLinear``'s.

AQLM (``aqlm.QuantizedLinear``) stores a weight ``W [N, K]`` as

- ``codes`` ``[N/out_group_size, K/in_group_size, M]``, int8 for up to 8 bits per code, int16
  for up to 16, each code stored modulo ``2**nbits`` as a signed number (values
  ``>= 2**(nbits-1)`` minus ``2**nbits``);
- ``codebooks`` ``[M, 2**nbits, out_group_size, in_group_size]``;
- ``scales`` ``[N/out_group_size, 1, 1, 1]``;

with ``W[o*og + r, i*ig + t] = scales[o] * sum_m codebooks[m, codes[o, i, m], r, t]``.
``CodebookLinear`` has ``indices [N, K/D, M]`` (``[N, K/D]`` when M = 1), ``codebook [M, E, D]``
(``[E, D]``) and ``scales [N]``. With ``out_group_size = 1`` the two are the same numbers. With
``out_group_size = og > 1`` the ``og`` rows of an output group become one codebook of
``og * 2**nbits`` entries (entry ``r * 2**nbits + c`` is ``codebooks[m, c, r, :]``), which is the
same weight; it needs ``og * 2**nbits <= 65536``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .codebook import max_entries, pack_indices

__all__ = ["AqlmTensors", "from_aqlm_tensors", "to_aqlm_tensors"]


class AqlmTensors(NamedTuple):
    """AQLM's ``codes``, ``codebooks`` and ``scales`` for one layer (see the module docstring).

    Example::

        >>> idx = torch.randint(0, 256, (4, 2), dtype=torch.uint8)
        >>> aq = rlx_torch.quant.to_aqlm_tensors(idx, torch.randn(256, 8), torch.ones(4))
        >>> aq.codes.shape, aq.codebooks.shape, aq.scales.shape
        (torch.Size([4, 2, 1]), torch.Size([1, 256, 1, 8]), torch.Size([4, 1, 1, 1]))
    """

    codes: torch.Tensor
    codebooks: torch.Tensor
    scales: torch.Tensor


def _nbits(codebook_size: int, what: str) -> int:
    nbits = codebook_size.bit_length() - 1
    if codebook_size < 1 or 1 << nbits != codebook_size:
        raise ValueError(f"{what}: the codebook size must be a power of two, got {codebook_size}")
    return nbits


def from_aqlm_tensors(
    codes: torch.Tensor,
    codebooks: torch.Tensor,
    scales: torch.Tensor | None,
    *,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """AQLM's ``(codes, codebooks, scales)`` as ``(indices, codebook, scales)`` for CodebookLinear.

    ``codes`` must be in AQLM's layout ``[out_groups, in_groups, M]`` (any integer dtype; read
    modulo ``2**nbits``, ``2**nbits = codebooks.shape[1]``). Indices come back uint8 for up to
    256 entries, else int16; ``M = 1`` is squeezed. ``dtype`` (default: the codebooks') is the
    dtype of the codebook and scales.

    Example::

        >>> codes = torch.randint(-128, 128, (6, 4, 2), dtype=torch.int8)
        >>> idx, cb, s = rlx_torch.quant.from_aqlm_tensors(
        ...     codes, torch.randn(2, 256, 1, 8), torch.rand(6, 1, 1, 1))
        >>> idx.dtype, idx.shape, cb.shape, s.shape
        (torch.uint8, torch.Size([6, 4, 2]), torch.Size([2, 256, 8]), torch.Size([6]))
    """
    if codebooks.dim() != 4:
        raise ValueError(
            "from_aqlm: codebooks must be [num_codebooks, 2**nbits, out_group_size, "
            f"in_group_size], got {tuple(codebooks.shape)}"
        )
    num_codebooks, size, out_group, in_group = codebooks.shape
    nbits = _nbits(size, "from_aqlm")
    if codes.dim() != 3 or codes.shape[2] != num_codebooks:
        raise ValueError(
            f"from_aqlm: codes must be [out_groups, in_groups, num_codebooks={num_codebooks}], "
            f"got {tuple(codes.shape)}"
        )
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"from_aqlm: codes must be an integer tensor, got {codes.dtype}")
    entries = out_group * size
    if entries > max_entries():
        raise ValueError(
            f"from_aqlm: out_group_size={out_group} with {nbits}-bit codebooks needs "
            f"{entries} entries per codebook; at most {max_entries()} are supported"
        )
    if scales is not None and scales.numel() != codes.shape[0]:
        raise ValueError(
            f"from_aqlm: scales must have out_groups={codes.shape[0]} elements "
            f"([out_groups, 1, 1, 1]), got {tuple(scales.shape)}"
        )
    dtype = dtype or codebooks.dtype
    out_groups, in_groups = codes.shape[:2]
    values = codes.long() % size  # AQLM's signed storage, read modulo 2**nbits
    if out_group > 1:
        row_offset = torch.arange(out_group, device=codes.device).view(1, out_group, 1, 1) * size
        values = (values.unsqueeze(1) + row_offset).reshape(out_groups * out_group, in_groups, -1)
    indices = pack_indices(values, entries)
    # [M, E, og, ig] -> [M, og, E, ig]: entry r*E + c of the merged codebook is row r of entry c.
    codebook = codebooks.permute(0, 2, 1, 3).reshape(num_codebooks, entries, in_group).to(dtype)
    if scales is not None:
        scales = scales.reshape(-1).to(dtype).repeat_interleave(out_group)
    if num_codebooks == 1:
        indices, codebook = indices[..., 0], codebook[0]
    return indices.contiguous(), codebook.contiguous(), scales


def to_aqlm_tensors(
    indices: torch.Tensor,
    codebook: torch.Tensor,
    scales: torch.Tensor | None,
    *,
    out_group_size: int = 1,
    dtype: torch.dtype | None = None,
) -> AqlmTensors:
    """``CodebookLinear``'s ``(indices, codebook, scales)`` in AQLM's layout.

    The inverse of :func:`from_aqlm_tensors`. The number of entries per codebook must be
    ``out_group_size * 2**nbits``; with ``out_group_size > 1`` the layer must have AQLM's
    structure (rows of a group share codes and scale), else ``ValueError``. ``scales`` None
    gives ones. ``dtype`` (default: the codebook's) is the dtype of codebooks and scales.

    Example::

        >>> idx = torch.randint(0, 256, (6, 4), dtype=torch.uint8)
        >>> t = rlx_torch.quant.to_aqlm_tensors(idx, torch.randn(256, 8), torch.rand(6))
        >>> t.codes.dtype, t.codes.shape, t.codebooks.shape, t.scales.shape
        (torch.int8, torch.Size([6, 4, 1]), torch.Size([1, 256, 1, 8]), torch.Size([6, 1, 1, 1]))
    """
    if indices.dim() == 2:
        indices, codebook = indices.unsqueeze(-1), codebook.unsqueeze(0)
    if indices.dim() != 3 or codebook.dim() != 3 or codebook.shape[0] != indices.shape[2]:
        raise ValueError(
            "to_aqlm: indices/codebook must be [N, K/D]/[E, D] or [N, K/D, M]/[M, E, D], got "
            f"{tuple(indices.shape)} and {tuple(codebook.shape)}"
        )
    n, in_groups, num_codebooks = indices.shape
    entries, in_group = codebook.shape[1], codebook.shape[2]
    og = out_group_size
    if og < 1 or n % og or entries % og:
        raise ValueError(
            f"to_aqlm: out_group_size={og} must divide out_features={n} and the "
            f"{entries} codebook entries"
        )
    size = entries // og
    nbits = _nbits(size, "to_aqlm")
    dtype = dtype or codebook.dtype
    values = indices.long() & 0xFFFF if indices.dtype == torch.int16 else indices.long()
    scales = torch.ones(n, dtype=dtype, device=codebook.device) if scales is None else scales
    if og > 1:
        values = values.reshape(n // og, og, in_groups, num_codebooks)
        row = torch.arange(og, device=values.device).view(1, og, 1, 1)
        if not ((values // size == row).all() and (values % size == values[:, :1] % size).all()):
            raise ValueError(
                f"to_aqlm: with out_group_size={og} the rows of each output group must share "
                "codes, row r using entries [r*E, (r+1)*E); this layer's indices do not"
            )
        grouped = scales.reshape(n // og, og)
        if not (grouped == grouped[:, :1]).all():
            raise ValueError(
                f"to_aqlm: with out_group_size={og} the rows of each output group must share "
                "one scale (AQLM stores one per group); this layer's scales differ"
            )
        values, scales = values[:, 0] % size, grouped[:, 0]
    # AQLM's signed storage: codes >= 2**(nbits-1) are stored minus 2**nbits.
    if nbits:
        values = torch.where(values >= 1 << (nbits - 1), values - (1 << nbits), values)
    codes = values.to(torch.int8 if nbits <= 8 else torch.int16)
    codebooks = codebook.reshape(num_codebooks, og, size, in_group).permute(0, 2, 1, 3)
    return AqlmTensors(
        codes.contiguous(),
        codebooks.to(dtype).contiguous(),
        scales.reshape(-1, 1, 1, 1).to(dtype).contiguous(),
    )
