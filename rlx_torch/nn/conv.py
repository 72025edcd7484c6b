"""Depthwise causal short convolution: the local token mixer in front of linear attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._varlen import check_cu_seqlens, sequence_positions

__all__ = ["ShortConvolution"]


class ShortConvolution(nn.Conv1d):
    """Depthwise causal 1-D convolution over time, followed by SiLU (fla's ``ShortConvolution``).

    Inputs are ``[B, T, D]`` (time-major, like the rest of the layer). Output ``t`` only sees
    inputs ``t - W + 1 .. t``. The weight is ``[D, 1, W]`` as in ``nn.Conv1d(D, D, W, groups=D)``.

    ``forward(x, mask=None, cache=None, output_final_state=False, cu_seqlens=None)``:

    - ``mask``: ``[B, T]`` 0/1 padding mask; padded inputs are zeroed before the convolution.
    - ``cache``: conv state ``[N, D, W]`` from an earlier call: the last ``W`` inputs of each
      sequence (oldest first, zero-filled for short sequences). Continuing from it gives exactly
      what one call over the concatenated input gives. ``N = B``, or the number of packed
      sequences with ``cu_seqlens``.
    - ``cu_seqlens``: ``[N + 1]`` int64 offsets of ``N`` sequences packed in ``x`` of shape
      ``[1, total, D]``; no sequence sees another's inputs.

    Returns ``(y, final_state)``; ``final_state`` (``[N, D, W]``) is ``None`` unless
    ``output_final_state``.

    Example::

        >>> conv = ShortConvolution(8, kernel_size=4)
        >>> y, state = conv(torch.randn(2, 5, 8), output_final_state=True)
        >>> y.shape, state.shape
        (torch.Size([2, 5, 8]), torch.Size([2, 8, 4]))
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False,
                 activation: str | None = "silu", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: kernel_size must be >= 1, got {kernel_size}")
        if activation not in ("silu", "swish", None):
            raise ValueError(
                f"ShortConvolution: activation must be 'silu', 'swish' or None, got {activation!r}"
            )
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias,
                         padding=0, device=device, dtype=dtype)
        self.hidden_size = hidden_size
        self.activation = activation

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        W, D = self.kernel_size[0], self.hidden_size
        if x.dim() != 3 or x.shape[-1] != D:
            raise ValueError(f"ShortConvolution: x must be [B, T, {D}], got {tuple(x.shape)}")
        if mask is not None:
            if mask.shape != x.shape[:2]:
                raise ValueError(
                    f"ShortConvolution: mask must be [B, T] = {tuple(x.shape[:2])}, "
                    f"got {tuple(mask.shape)}"
                )
            x = x * mask.unsqueeze(-1).to(x.dtype)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, x, "ShortConvolution")
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is not None and cache.shape != (N, D, W):
            raise ValueError(
                f"ShortConvolution: cache must be [N, D, W] = {(N, D, W)}, got {tuple(cache.shape)}"
            )
        if cu_seqlens is None:
            y, final = self._dense(x, cache, output_final_state)
        else:
            y, final = self._packed(x, cache, output_final_state, cu_seqlens)
        if self.bias is not None:
            y = y + self.bias
        if self.activation is not None:
            y = F.silu(y)
        return y, final

    def _dense(self, x, cache, output_final_state):
        B, T, D = x.shape
        W = self.kernel_size[0]
        history = x.new_zeros(B, W, D) if cache is None else cache.to(x.dtype).transpose(1, 2)
        padded = torch.cat([history, x], dim=1)  # [B, W + T, D]; its last W-1 history rows are
        # the left context of x. A sum of W shifted products: as fast as the depthwise F.conv1d
        # on CPU (benchmarks/bench_layers.py), plain elementwise ops on every backend and dtype.
        y = padded[:, 1:T + 1] * self.weight[:, 0, 0]
        for tap in range(1, W):
            y = y + padded[:, 1 + tap:1 + tap + T] * self.weight[:, 0, tap]
        final = padded[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return y, final

    def _packed(self, x, cache, output_final_state, cu_seqlens):
        # Every output reads W inputs at offsets -W+1..0 of its own sequence; offsets before the
        # sequence start read its cached history instead (zeros without a cache). One gather from
        # [history rows; packed rows] does that for all sequences at once.
        total, D = x.shape[1], x.shape[2]
        W = self.kernel_size[0]
        N = cu_seqlens.numel() - 1
        history = x.new_zeros(N, D, W) if cache is None else cache.to(x.dtype)
        rows = torch.cat([history.transpose(1, 2).reshape(N * W, D), x[0]], dim=0)
        seq, pos = sequence_positions(cu_seqlens, total)
        start = cu_seqlens[:-1].to(seq.device)

        def gather(seq_idx, rel):  # rel: position inside the sequence, may be in [-W, 0)
            hist_idx = seq_idx * W + W + rel
            data_idx = N * W + start[seq_idx] + rel
            return rows[torch.where(rel >= 0, data_idx, hist_idx.clamp(min=0))]

        taps = torch.arange(-W + 1, 1, device=x.device)  # oldest first, like the weight
        windows = gather(seq[:, None], pos[:, None] + taps)  # [total, W, D]
        y = torch.einsum("twd,dw->td", windows, self.weight[:, 0, :]).unsqueeze(0)
        final = None
        if output_final_state:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(x.device)
            seq_ids = torch.arange(N, device=x.device)
            last = gather(seq_ids[:, None], lengths[:, None] + torch.arange(-W, 0, device=x.device))
            final = last.transpose(1, 2).contiguous()  # [N, D, W]
        return y, final
