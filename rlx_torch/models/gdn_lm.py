"""A small decoder-only language model made of Gated DeltaNet blocks."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.cache import RecurrentCache
from ..nn.gated_deltanet import GatedDeltaNet

__all__ = ["GDNConfig", "GDNLanguageModel", "LMOutput"]


@dataclass
class GDNConfig:
    """Sizes of a :class:`GDNLanguageModel` (``asdict``/``GDNConfig(**d)`` round-trips).

    ``use_output_gate`` is the layers' ``use_gate`` (fla's name).

    Example::

        >>> from dataclasses import asdict
        >>> config = GDNConfig(hidden_size=64, num_heads=1)
        >>> GDNConfig(**asdict(config)) == config
        True
    """

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 64
    num_v_heads: int | None = None
    expand_v: float = 1.0
    gate: str = "head"
    use_short_conv: bool = True
    conv_size: int = 4
    use_output_gate: bool = True
    intermediate_size: int | None = None  # default: 8/3 * hidden_size, rounded up to 32k (SwiGLU)
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_embeddings: bool = False

    def mlp_width(self) -> int:
        """The SwiGLU width: ``intermediate_size``, else 8/3 of ``hidden_size`` rounded up to 32.

        Example::

            >>> GDNConfig(hidden_size=128).mlp_width()
            352
        """
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 32 * math.ceil(8 * self.hidden_size / 3 / 32)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; the three linears are what ``quantize_mlp`` replaces."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GDNBlock(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GDNConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mixer = GatedDeltaNet(
            config.hidden_size, num_heads=config.num_heads, head_dim=config.head_dim,
            num_v_heads=config.num_v_heads, expand_v=config.expand_v, gate=config.gate,
            use_short_conv=config.use_short_conv, conv_size=config.conv_size,
            use_gate=config.use_output_gate, norm_eps=config.norm_eps, layer_idx=layer_idx,
        )
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.mlp_width())

    def forward(self, x, attention_mask=None, cu_seqlens=None, cache=None, use_cache=False):
        mixed, _, cache = self.mixer(self.mixer_norm(x), attention_mask=attention_mask,
                                     past_key_values=cache, use_cache=use_cache,
                                     cu_seqlens=cu_seqlens)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), cache


class LMOutput(NamedTuple):
    """``GDNLanguageModel``'s output: ``logits [B, T, vocab]`` and the decoding cache.

    Example::

        >>> out = GDNLanguageModel(num_layers=1)(torch.randint(0, 256, (1, 4)))
        >>> out.logits.shape, out.cache
        (torch.Size([1, 4, 256]), None)
    """

    logits: torch.Tensor
    cache: RecurrentCache | None


class GDNLanguageModel(nn.Module):
    """Embedding -> ``num_layers`` x [RMSNorm, GatedDeltaNet, RMSNorm, SwiGLU MLP] -> RMSNorm ->
    LM head. ``forward(input_ids [B, T], attention_mask=None, cu_seqlens=None, cache=None,
    use_cache=False)`` returns ``LMOutput(logits [B, T, vocab], cache)``.

    ``quantize_mlp(...)`` swaps the MLP linears for ``CodebookLinear``; ``generate(...)``
    samples by incremental decoding.

    Example::

        >>> model = GDNLanguageModel(GDNConfig(hidden_size=64, num_layers=1, num_heads=1))
        >>> model(torch.randint(0, 256, (2, 10))).logits.shape
        torch.Size([2, 10, 256])
    """

    def __init__(self, config: GDNConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        config = GDNConfig(**{**asdict(config or GDNConfig()), **overrides})
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(GDNBlock(config, i) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    def _init_weights(self, module: nn.Module) -> None:
        # fla/HF style: N(0, 0.02) for linears and embeddings; the GDN gate parameters keep the
        # initialization the layer gave them.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: RecurrentCache | None = None,
                use_cache: bool = False) -> LMOutput:
        if input_ids.dim() != 2:
            raise ValueError(
                f"GDNLanguageModel: input_ids must be [B, T], got {tuple(input_ids.shape)}"
            )
        if use_cache and cache is None:
            cache = RecurrentCache()
        x = self.embed(input_ids)
        for block in self.blocks:
            x, cache = block(x, attention_mask=attention_mask, cu_seqlens=cu_seqlens, cache=cache,
                             use_cache=use_cache)
        return LMOutput(self.head(self.norm(x)), cache)

    def mlp_linears(self) -> list[tuple[nn.Module, str]]:
        """``(parent module, attribute name)`` of every MLP linear, in a stable order.

        Example::

            >>> [name for _, name in GDNLanguageModel(num_layers=1).mlp_linears()]
            ['gate_proj', 'up_proj', 'down_proj']
        """
        return [(block.mlp, name) for block in self.blocks
                for name in ("gate_proj", "up_proj", "down_proj")]

    @torch.no_grad()
    def quantize_mlp(self, **codebook_kwargs: Any) -> None:
        """Replace every MLP ``nn.Linear`` by ``CodebookLinear.from_linear(linear, **kwargs)``.

        Example::

            >>> model = GDNLanguageModel(GDNConfig(hidden_size=64, num_layers=1, num_heads=1))
            >>> model.quantize_mlp(num_entries=16, iters=2)
            >>> type(model.blocks[0].mlp.up_proj).__name__
            'CodebookLinear'
        """
        from ..nn.codebook_linear import CodebookLinear

        for parent, name in self.mlp_linears():
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear):
                setattr(parent, name, CodebookLinear.from_linear(linear, **codebook_kwargs))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``prompt_ids [B, T]`` by incremental decoding
        (one forward over the prompt, then one token per step). ``temperature=0`` is greedy.

        Example::

            >>> model = GDNLanguageModel(GDNConfig(hidden_size=64, num_layers=1, num_heads=1))
            >>> model.generate(torch.tensor([[65, 66]]), 5, temperature=0).shape
            torch.Size([1, 5])
        """
        if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
            raise ValueError(
                f"generate: prompt_ids must be [B, T] with T >= 1, got {tuple(prompt_ids.shape)}"
            )
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
        logits, cache = self(prompt_ids, use_cache=True)
        out = []
        for _ in range(max_new_tokens):
            step = logits[:, -1].float()
            if temperature == 0:
                token = step.argmax(-1, keepdim=True)
            else:
                step = step / temperature
                if top_k is not None and top_k < step.shape[-1]:
                    kth = step.topk(top_k, dim=-1).values[:, -1:]
                    step = step.masked_fill(step < kth, float("-inf"))
                token = torch.multinomial(step.softmax(-1), 1, generator=generator)
            out.append(token)
            if len(out) < max_new_tokens:
                logits, cache = self(token, cache=cache, use_cache=True)
        if not out:
            return prompt_ids.new_zeros(prompt_ids.shape[0], 0)
        return torch.cat(out, dim=1)
