"""AQLM checkpoints (transformers + safetensors) as models with ``CodebookLinear`` layers.

:func:`load_aqlm` reads a local folder written by AQLM / transformers (``config.json`` with an
AQLM ``quantization_config``, ``model.safetensors`` or a sharded ``model.safetensors.index.json``)
and returns the transformers model with every quantized ``nn.Linear`` replaced by an equal
:class:`~rlx_torch.nn.CodebookLinear`; the aqlm package is not needed. :func:`save_aqlm` writes
such a model back in AQLM's format (e.g. after fine-tuning its codebooks and scales).
Both need ``transformers`` and ``safetensors``.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.codebook_linear import CodebookLinear

__all__ = ["AQLM_TENSOR_NAMES", "load_aqlm", "read_quantization_config", "save_aqlm"]

AQLM_TENSOR_NAMES = ("codes", "codebooks", "scales")
_INT_KEYS = ("in_group_size", "out_group_size", "num_codebooks", "nbits_per_codebook")


def read_quantization_config(config: Any) -> dict[str, Any]:
    """The AQLM ``quantization_config`` of a transformers config (or its dict), validated.

    Returns a dict with ``in_group_size``, ``out_group_size``, ``num_codebooks``,
    ``nbits_per_codebook`` (ints) and ``linear_weights_not_to_quantize`` (a list of names).

    Example::

        >>> read_quantization_config({"quantization_config": {"quant_method": "aqlm",
        ...     "in_group_size": 8, "out_group_size": 1, "num_codebooks": 1,
        ...     "nbits_per_codebook": 16}})["nbits_per_codebook"]
        16
    """
    raw = config.get("quantization_config") if isinstance(config, Mapping) else getattr(
        config, "quantization_config", None
    )
    if raw is None:
        raise ValueError("load_aqlm: the config has no quantization_config")
    if not isinstance(raw, Mapping):
        raw = raw.to_dict()
    method = str(raw.get("quant_method", "")).lower()
    if method != "aqlm":
        raise ValueError(
            f"load_aqlm: quantization_config.quant_method must be 'aqlm', got {method!r}"
        )
    # transformers' AqlmConfig defaults for keys a config leaves out.
    q = {"in_group_size": 8, "out_group_size": 1, "num_codebooks": 1, "nbits_per_codebook": 16}
    q.update({k: raw[k] for k in _INT_KEYS if k in raw})
    for key in _INT_KEYS:
        if not isinstance(q[key], int) or isinstance(q[key], bool) or q[key] < 1:
            raise ValueError(
                f"load_aqlm: quantization_config.{key} must be an int >= 1, got {q[key]!r}"
            )
    if q["nbits_per_codebook"] > 16:
        raise ValueError(
            "load_aqlm: quantization_config.nbits_per_codebook must be <= 16, got "
            f"{q['nbits_per_codebook']}"
        )
    entries = q["out_group_size"] << q["nbits_per_codebook"]
    if entries > 1 << 16:
        raise ValueError(
            f"load_aqlm: out_group_size={q['out_group_size']} with nbits_per_codebook="
            f"{q['nbits_per_codebook']} is not supported: CodebookLinear represents an output "
            f"group as one codebook of out_group_size * 2**nbits = {entries} entries, at most 65536"
        )
    skip = raw.get("linear_weights_not_to_quantize") or []
    if not isinstance(skip, list | tuple) or not all(isinstance(s, str) for s in skip):
        raise ValueError("load_aqlm: linear_weights_not_to_quantize must be a list of strings")
    q["linear_weights_not_to_quantize"] = list(skip)
    return q


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"load_aqlm: {folder} has neither model.safetensors nor model.safetensors.index.json"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def _torch_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"load_aqlm: dtype must be a torch dtype, got {value!r}")
    return dtype


def load_aqlm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    model_class: Any = None,
) -> nn.Module:
    """Loads a local AQLM checkpoint folder as a transformers model on ``CodebookLinear``.

    Args:
        path: folder with ``config.json`` (AQLM ``quantization_config``) and safetensors.
        dtype: float dtype of the model (default: the config's ``dtype``/``torch_dtype``, else
            float32). The checkpoint's tensors are cast to it.
        device: where the model goes (default CPU).
        model_class: the transformers class to build (default ``AutoModelForCausalLM``).

    Every ``nn.Linear`` whose ``codes`` are in the checkpoint becomes ``CodebookLinear``
    (1x8, 2x8, 1x16, ... and ``out_group_size > 1`` within 65,536 merged entries, see
    :mod:`rlx_torch.quant.aqlm_format`); the rest loads as usual. Missing or unexpected
    tensors raise ``ValueError``. The quantization config is kept as
    ``model.aqlm_quantization_config`` for :func:`save_aqlm`.

    Example::

        >>> model = load_aqlm("path/to/Llama-2-7b-AQLM-2Bit-1x16-hf",  # doctest: +SKIP
        ...                   dtype=torch.float32)
        >>> logits = model(torch.tensor([[1, 2, 3]])).logits  # doctest: +SKIP
    """
    import transformers

    folder = Path(path)
    config = transformers.AutoConfig.from_pretrained(folder)
    q = read_quantization_config(config)
    dtype = _torch_dtype(dtype) or _torch_dtype(
        getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    ) or torch.float32
    plain = copy.deepcopy(config)
    del plain.quantization_config  # build the float architecture; our layers replace AQLM's
    model_class = model_class or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = model_class.from_config(plain, dtype=dtype)

    state = _read_safetensors(folder)
    skip = set(q["linear_weights_not_to_quantize"])
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or f"{name}.codes" not in state:
            continue
        if f"{name}.weight" in skip or name in skip:
            raise ValueError(
                f"load_aqlm: {name}.weight is in linear_weights_not_to_quantize but the "
                f"checkpoint has {name}.codes"
            )
        parts = {k: state.pop(f"{name}.{k}", None) for k in (*AQLM_TENSOR_NAMES, "bias")}
        missing = [f"{name}.{k}" for k in AQLM_TENSOR_NAMES if parts[k] is None]
        if missing:
            raise ValueError(f"load_aqlm: the checkpoint has no {', '.join(missing)}")
        if (parts["bias"] is None) != (module.bias is None):
            raise ValueError(
                f"load_aqlm: {name} has bias={module.bias is not None} in the model but the "
                f"checkpoint {'lacks' if parts['bias'] is None else 'has'} {name}.bias"
            )
        _check_scheme(name, parts["codebooks"], q)
        if parts["bias"] is None:
            del parts["bias"]
        layer = CodebookLinear.from_aqlm(
            parts,
            in_features=module.in_features,
            out_features=module.out_features,
            codes_layout="aqlm",  # files hold AQLM's layout
            dtype=dtype,
        )
        model.set_submodule(name, layer)

    floats = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    result = model.load_state_dict(floats, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(
            f"load_aqlm: the checkpoint has tensors the model does not: {result.unexpected_keys}"
        )
    _materialize_non_persistent_buffers(model)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"load_aqlm: the checkpoint has no values for {left}")
    model.aqlm_quantization_config = q
    return model.to(device).eval()


def _check_scheme(name: str, codebooks: torch.Tensor, q: dict[str, Any]) -> None:
    want = (
        q["num_codebooks"],
        1 << q["nbits_per_codebook"],
        q["out_group_size"],
        q["in_group_size"],
    )
    if tuple(codebooks.shape) != want:
        raise ValueError(
            f"load_aqlm: {name}.codebooks is {tuple(codebooks.shape)}, the quantization_config "
            f"says [num_codebooks, 2**nbits, out_group_size, in_group_size] = {list(want)}"
        )


def _materialize_non_persistent_buffers(model: nn.Module) -> None:
    # Buffers that are not saved (rotary inv_freq) were built on meta; transformers' own
    # initializer recomputes them from the config.
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", ())
        if any(module._buffers.get(n) is not None and module._buffers[n].is_meta for n in names):
            for n in names:
                buf = module._buffers.get(n)
                if buf is not None and buf.is_meta:
                    module._buffers[n] = torch.empty_like(buf, device="cpu")
            if hasattr(model, "_init_weights"):
                model._init_weights(module)


def save_aqlm(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    out_group_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Writes a transformers model whose quantized layers are ``CodebookLinear`` in AQLM's
    format: ``config.json`` with an AQLM ``quantization_config`` and ``model.safetensors`` with
    ``codes``/``codebooks``/``scales``/``bias`` per layer. :func:`load_aqlm` and
    ``transformers`` + ``aqlm`` read it back.

    All ``CodebookLinear`` layers must share one scheme (entry dim, codebooks, entries).
    ``out_group_size`` defaults to the loaded checkpoint's (else 1); ``dtype`` (default: the
    model's) is the dtype of every float tensor written. Returns the folder.

    Example::

        >>> save_aqlm(load_aqlm("tiny-aqlm"), "tiny-aqlm-finetuned")  # doctest: +SKIP
        PosixPath('tiny-aqlm-finetuned')
    """
    from safetensors.torch import save_file

    loaded = getattr(model, "aqlm_quantization_config", None) or {}
    og = out_group_size or loaded.get("out_group_size", 1)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, CodebookLinear)}
    if not layers:
        raise ValueError("save_aqlm: the model has no CodebookLinear layer")
    schemes = {(m.entry_dim, m.num_codebooks, m.num_entries) for m in layers.values()}
    if len(schemes) != 1:
        raise ValueError(f"save_aqlm: AQLM needs one scheme for all layers, got {sorted(schemes)}")
    entry_dim, num_codebooks, entries = schemes.pop()
    if entries % og or (entries // og) & (entries // og - 1):
        raise ValueError(
            f"save_aqlm: {entries} entries per codebook are not out_group_size={og} times a "
            "power of two"
        )
    state: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        for key, t in layer.to_aqlm(out_group_size=og, dtype=dtype).items():
            state[f"{name}.{key}"] = t
    quantized = {f"{n}.{k}" for n, m in layers.items() for k, _ in m.named_parameters()}
    quantized |= {f"{n}.{k}" for n, m in layers.items() for k, _ in m.named_buffers()}
    seen: set[int] = set()
    for key, t in model.state_dict().items():
        if key in quantized:
            continue
        if t.data_ptr() in seen and t.numel():
            continue  # a tied weight (lm_head = embed_tokens): transformers re-ties it
        seen.add(t.data_ptr())
        t = t.detach()
        state[key] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).cpu()
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    # AQLM lists weight names; transformers 5 matches these entries against module names,
    # so both are written.
    float_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    float_linears = [*(f"{n}.weight" for n in float_linears), *float_linears]
    config["quantization_config"] = {
        "quant_method": "aqlm",
        "in_group_size": entry_dim,
        "out_group_size": og,
        "num_codebooks": num_codebooks,
        "nbits_per_codebook": int(math.log2(entries // og)),
        "linear_weights_not_to_quantize": float_linears,
    }
    if dtype is not None:
        config["dtype"] = str(dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
