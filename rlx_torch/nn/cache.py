"""Decoding state of a stack of recurrent layers."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RecurrentCache"]


class RecurrentCache:
    """Per-layer state for incremental decoding, keyed by the layer's ``layer_idx``.

    Each entry is a dict with ``recurrent_state`` (``[N, HV, K, V]`` float32), ``conv_state``
    (a tuple of ``[N, D, W]`` tensors, or ``None`` without short convolutions) and ``seen``
    (the number of time steps consumed so far: the ``T`` of each call, added up). Pass the same
    cache object to every layer of a model, and again on each decoding step.

    Example::

        >>> cache = RecurrentCache()
        >>> cache.update(0, torch.zeros(2, 1, 4, 4), None, seq_len=5)
        >>> cache.get_seq_length(), cache.get(0)["recurrent_state"].shape
        (5, torch.Size([2, 1, 4, 4]))
    """

    def __init__(self) -> None:
        self.layers: dict[Any, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer_idx: object) -> bool:
        return layer_idx in self.layers

    def get(self, layer_idx: int | None) -> dict[str, Any] | None:
        """The state of layer ``layer_idx``, or ``None`` before its first step.

        Example::

            >>> RecurrentCache().get(0) is None
            True
        """
        return self.layers.get(layer_idx)

    def update(self, layer_idx: int | None, recurrent_state: torch.Tensor,
               conv_state: tuple[torch.Tensor, ...] | None, seq_len: int) -> None:
        """Stores layer ``layer_idx``'s states after a call over ``seq_len`` more time steps.

        Example::

            >>> cache = RecurrentCache()
            >>> for _ in range(3):
            ...     cache.update(1, torch.zeros(1, 1, 2, 2), None, seq_len=1)
            >>> cache.get_seq_length(1)
            3
        """
        seen = self.layers[layer_idx]["seen"] if layer_idx in self.layers else 0
        self.layers[layer_idx] = {
            "recurrent_state": recurrent_state,
            "conv_state": conv_state,
            "seen": seen + seq_len,
        }

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Time steps consumed so far (by ``layer_idx``, or by the first layer).

        Example::

            >>> RecurrentCache().get_seq_length()
            0
        """
        if not self.layers:
            return 0
        key = next(iter(self.layers)) if layer_idx is None else layer_idx
        return self.layers[key]["seen"] if key in self.layers else 0

    def select(self, indices: torch.Tensor) -> RecurrentCache:
        """A cache holding only the sequences ``indices`` (e.g. to reorder beams or drop
        finished sequences). The tensors are gathered, never shared.

        Example::

            >>> cache = RecurrentCache()
            >>> cache.update(0, torch.arange(3.0).view(3, 1, 1, 1), None, seq_len=2)
            >>> cache.select(torch.tensor([2, 0])).get(0)["recurrent_state"].flatten()
            tensor([2., 0.])
        """
        out = RecurrentCache()
        for key, entry in self.layers.items():
            conv = entry["conv_state"]
            out.layers[key] = {
                "recurrent_state": entry["recurrent_state"].index_select(0, indices),
                "conv_state": None if conv is None else tuple(c.index_select(0, indices)
                                                              for c in conv),
                "seen": entry["seen"],
            }
        return out
