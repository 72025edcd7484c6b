"""Hugging Face transformers' gated-delta-rule and KDA models on rlx_torch's kernels.

::

    import rlx_torch.integrations.transformers as rlx_hf
    rlx_hf.enable()            # before or after the model is built
    model = AutoModelForCausalLM.from_config(config)   # Qwen3-Next, Qwen3.5, Kimi-Linear, ...
    ...
    rlx_hf.disable()           # transformers' own implementations again

How it hooks in. transformers (since 5.15; tested with the versions in ``TESTED_VERSIONS``)
wraps each kernel of these families in ``use_kernel_func_from_hub_with_fallback(name,
package)``: a module-level function in ``modeling_<family>.py`` that the layers call by its
global name, and that chose at import time between a hub kernel, the ``fla`` /
``causal_conv1d`` package and a plain-PyTorch fallback. :func:`enable` finds those wrappers by
the hub name they carry (``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``,
``chunk_kda``, ``fused_recurrent_kda``, ``causal_conv1d_fn``; or by the fallback's name where
the wrapper keeps none) in every loaded ``transformers.models.*`` module and replaces the
module attribute; :func:`disable` puts the originals back. Model instances hold
no reference to the kernels, so the order of ``enable()`` and model construction does not
matter.

What the replacements do:

- Gated delta rule / KDA: :func:`rlx_torch.gated_delta_rule` (forward and backward natively),
  with the arguments bound by the replaced function's own signature. Keyword arguments
  transformers forwards that concern other layers (``output_router_logits``, ``use_cache``,
  ``position_ids``, ``max_length_q``...) are ignored, as transformers' wrapper does. Packed
  sequences: ``cu_seqlens`` or, where the layer does not pass it (Kimi-Linear, Bailing), the
  ``cu_seq_lens_q`` that transformers' packed-sequence collator
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) provides, or its ``seq_idx``
  (``return_seq_idx=True``); int32 offsets are accepted. ``position_ids`` alone do not reach
  these layers, so a batch packed with nothing else mixes its sequences here (as with fla and
  the fallback). ``scale`` is honoured when given (fla's meaning).
- ``causal_conv1d_fn`` (the depthwise short convolution in front of the recurrence): a sum of
  shifted products (its backward is elementwise, unlike ``F.conv1d``'s depthwise backward);
  with ``cu_seq_lens_q`` / ``cu_seqlens`` / ``seq_idx`` no output reads another sequence's
  inputs (transformers' fallback convolves across the boundaries).
- Tensors on a device without rlx kernels (CUDA in a build without CUDA kernels, say) go to
  the implementation transformers chose, unchanged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..ops.gated_delta import gated_delta_rule

__all__ = ["FAMILIES", "TESTED_VERSIONS", "disable", "enable", "is_enabled", "patched"]

# transformers' modeling modules whose linear-attention layers call the hooks below.
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp",
            "kimi_linear", "bailing_hybrid", "glm5_next")
TESTED_VERSIONS = ("5.24.0",)
_RECURRENCES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
                "fused_recurrent_kda")
_CONVOLUTIONS = ("causal_conv1d_fn",)

_originals: dict[tuple[str, str], Callable] = {}  # (module name, attribute) -> transformers' own


# The fallbacks' own names, for wrappers that do not keep their hub name (transformers 5.15).
_FALLBACK_NAMES = {"torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                   "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
                   "chunk_kimi_delta_attention": "chunk_kda",
                   "recurrent_kimi_delta_attention": "fused_recurrent_kda",
                   "causal_conv1d_fn": "causal_conv1d_fn"}


def _hub_name(obj) -> str | None:
    """The hub kernel name of a ``use_kernel_func_from_hub_with_fallback`` wrapper, else None."""
    code, closure = getattr(obj, "__code__", None), getattr(obj, "__closure__", None)
    wrapped = getattr(obj, "__wrapped__", None)
    if code is None or closure is None or wrapped is None:
        return None
    cells = dict(zip(code.co_freevars, closure, strict=True))
    if "implementation" not in cells:  # not transformers' wrapper
        return None
    try:
        name = cells["func_name"].cell_contents if "func_name" in cells else None
    except ValueError:  # empty cell
        name = None
    return name if isinstance(name, str) else _FALLBACK_NAMES.get(getattr(wrapped, "__name__", ""))


def _has_kernel(device: torch.device) -> bool:
    key = {"cpu": "CPU", "mps": "MPS", "cuda": "CUDA"}.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(
        "rlx::gated_delta_fwd", key)


def _int64_offsets(cu_seqlens, who: str):
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32,
                                                                              torch.int64):
        got = getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__)
        raise ValueError(f"{who}: cu_seqlens must be an int32 or int64 tensor, got {got}")
    return cu_seqlens.to(torch.int64)


def _packing_offsets(arguments: dict, extra: dict):
    cu = arguments.get("cu_seqlens", extra.get("cu_seqlens"))
    return cu if cu is not None else extra.get("cu_seq_lens_q")


def _offsets_from_seq_idx(seq_idx: torch.Tensor, who: str) -> torch.Tensor:
    """``seq_idx [1, T]`` (the sequence of every packed token) -> int64 offsets ``[N + 1]``."""
    if seq_idx.dim() != 2 or seq_idx.shape[0] != 1:
        raise ValueError(f"{who}: packed sequences (seq_idx) need batch size 1, got seq_idx of "
                         f"shape {list(seq_idx.shape)}")
    T = seq_idx.shape[1]
    starts = (seq_idx[0, 1:] != seq_idx[0, :-1]).nonzero().flatten() + 1
    edge = torch.tensor([0, T], device=seq_idx.device)
    return torch.cat([edge[:1], starts, edge[1:]]).to(torch.int64)


def _recurrence(hub: str, original: Callable) -> Callable:
    torch_function = original.__wrapped__
    signature = inspect.signature(torch_function)
    var_kw = next((p.name for p in signature.parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(torch_function)
    def rlx_gated_delta_rule(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        extra = a.pop(var_kw, {}) if var_kw else {}
        q, k, v = a["query"], a["key"], a["value"]
        if not _has_kernel(q.device):
            return original(*args, **kwargs)
        cu_seqlens = _int64_offsets(_packing_offsets(a, extra), hub)
        if cu_seqlens is None and extra.get("seq_idx") is not None:
            cu_seqlens = _offsets_from_seq_idx(extra["seq_idx"], hub)
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(f"{hub}: packed sequences (cu_seqlens) need batch size 1, got "
                             f"{q.shape[0]}")
        output_final_state = bool(a.get("output_final_state", False))
        o, final_state = gated_delta_rule(
            q, k, v, a["g"], a["beta"], scale=extra.get("scale", a.get("scale")),
            initial_state=a.get("initial_state"), output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm=bool(a.get("use_qk_l2norm_in_kernel", False)))
        return o.to(q.dtype), final_state

    rlx_gated_delta_rule.rlx_replaces = original
    return rlx_gated_delta_rule


def _sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    rows = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], rows, right=True)


def _activate(y: torch.Tensor, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    from transformers.activations import ACT2FN

    return ACT2FN[activation](y)


def _convolution(hub: str, original: Callable) -> Callable:
    torch_function = original.__wrapped__
    signature = inspect.signature(torch_function)
    var_kw = next((p.name for p in signature.parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(torch_function)
    def rlx_causal_conv1d(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        a = dict(bound.arguments)
        extra = a.pop(var_kw, {}) if var_kw else {}
        x, weight = a["hidden_states"], a["weight"]
        cu_seqlens, seq_idx = _packing_offsets(a, extra), extra.get("seq_idx")
        if not _has_kernel(x.device):
            return original(*args, **kwargs)
        B, D, T = x.shape
        if cu_seqlens is not None and seq_idx is None:
            cu_seqlens = _int64_offsets(cu_seqlens, hub)
            if B != 1 or int(cu_seqlens[-1]) != T:
                raise ValueError(
                    f"{hub}: packed input must be [1, D, cu_seqlens[-1]] = [1, {D}, "
                    f"{int(cu_seqlens[-1])}], got {list(x.shape)} (packed sequences with a "
                    "cache are not supported)")
            seq_idx = _sequence_ids(cu_seqlens.to(x.device), T).unsqueeze(0)
        elif seq_idx is not None and tuple(seq_idx.shape) != (B, T):
            raise ValueError(f"{hub}: seq_idx must be [B, T] = [{B}, {T}], got "
                             f"{list(seq_idx.shape)}")
        W = weight.shape[-1]
        # A sum of W shifted products, in the time-major layout the layers hold (x arrives as a
        # transposed [B, T, D] view): every tap is a contiguous slice and the backward is
        # elementwise (F.conv1d's depthwise backward dominates a small model's training step
        # on the CPU). Tap s reads input t - s, kept only inside t's own sequence.
        xt = F.pad(x.transpose(1, 2).to(weight.dtype), (0, 0, W - 1, 0))  # [B, W-1+T, D]
        y = xt[:, W - 1:] * weight[:, W - 1]
        for s in range(1, W):
            tap = xt[:, W - 1 - s:W - 1 - s + T]
            if seq_idx is not None:
                same = F.pad(seq_idx[:, s:] == seq_idx[:, :-s], (s, 0), value=False)[:, :T]
                tap = tap * same.unsqueeze(-1).to(tap.dtype)
            y = torch.addcmul(y, tap, weight[:, W - 1 - s])
        bias = a.get("bias")
        if bias is not None:
            y = y + bias
        return _activate(y, a.get("activation")).to(x.dtype).transpose(1, 2)

    rlx_causal_conv1d.rlx_replaces = original
    return rlx_causal_conv1d


def _modeling_modules(import_families: bool):
    if import_families:
        for family in FAMILIES:
            try:
                importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            except ImportError:  # a family this transformers version does not have
                pass
    return [m for name, m in list(sys.modules.items())
            if name.startswith("transformers.models.") and m is not None
            and name.rsplit(".", 1)[-1].startswith("modeling_")]


def enable(import_families: bool = True) -> list[str]:
    """Routes transformers' gated delta rule, KDA and causal short convolution to rlx_torch.

    Patches every loaded ``transformers.models.*.modeling_*`` module (and first imports those of
    ``FAMILIES`` unless ``import_families=False``). Calling it again patches modules loaded
    since. Returns the patched ``"module.attribute"`` names (see :func:`patched`).

    Example::

        >>> import rlx_torch.integrations.transformers as rlx_hf
        >>> names = rlx_hf.enable()
        >>> any(n.endswith("qwen3_next.torch_chunk_gated_delta_rule") for n in names)
        True
        >>> rlx_hf.disable()
    """
    import transformers  # noqa: F401  (a clear ImportError when it is missing)

    found = False
    for module in _modeling_modules(import_families):
        for attr, obj in list(vars(module).items()):
            if getattr(obj, "rlx_replaces", None) is not None:
                found = True
                continue  # already ours
            hub = _hub_name(obj)
            if hub in _RECURRENCES:
                replacement = _recurrence(hub, obj)
            elif hub in _CONVOLUTIONS:
                replacement = _convolution(hub, obj)
            else:
                continue
            _originals[(module.__name__, attr)] = obj
            setattr(module, attr, replacement)
            found = True
    if not found:
        raise RuntimeError(
            f"rlx_torch.integrations.transformers: transformers {transformers.__version__} has "
            "no use_kernel_func_from_hub_with_fallback hooks in its gated-delta families; "
            f"tested versions: {', '.join(TESTED_VERSIONS)}")
    return patched()


def disable() -> None:
    """Restores transformers' own implementations everywhere :func:`enable` replaced them.

    Example::

        >>> import rlx_torch.integrations.transformers as rlx_hf
        >>> _ = rlx_hf.enable(); rlx_hf.disable(); rlx_hf.is_enabled()
        False
    """
    for (module_name, attr), original in list(_originals.items()):
        module = sys.modules.get(module_name)
        if module is not None and getattr(getattr(module, attr, None), "rlx_replaces",
                                          None) is original:
            setattr(module, attr, original)
        del _originals[(module_name, attr)]


def patched() -> list[str]:
    """The ``"module.attribute"`` names currently routed to rlx_torch.

    Example::

        >>> import rlx_torch.integrations.transformers as rlx_hf
        >>> rlx_hf.patched()
        []
    """
    return sorted(f"{m}.{a}" for m, a in _originals)


def is_enabled() -> bool:
    """True while :func:`enable` is in effect.

    Example::

        >>> import rlx_torch.integrations.transformers as rlx_hf
        >>> rlx_hf.is_enabled()
        False
    """
    return bool(_originals)
