"""Decoding state of a stack of recurrent layers."""

import torch


class RecurrentCache:
    """Per-layer state for incremental decoding, keyed by the layer's ``layer_idx``.

    Each entry is a dict with ``recurrent_state`` (``[N, HV, K, V]`` float32), ``conv_state``
    (a tuple of ``[N, D, W]`` tensors, or ``None`` without short convolutions) and ``seen``
    (the number of time steps consumed so far: the ``T`` of each call, added up). Pass the same
    cache object to every layer of a model, and again on each decoding step.
    """

    def __init__(self):
        self.layers: dict = {}

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer_idx) -> bool:
        return layer_idx in self.layers

    def get(self, layer_idx):
        """The state of layer ``layer_idx``, or ``None`` before its first step."""
        return self.layers.get(layer_idx)

    def update(self, layer_idx, recurrent_state: torch.Tensor, conv_state, seq_len: int) -> None:
        seen = self.layers[layer_idx]["seen"] if layer_idx in self.layers else 0
        self.layers[layer_idx] = {
            "recurrent_state": recurrent_state,
            "conv_state": conv_state,
            "seen": seen + seq_len,
        }

    def get_seq_length(self, layer_idx=None) -> int:
        """Time steps consumed so far (by ``layer_idx``, or by the first layer)."""
        if not self.layers:
            return 0
        key = next(iter(self.layers)) if layer_idx is None else layer_idx
        return self.layers[key]["seen"] if key in self.layers else 0

    def select(self, indices: torch.Tensor) -> "RecurrentCache":
        """A cache holding only the sequences ``indices`` (e.g. to reorder beams or drop
        finished sequences). The tensors are gathered, never shared."""
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
