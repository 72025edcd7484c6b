"""CodebookLinear: a drop-in for nn.Linear whose weight is vector-quantized (AQLM-style)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..ops import _codebook_autograd, _codebook_packed
from ..ops.codebook import codebook_matmul
from ..quant import (
    dequantize,
    from_aqlm_tensors,
    index_dtype,
    max_entries,
    pack_indices,
    residual_kmeans,
    to_aqlm_tensors,
)

__all__ = ["CodebookLinear"]

_CODES_LAYOUTS = ("auto", "aqlm", "transposed")


class CodebookLinear(nn.Module):
    """nn.Linear with a vector-quantized weight: ``y = scales * (x @ W.T) + bias`` where
    ``W[j, kb*D:(kb+1)*D] = sum_m codebook[m, indices[j, kb, m]]``.

    Args:
        in_features, out_features, bias: as for ``nn.Linear``; ``in_features`` must be a
            multiple of ``entry_dim``.
        entry_dim: D, the number of consecutive input weights one codebook entry covers.
        num_entries: E entries per codebook, up to 65,536 (uint8 indices up to 256, else
            int16 read as unsigned 16-bit).
        num_codebooks: M additive codebooks (AQLM's 1x8 scheme is M = 1, 2x8 is M = 2).
        scales: a learnable per-output scale.

    ``indices`` is a buffer (saved in the state dict, not trained): ``[N, K/D]`` when M = 1,
    else ``[N, K/D, M]``. ``codebook`` (``[E, D]`` or ``[M, E, D]``), ``scales`` and ``bias``
    are Parameters. Storage is ``M * log2(E) / D`` bits per weight plus the codebook.

    Example::

        >>> layer = CodebookLinear(64, 32, entry_dim=8, num_entries=16, num_codebooks=2)
        >>> layer(torch.randn(3, 64)).shape
        torch.Size([3, 32])
    """

    # Properties TorchScript must not compile (they build tensors from Python helpers).
    __jit_unused_properties__ = ["weight", "bits_per_weight"]
    __jit_ignored_attributes__ = ["_packed_indices"]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        entry_dim: int = 8,
        num_entries: int = 256,
        num_codebooks: int = 1,
        scales: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(entry_dim, int) or entry_dim < 1 or in_features % entry_dim != 0:
            raise ValueError(
                f"CodebookLinear: in_features={in_features} must be a multiple of "
                f"entry_dim={entry_dim} (a positive int)"
            )
        if not 1 <= num_entries <= max_entries():
            raise ValueError(
                f"CodebookLinear: num_entries must be in [1, {max_entries()}], got {num_entries}"
            )
        if num_codebooks < 1:
            raise ValueError(f"CodebookLinear: num_codebooks must be >= 1, got {num_codebooks}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.entry_dim, self.num_entries = entry_dim, num_entries
        self.num_codebooks = num_codebooks
        groups = in_features // entry_dim
        multi = num_codebooks > 1
        idx_shape = (out_features, groups, num_codebooks) if multi else (out_features, groups)
        cb_shape = (num_codebooks, num_entries, entry_dim) if multi else (num_entries, entry_dim)
        idx_dtype = index_dtype(num_entries)
        self.register_buffer("indices", torch.zeros(idx_shape, dtype=idx_dtype, device=device))
        self.codebook = nn.Parameter(torch.empty(cb_shape, **factory))
        if scales:
            self.scales = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("scales", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.quantization_error: float | None = None  # set by from_linear
        # Opt-in: CPU inference through the packed index layout (built on first use, rebuilt
        # when indices change; twice the indices' memory). docs/codebook.md.
        self.cpu_packed_forward = False
        self._packed_indices = _codebook_packed.PackedIndices()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random codes and codebook giving nn.Linear's output scale (U(-1/sqrt(K), 1/sqrt(K))).

        Example::

            >>> layer = CodebookLinear(64, 32, entry_dim=8, num_entries=16)
            >>> layer.reset_parameters()
            >>> bool(layer.bias.abs().max() <= 64 ** -0.5)
            True
        """
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        with torch.no_grad():
            if self.indices.device.type != "meta":
                codes = torch.randint(
                    self.num_entries, self.indices.shape, device=self.indices.device
                )
                self.indices.copy_(pack_indices(codes, self.num_entries))
            self.codebook.uniform_(-bound, bound).div_(math.sqrt(self.num_codebooks))
            if self.scales is not None:
                self.scales.fill_(1.0)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if torch.jit.is_scripting():
            # TorchScript cannot call the autograd.Function, and the bare op has no autograd:
            # a scripted layer is for inference, and says so rather than drop gradients.
            needs_grad = x.requires_grad or self.codebook.requires_grad
            if self.scales is not None:
                needs_grad = needs_grad or self.scales.requires_grad
            if self.bias is not None:
                needs_grad = needs_grad or self.bias.requires_grad
            if torch.is_grad_enabled() and needs_grad:
                raise RuntimeError(
                    "CodebookLinear: a TorchScript-compiled layer has no backward; run it "
                    "under torch.no_grad() (or requires_grad_(False)), or use the eager layer "
                    "or torch.compile to train"
                )
            return torch.ops.rlx.codebook_matmul(
                x, self.indices, self.codebook, self.scales, self.bias
            )
        return self._eager_forward(x)

    @torch.jit.unused
    def _eager_forward(self, x: Tensor) -> Tensor:
        if (
            getattr(self, "cpu_packed_forward", False)
            and _codebook_packed.usable(x, self.indices, self.codebook)
            and not torch.compiler.is_compiling()
            and not _codebook_autograd._functorch_active()
            and not _codebook_autograd._needs_autograd(x, self.codebook, self.scales, self.bias)
        ):
            packed = self._packed_indices.get(self.indices, self.num_entries)
            return torch.ops.rlx.codebook_matmul_packed(
                x, packed, self.indices, self.codebook, self.scales, self.bias
            )
        return codebook_matmul(x, self.indices, self.codebook, self.scales, self.bias)

    def dequantize(self) -> Tensor:
        """The dense ``[out_features, in_features]`` weight (scales included), differentiable.

        Example::

            >>> CodebookLinear(16, 4, entry_dim=8, num_entries=4).dequantize().shape
            torch.Size([4, 16])
        """
        return dequantize(self.indices, self.codebook, self.scales)

    @property
    def weight(self) -> Tensor:
        """A computed view: the dense weight, :meth:`dequantize` rebuilt on every read (the
        layer stores no dense matrix; its forward never builds one). It exists for code that
        reads ``layer.weight``; keep the result rather than read it in a loop.

        Example::

            >>> layer = CodebookLinear(16, 4, entry_dim=8, num_entries=4)
            >>> torch.equal(layer.weight, layer.dequantize())
            True
        """
        return self.dequantize()

    @property
    def bits_per_weight(self) -> float:
        """Index bits per weight, M * log2(E) / D (what AQLM's "1x8", "2x8" name).

        Example::

            >>> CodebookLinear(64, 8, entry_dim=8, num_entries=256, num_codebooks=2).bits_per_weight
            2.0
        """
        return self.num_codebooks * math.log2(self.num_entries) / self.entry_dim

    def extra_repr(self) -> str:
        stored_bits = self.indices.numel() * self.indices.element_size() * 8 + sum(
            p.numel() * p.element_size() * 8
            for p in (self.codebook, self.scales, self.bias)
            if p is not None
        )
        per_weight = stored_bits / max(self.in_features * self.out_features, 1)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"entry_dim={self.entry_dim}, num_entries={self.num_entries}, "
            f"num_codebooks={self.num_codebooks}, indices={tuple(self.indices.shape)}, "
            f"codebook={tuple(self.codebook.shape)}, scales={self.scales is not None}, "
            f"bias={self.bias is not None}, bits_per_weight={self.bits_per_weight:.3g} "
            f"({per_weight:.3g} stored)"
        )

    @classmethod
    @torch.no_grad()
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        entry_dim: int = 8,
        num_entries: int = 256,
        num_codebooks: int = 1,
        iters: int = 25,
        scales: bool = True,
        seed: int = 0,
    ) -> CodebookLinear:
        """Quantizes ``linear`` by k-means (residual k-means for M > 1) on its weight's device.

        With ``scales`` each output row is first divided by its RMS (the scale), so one codebook
        serves rows of different magnitude. The relative Frobenius reconstruction error
        ``||W - W_q|| / ||W||`` is stored in ``quantization_error``.

        Example::

            >>> layer = CodebookLinear.from_linear(nn.Linear(64, 32), entry_dim=4, num_entries=16)
            >>> layer.quantization_error < 1
            True
        """
        weight = linear.weight.detach()
        if weight.device.type == "meta":
            raise ValueError(
                "CodebookLinear.from_linear: linear.weight is on the meta device (no values to "
                "quantize); materialize the layer first (e.g. to_empty() and load its weights)"
            )
        n, k = weight.shape
        layer = cls(
            k,
            n,
            bias=linear.bias is not None,
            entry_dim=entry_dim,
            num_entries=num_entries,
            num_codebooks=num_codebooks,
            scales=scales,
            device=weight.device,
            dtype=weight.dtype,
        )
        w = weight.float()
        row_scale = w.pow(2).mean(1).sqrt().clamp_min(1e-12) if scales else torch.ones_like(w[:, 0])
        vectors = (w / row_scale[:, None]).reshape(-1, entry_dim)
        generator = torch.Generator(device=weight.device).manual_seed(seed)
        codebooks, codes = residual_kmeans(vectors, num_entries, num_codebooks, iters, generator)
        groups = k // entry_dim
        idx = pack_indices(torch.stack(codes, -1).reshape(n, groups, num_codebooks), num_entries)
        cb = torch.stack(codebooks)
        if num_codebooks == 1:
            idx, cb = idx[..., 0], cb[0]
        layer.indices.copy_(idx)
        layer.codebook.copy_(cb)
        if layer.scales is not None:
            layer.scales.copy_(row_scale)
        if layer.bias is not None:
            layer.bias.copy_(linear.bias)
        approx = layer.dequantize().float()
        layer.quantization_error = float((w - approx).norm() / w.norm().clamp_min(1e-30))
        return layer

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """The dequantized ``nn.Linear`` (same device and dtype).

        Example::

            >>> CodebookLinear(16, 4, entry_dim=8, num_entries=4).to_linear()
            Linear(in_features=16, out_features=4, bias=True)
        """
        linear = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.codebook.device,
            dtype=self.codebook.dtype,
        )
        linear.weight.copy_(self.dequantize())
        if self.bias is not None:
            linear.bias.copy_(self.bias)
        return linear

    @classmethod
    @torch.no_grad()
    def from_aqlm(
        cls,
        source: nn.Module | Mapping[str, Tensor],
        *,
        in_features: int | None = None,
        out_features: int | None = None,
        codes_layout: str = "auto",
        dtype: torch.dtype | None = None,
    ) -> CodebookLinear:
        """The ``CodebookLinear`` equal to an AQLM layer: an ``aqlm.QuantizedLinear`` or its
        state dict (``codes``, ``codebooks``, ``scales``, optional ``bias``) with its
        ``in_features`` and ``out_features``. The aqlm package is not needed.

        AQLM's CPU kernel transposes ``codes`` in place, to ``[in_groups, out_groups, M]``, on a
        module's first forward. ``codes_layout`` says which layout ``codes`` has: ``"aqlm"``
        (``[out_groups, in_groups, M]``, as saved by AQLM), ``"transposed"``, or ``"auto"``:
        for a module, from its state (whether it has run on a non-CUDA device); for a state
        dict, from the shapes, raising ``ValueError`` when they cannot tell (in_groups ==
        out_groups). ``dtype`` (default: the codebooks') is the layer's float dtype.
        Fine-tune the result, then write it back with :meth:`to_aqlm`.

        Example::

            >>> sd = {"codes": torch.randint(-128, 128, (4, 2, 1), dtype=torch.int8),
            ...       "codebooks": torch.randn(1, 256, 1, 8), "scales": torch.rand(4, 1, 1, 1)}
            >>> CodebookLinear.from_aqlm(sd, in_features=16, out_features=4).indices.shape
            torch.Size([4, 2])
        """
        if codes_layout not in _CODES_LAYOUTS:
            raise ValueError(
                f"from_aqlm: codes_layout must be one of {_CODES_LAYOUTS}, got {codes_layout!r}"
            )
        if isinstance(source, Mapping):
            tensors = dict(source)
            missing = [k for k in ("codes", "codebooks", "scales") if k not in tensors]
            if missing:
                raise ValueError(f"from_aqlm: the state dict has no {', '.join(missing)}")
            if in_features is None or out_features is None:
                raise ValueError(
                    "from_aqlm: a state dict needs in_features and out_features (the layer's "
                    "config) to tell AQLM's codes layout from the transposed one"
                )
            prepared = None
        else:
            names = ("codes", "codebooks", "scales", "bias")
            tensors = {k: getattr(source, k, None) for k in names}
            if any(tensors[k] is None for k in ("codes", "codebooks", "scales")):
                raise ValueError(
                    "from_aqlm: source must be an aqlm.QuantizedLinear (codes, codebooks, "
                    f"scales) or its state dict, got {type(source).__name__}"
                )
            in_features = source.in_features if in_features is None else in_features
            out_features = source.out_features if out_features is None else out_features
            prepared = getattr(source, "gemv_op", None) is not None
        codes, codebooks = tensors["codes"].detach(), tensors["codebooks"].detach()
        if codebooks.dim() != 4:
            raise ValueError(
                "from_aqlm: codebooks must be [num_codebooks, 2**nbits, out_group_size, "
                f"in_group_size], got {tuple(codebooks.shape)}"
            )
        out_group, in_group = codebooks.shape[2], codebooks.shape[3]
        if in_features % in_group or out_features % out_group:
            raise ValueError(
                f"from_aqlm: in_features={in_features} / out_features={out_features} are not "
                f"multiples of in_group_size={in_group} / out_group_size={out_group}"
            )
        groups = (out_features // out_group, in_features // in_group)
        layout = _codes_layout(codes, groups, codebooks, codes_layout, prepared)
        if layout == "transposed":
            codes = codes.transpose(0, 1)
        if tuple(codes.shape[:2]) != groups:
            raise ValueError(
                f"from_aqlm: codes must be [out_groups, in_groups, M] = [{groups[0]}, "
                f"{groups[1]}, M] (or transposed), got {tuple(codes.shape)}"
            )
        scales = tensors["scales"].detach()
        indices, codebook, row_scales = from_aqlm_tensors(codes, codebooks, scales, dtype=dtype)
        bias = tensors.get("bias")
        layer = cls(
            in_features,
            out_features,
            bias=bias is not None,
            entry_dim=in_group,
            num_entries=codebook.shape[-2],
            num_codebooks=codebooks.shape[0],
            device=codebook.device,
            dtype=codebook.dtype,
        )
        layer.indices.copy_(indices)
        layer.codebook.copy_(codebook)
        layer.scales.copy_(row_scales)
        if bias is not None:
            layer.bias.copy_(bias.detach())
        return layer

    @torch.no_grad()
    def to_aqlm(
        self, *, out_group_size: int = 1, dtype: torch.dtype | None = None
    ) -> dict[str, Tensor]:
        """This layer as an ``aqlm.QuantizedLinear`` state dict (``codes``, ``codebooks``,
        ``scales``, and ``bias`` when the layer has one), in AQLM's layout.

        ``num_entries`` must be ``out_group_size * 2**nbits``; see
        :func:`rlx_torch.quant.to_aqlm_tensors` for the rules with ``out_group_size > 1``.

        Example::

            >>> sd = CodebookLinear(16, 4, entry_dim=8).to_aqlm()
            >>> sd["codes"].dtype, sd["codebooks"].shape
            (torch.int8, torch.Size([1, 256, 1, 8]))
        """
        aq = to_aqlm_tensors(
            self.indices, self.codebook, self.scales, out_group_size=out_group_size, dtype=dtype
        )
        state: dict[str, Any] = aq._asdict()
        if self.bias is not None:
            state["bias"] = self.bias.detach().to(dtype or self.bias.dtype).clone()
        return state


def _codes_layout(codes, groups, codebooks, requested, prepared):
    """Which layout AQLM ``codes`` are in: "aqlm" [out_groups, in_groups, M] or "transposed"."""
    if requested != "auto":
        return requested
    shape, transposed = tuple(codes.shape[:2]), (groups[1], groups[0])
    if groups[0] != groups[1]:
        if shape == groups:
            return "aqlm"
        if shape == transposed:
            return "transposed"
        return "aqlm"  # neither: the caller's shape check reports it
    # Square: only the module's state can tell. aqlm.QuantizedLinear.prepare_matmul_op
    # transposes codes on its first forward for 256-entry codebooks unless the input is on
    # CUDA; a module moved to CUDA after a CPU forward keeps the transposed codes.
    if prepared is None:
        raise ValueError(
            f"from_aqlm: codes {tuple(codes.shape)} fit both AQLM's layout and the transposed "
            "one its CPU kernel writes after a forward; pass codes_layout='aqlm' (as saved by "
            "AQLM) or 'transposed'"
        )
    if not prepared or codebooks.shape[1] != 256:
        return "aqlm"
    if codes.device.type != "cuda":
        return "transposed"
    raise ValueError(
        "from_aqlm: this module has run a forward and its codes are on CUDA: they are transposed "
        "if that forward ran on CPU; pass codes_layout='aqlm' or 'transposed'"
    )
