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

    def _shifted_sum(self, rows: torch.Tensor, length: int) -> torch.Tensor:
        """``out[..., j, :] = sum_tap rows[..., j + tap, :] * weight[:, 0, tap]`` for
        ``j < length``: the convolution over the time dim (-2) of rows that hold each output's
        left context before it."""
        out = rows[..., 0:length, :] * self.weight[:, 0, 0]
        for tap in range(1, self.kernel_size[0]):
            out = out + rows[..., tap:tap + length, :] * self.weight[:, 0, tap]
        return out

    def _dense(self, x, cache, output_final_state):
        B, T, D = x.shape
        W = self.kernel_size[0]
        history = x.new_zeros(B, W, D) if cache is None else cache.to(x.dtype).transpose(1, 2)
        padded = torch.cat([history, x], dim=1)  # [B, W + T, D]; its last W-1 history rows are
        # the left context of x. A sum of W shifted products: as fast as the depthwise F.conv1d
        # on CPU (benchmarks/bench_layers.py), plain elementwise ops on every backend and dtype.
        y = self._shifted_sum(padded[:, 1:], T)
        final = padded[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return y, final

    def _packed(self, x, cache, output_final_state, cu_seqlens):
        # Lay the sequences out one after another, each preceded by the W - 1 rows of its left
        # context (its cached history, zeros without a cache), and run the same sum of shifted
        # products as the dense path over that layout: no output then reads across a sequence
        # boundary, and every op is elementwise or a slice. (Written as an einsum over gathered
        # windows, the weight gradient is a reduction over tokens that torch 2.11's inductor
        # miscompiles when D is not a multiple of its vector width: docs/troubleshooting.md.)
        total, D = x.shape[1], x.shape[2]
        W = self.kernel_size[0]
        N = cu_seqlens.numel() - 1
        history = x.new_zeros(N, D, W) if cache is None else cache.to(x.dtype)
        rows = torch.cat([history.transpose(1, 2).reshape(N * W, D), x[0]], dim=0)
        seq, _ = sequence_positions(cu_seqlens, total)
        start = cu_seqlens[:-1].to(device=seq.device, dtype=torch.int64)
        # Row t of x goes to t + (seq + 1)(W - 1); history row h of sequence s (its last W - 1
        # rows, h = 1..W-1) to start[s] + s(W - 1) + h - 1.
        token = torch.arange(total, device=x.device)
        at_token = token + (seq + 1) * (W - 1)
        h = torch.arange(1, W, device=x.device)
        seq_ids = torch.arange(N, device=x.device)
        at_hist = (start + seq_ids * (W - 1))[:, None] + h - 1  # [N, W - 1]
        src_hist = seq_ids[:, None] * W + h
        source = torch.empty(total + N * (W - 1), dtype=torch.int64, device=x.device)
        source[at_token] = N * W + token
        source[at_hist.reshape(-1)] = src_hist.reshape(-1)
        ext = rows[source]  # [total + N(W - 1), D]
        y_ext = self._shifted_sum(ext, ext.shape[0] - (W - 1))
        # The output of row t is the one whose window ends at t's own position.
        y = y_ext[token + seq * (W - 1)].unsqueeze(0)
        final = None
        if output_final_state:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=x.device, dtype=torch.int64)
            rel = lengths[:, None] + torch.arange(-W, 0, device=x.device)  # may be in [-W, 0)
            hist_idx = seq_ids[:, None] * W + W + rel
            data_idx = N * W + start[:, None] + rel
            last = rows[torch.where(rel >= 0, data_idx, hist_idx.clamp(min=0))]
            final = last.transpose(1, 2).contiguous()  # [N, D, W]
        return y, final
