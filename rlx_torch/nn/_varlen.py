"""Packed-sequence helpers: validating cu_seqlens, padding mask <-> packed rows."""

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, x: torch.Tensor, who: str) -> None:
    """Checks int ``[N + 1]`` offsets of N sequences packed in ``x [1, total, ...]``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"{who}: cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{who}: cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if x.shape[0] != 1:
        raise ValueError(
            f"{who}: with cu_seqlens the input must be packed as batch 1 [1, total, ...], "
            f"got batch {x.shape[0]}"
        )
    if torch.compiler.is_compiling():
        return  # value checks would need a host sync inside the graph
    total = x.shape[1]
    if cu_seqlens[0].item() != 0 or cu_seqlens[-1].item() != total:
        raise ValueError(
            f"{who}: cu_seqlens must start at 0 and end at the packed length {total}, "
            f"got {cu_seqlens.tolist()}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"{who}: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")


def sequence_positions(cu_seqlens: torch.Tensor, total: int):
    """For each packed row: the index of its sequence and its position inside that sequence."""
    offsets = cu_seqlens.to(torch.int64)
    rows = torch.arange(total, device=offsets.device)
    seq = torch.searchsorted(offsets[1:], rows, right=True)
    return seq, rows - offsets[seq]


def unpad(x: torch.Tensor, mask: torch.Tensor):
    """``x [B, T, ...]`` and a 0/1 ``mask [B, T]`` -> (``x[1, n_kept, ...]``, row indices,
    ``cu_seqlens [B + 1]``). The kept tokens of each row become one packed sequence."""
    keep = mask.reshape(-1).to(torch.bool)
    indices = keep.nonzero().squeeze(1)
    lengths = mask.to(torch.bool).sum(dim=1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int64)
    packed = x.reshape(-1, *x.shape[2:]).index_select(0, indices).unsqueeze(0)
    return packed, indices, cu_seqlens


def repad(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad`; padded positions are zero."""
    flat = packed.new_zeros(batch * seqlen, *packed.shape[2:])
    flat = flat.index_copy(0, indices, packed[0])
    return flat.reshape(batch, seqlen, *packed.shape[2:])
