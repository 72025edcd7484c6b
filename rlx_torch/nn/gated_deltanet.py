"""The Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh, ICLR 2025), structured like fla's
``fla/layers/gated_deltanet.py`` (same argument names, parameter names and return value) and
running on ``rlx_torch.gated_delta_rule``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.gated_delta import gated_delta_rule
from ._varlen import check_cu_seqlens, repad, unpad
from .cache import RecurrentCache
from .conv import ShortConvolution
from .norm import RMSNormGated

__all__ = ["GatedDeltaNet"]

_MODES = ("chunk", "fused_recurrent")


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer: ``[B, T, hidden_size] -> [B, T, hidden_size]``, a drop-in for fla's
    ``fla.layers.GatedDeltaNet`` (argument names, defaults, parameter names and the
    ``(o, None, past_key_values)`` return value are fla's; docs/layers.md lists the differences).

    q/k/v projections -> depthwise causal short convolutions with SiLU -> gated delta rule with
    L2-normalized q and k, ``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``)
    and the log decay ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` (one per value head
    for ``gate="head"``, one per key channel for ``gate="channel"``, as in Kimi Delta Attention)
    -> per-head gated RMSNorm ``RMSNorm(o) * w * silu(g_proj(x))`` -> ``o_proj``.

    Sizes: ``head_k_dim = head_dim``, ``head_v_dim = head_dim * expand_v``,
    ``num_v_heads`` (default ``num_heads``) must be a multiple of ``num_heads``; each group of
    ``num_v_heads // num_heads`` value heads shares one q/k head (grouped value attention).

    ``hidden_size`` may be positional; every other argument is keyword-only (fla's are
    positional too: a positional call written for fla raises TypeError here rather than bind
    a value to the wrong argument). ``mode`` ("chunk" or "fused_recurrent") is checked and
    kept; both run the same native kernel. ``gate``, ``device`` and ``dtype`` are additions.

    ``forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
    output_attentions=False, *, cu_seqlens=None)`` returns ``(o, None, past_key_values)``:

    - ``attention_mask``: ``[B, T']`` 0/1 padding mask, ``T' >= T`` (its last ``T`` columns
      are used, as in fla); the kept tokens of each row are packed and run as one sequence,
      padded outputs are zero.
    - ``cu_seqlens``: ``[N + 1]`` offsets of ``N`` sequences packed into ``[1, total, hidden]``;
      the state resets at each boundary. Giving it together with ``attention_mask`` raises.
    - ``past_key_values`` / ``use_cache``: a :class:`RecurrentCache` with this layer's
      recurrent and conv states (created when ``use_cache`` and none is given). Feeding a
      sequence in pieces, e.g. token by token, reproduces the output of one full-sequence call.

    Example::

        >>> layer = GatedDeltaNet(64, expand_v=1, head_dim=16, num_heads=2, layer_idx=0)
        >>> o, _, cache = layer(torch.randn(2, 10, 64), use_cache=True)
        >>> o.shape, cache.get_seq_length(0)
        (torch.Size([2, 10, 64]), 10)
    """

    def __init__(self, hidden_size: int = 2048, *, expand_v: float = 2, head_dim: int = 256,
                 num_heads: int = 6, num_v_heads: int | None = None, mode: str = "chunk",
                 use_gate: bool = True, use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 layer_idx: int | None = None, norm_eps: float = 1e-5, gate: str = "head",
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads),
                            ("head_dim", head_dim), ("num_v_heads", num_v_heads),
                            ("conv_size", conv_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GatedDeltaNet: {name} must be a positive int, got {value!r}")
        if num_v_heads % num_heads:
            raise ValueError(
                f"GatedDeltaNet: num_v_heads ({num_v_heads}) must be a multiple of "
                f"num_heads ({num_heads})"
            )
        head_v_dim = head_dim * expand_v
        if expand_v <= 0 or not math.isclose(head_v_dim, round(head_v_dim)):
            raise ValueError(
                f"GatedDeltaNet: head_dim * expand_v must be a positive integer, got "
                f"{head_dim} * {expand_v} = {head_v_dim}"
            )
        if mode not in _MODES:
            raise ValueError(f"GatedDeltaNet: mode must be one of {_MODES}, got {mode!r}")
        if gate not in ("head", "channel"):
            raise ValueError(f"GatedDeltaNet: gate must be 'head' or 'channel', got {gate!r}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(round(head_v_dim))
        self.key_dim = num_heads * head_dim
        self.value_dim = num_v_heads * self.head_v_dim
        self.expand_v = expand_v
        self.head_dim = head_dim
        self.mode = mode
        self.gate = gate
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.allow_neg_eigval = allow_neg_eigval
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
        gate_width = num_v_heads if gate == "head" else num_v_heads * head_dim
        self.a_proj = nn.Linear(hidden_size, gate_width, bias=False, **factory)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False, **factory)
        # Decay parameters stay float32 whatever the model dtype (as in fla).
        self.A_log = nn.Parameter(torch.empty(num_v_heads, device=device, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(gate_width, device=device, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **factory)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, **factory)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias,
                                             **factory)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False, **factory)
        self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, **factory)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 1e-1,
                              dt_floor: float = 1e-4) -> None:
        """fla's initialization: ``A_log = log U(0, 16)``; ``dt_bias = softplus^-1(dt)`` with
        ``dt`` log-uniform in ``[dt_min, dt_max]`` (floored at ``dt_floor``).

        Example::

            >>> layer = GatedDeltaNet(16, head_dim=4, num_heads=2)
            >>> layer.reset_gate_parameters()
            >>> bool((layer.A_log.exp() <= 16).all())
            True
        """
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
        log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(dt_min), math.log(dt_max))
        dt = log_dt.exp().clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, mode={self.mode}, "
                f"gate={self.gate}, use_gate={self.use_gate}, "
                f"allow_neg_eigval={self.allow_neg_eigval}, "
                f"short_conv={self.conv_size if self.use_short_conv else None}, "
                f"layer_idx={self.layer_idx}")

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` for the input rows ``x``: log decay (``[..., HV]`` or ``[..., HV, K]``)
        and write strength ``[..., HV]`` (in (0, 2) with ``allow_neg_eigval``), both computed
        in (at least) float32.

        Example::

            >>> layer = GatedDeltaNet(16, head_dim=4, num_heads=2, gate="channel")
            >>> [t.shape for t in layer.gates(torch.randn(3, 16))]
            [torch.Size([3, 2, 4]), torch.Size([3, 2])]
        """
        dtype = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.b_proj(x).to(dtype))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        a = self.a_proj(x).to(dtype) + self.dt_bias.to(dtype)
        decay_rate = self.A_log.to(dtype).exp()
        if self.gate == "channel":
            a = a.unflatten(-1, (self.num_v_heads, self.head_k_dim))
            decay_rate = decay_rate[:, None]
        return -decay_rate * F.softplus(a), beta

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: RecurrentCache | None = None, use_cache: bool = False,
                output_attentions: bool = False, *, cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, None, RecurrentCache | None]:
        """``(o [B, T, hidden_size], None, past_key_values)``, as fla's layer returns.

        Example::

            >>> layer = GatedDeltaNet(16, head_dim=4, num_heads=2)
            >>> o, attentions, cache = layer(torch.randn(1, 5, 16))
            >>> o.shape, attentions, cache
            (torch.Size([1, 5, 16]), None, None)
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"GatedDeltaNet: hidden_states must be [B, T, {self.hidden_size}], "
                f"got {tuple(hidden_states.shape)}"
            )
        if past_key_values is not None and not isinstance(past_key_values, RecurrentCache):
            raise TypeError(
                "GatedDeltaNet: past_key_values must be an rlx_torch.nn.RecurrentCache, got "
                f"{type(past_key_values).__name__}"
            )
        batch, seqlen = hidden_states.shape[:2]
        x, kept_rows = hidden_states, None
        if cu_seqlens is not None and attention_mask is not None:
            raise ValueError(
                "GatedDeltaNet: give attention_mask (padded rows) or cu_seqlens (packed "
                "sequences), not both"
            )
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, hidden_states, "GatedDeltaNet")
            cu_seqlens = cu_seqlens.to(torch.int64)
        elif attention_mask is not None:
            if (attention_mask.dim() != 2 or attention_mask.shape[0] != batch
                    or attention_mask.shape[1] < seqlen):
                raise ValueError(
                    f"GatedDeltaNet: attention_mask must be a [B, T'] padding mask with B = "
                    f"{batch} and T' >= T = {seqlen}, got {tuple(attention_mask.shape)}"
                )
            x, kept_rows, cu_seqlens = unpad(hidden_states, attention_mask[:, -seqlen:])
        cache = past_key_values
        if cache is None and use_cache:
            cache = RecurrentCache()
        state = cache.get(self.layer_idx) if cache is not None else None
        recurrent_state = state["recurrent_state"] if state is not None else None
        conv_states = state["conv_state"] if state is not None else None
        if conv_states is None:
            conv_states = (None, None, None)

        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        new_conv_states = None
        if self.use_short_conv:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            outs = [conv(t, cache=c, output_final_state=use_cache, cu_seqlens=cu_seqlens)
                    for conv, t, c in zip(convs, (q, k, v), conv_states, strict=True)]
            (q, cq), (k, ck), (v, cv) = outs
            new_conv_states = (cq, ck, cv) if use_cache else None
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = q.unflatten(-1, (self.num_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        g, beta = self.gates(x)
        o, final_state = gated_delta_rule(
            q, k, v, g, beta, initial_state=recurrent_state, output_final_state=use_cache,
            cu_seqlens=cu_seqlens, use_qk_l2norm=True,
        )
        o = o.to(x.dtype)
        if self.use_gate:
            o = self.o_norm(o, self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o)
        o = self.o_proj(o.flatten(-2))
        if kept_rows is not None:
            o = repad(o, kept_rows, batch, seqlen)
        if use_cache:
            cache.update(self.layer_idx, final_state, new_conv_states, seqlen)
        return o, None, cache
