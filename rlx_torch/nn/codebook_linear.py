"""CodebookLinear: a drop-in for nn.Linear whose weight is vector-quantized (AQLM-style)."""

import math

import torch
from torch import nn

from ..ops.codebook import codebook_matmul
from ..ops.reference import codebook_dequantize

__all__ = ["CodebookLinear"]


class CodebookLinear(nn.Module):
    """nn.Linear with a vector-quantized weight: ``y = scales * (x @ W.T) + bias`` where
    ``W[j, kb*D:(kb+1)*D] = sum_m codebook[m, indices[j, kb, m]]``.

    Args:
        in_features, out_features: as for ``nn.Linear``; ``in_features`` must be a multiple of
            ``entry_dim``.
        entry_dim: D, the number of consecutive input weights one codebook entry covers.
        num_entries: E <= 256 entries per codebook (uint8 indices).
        num_codebooks: M additive codebooks (AQLM's 1x8 scheme is M = 1, 2x8 is M = 2).
        bias, scales: learnable per-output bias and scale.

    ``indices`` is a uint8 buffer (saved in the state dict, not trained): ``[N, K/D]`` when
    M = 1, else ``[N, K/D, M]``. ``codebook`` (``[E, D]`` or ``[M, E, D]``), ``scales`` and
    ``bias`` are Parameters. Storage is ``M * log2(E) / D`` bits per weight plus the codebook.
    """

    def __init__(
        self,
        in_features,
        out_features,
        entry_dim=8,
        num_entries=256,
        num_codebooks=1,
        bias=True,
        scales=True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if entry_dim < 1 or in_features % entry_dim != 0:
            raise ValueError(
                f"CodebookLinear: in_features={in_features} must be a multiple of "
                f"entry_dim={entry_dim}"
            )
        if not 1 <= num_entries <= 256:
            raise ValueError(f"CodebookLinear: num_entries must be in [1, 256], got {num_entries}")
        if num_codebooks < 1:
            raise ValueError(f"CodebookLinear: num_codebooks must be >= 1, got {num_codebooks}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.entry_dim, self.num_entries, self.num_codebooks = (
            entry_dim,
            num_entries,
            num_codebooks,
        )
        groups = in_features // entry_dim
        multi = num_codebooks > 1
        idx_shape = (out_features, groups, num_codebooks) if multi else (out_features, groups)
        cb_shape = (num_codebooks, num_entries, entry_dim) if multi else (num_entries, entry_dim)
        self.register_buffer("indices", torch.zeros(idx_shape, dtype=torch.uint8, device=device))
        self.codebook = nn.Parameter(torch.empty(cb_shape, **factory))
        self.scales = nn.Parameter(torch.empty(out_features, **factory)) if scales else None
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.quantization_error = None  # set by from_linear
        self.reset_parameters()

    def reset_parameters(self):
        """Random codes and codebook giving nn.Linear's output scale (U(-1/sqrt(K), 1/sqrt(K)))."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features else 0.0
        with torch.no_grad():
            self.indices.copy_(torch.randint_like(self.indices, self.num_entries))
            self.codebook.uniform_(-bound, bound).div_(math.sqrt(self.num_codebooks))
            if self.scales is not None:
                self.scales.fill_(1.0)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def forward(self, x):
        return codebook_matmul(x, self.indices, self.codebook, self.scales, self.bias)

    def dequantize(self):
        """The dense ``[out_features, in_features]`` weight (scales included), differentiable."""
        weight = codebook_dequantize(self.indices, self.codebook)
        return weight * self.scales[:, None] if self.scales is not None else weight

    @property
    def weight(self):
        # For code that reads layer.weight (dtype/device/shape); builds the dense weight.
        return self.dequantize()

    @property
    def bits_per_weight(self):
        """Index bits per weight, M * log2(E) / D (what AQLM's "1x8", "2x8" name)."""
        return self.num_codebooks * math.log2(self.num_entries) / self.entry_dim

    def extra_repr(self):
        stored_bits = self.indices.numel() * 8 + sum(
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
        cls, linear, entry_dim=8, num_entries=256, num_codebooks=1, iters=25, scales=True, seed=0
    ):
        """Quantizes ``linear`` by k-means (residual k-means for M > 1) on its weight's device.

        With ``scales`` each output row is first divided by its RMS (the scale), so one codebook
        serves rows of different magnitude. The relative Frobenius reconstruction error
        ``||W - W_q|| / ||W||`` is stored in ``quantization_error``.
        """
        weight = linear.weight.detach()
        n, k = weight.shape
        layer = cls(
            k,
            n,
            entry_dim,
            num_entries,
            num_codebooks,
            bias=linear.bias is not None,
            scales=scales,
            device=weight.device,
            dtype=weight.dtype,
        )
        w = weight.float()
        row_scale = w.pow(2).mean(1).sqrt().clamp_min(1e-12) if scales else torch.ones_like(w[:, 0])
        vectors = (w / row_scale[:, None]).reshape(-1, entry_dim)
        generator = torch.Generator(device=weight.device).manual_seed(seed)
        codebooks, codes = _residual_kmeans(vectors, num_entries, num_codebooks, iters, generator)
        groups = k // entry_dim
        idx = torch.stack(codes, -1).reshape(n, groups, num_codebooks).to(torch.uint8)
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
    def to_linear(self):
        """The dequantized ``nn.Linear`` (same device and dtype)."""
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


def _nearest(vectors, centroids, chunk=1 << 16):
    """Index of the nearest centroid for each row (squared Euclidean), chunked for memory."""
    c_norm = centroids.pow(2).sum(1)
    out = torch.empty(vectors.shape[0], dtype=torch.long, device=vectors.device)
    for start in range(0, vectors.shape[0], chunk):
        v = vectors[start : start + chunk]
        out[start : start + chunk] = (c_norm - 2 * v @ centroids.T).argmin(1)
    return out


def _kmeans(vectors, num_entries, iters, generator, init=None):
    """Lloyd's k-means from ``init`` (else random data points); empty clusters are re-seeded
    with the worst-fit vectors."""
    n = vectors.shape[0]
    if n == 0:
        return torch.zeros(num_entries, vectors.shape[1], device=vectors.device), torch.zeros(
            0, dtype=torch.long, device=vectors.device
        )
    if init is not None:
        pick = None
    elif n >= num_entries:
        pick = torch.randperm(n, generator=generator, device=vectors.device)[:num_entries]
    else:
        pick = torch.randint(n, (num_entries,), generator=generator, device=vectors.device)
    centroids = init.clone() if init is not None else vectors[pick].clone()
    codes = _nearest(vectors, centroids)
    for _ in range(iters):
        sums = torch.zeros_like(centroids).index_add_(0, codes, vectors)
        counts = torch.bincount(codes, minlength=num_entries)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None].to(sums.dtype)
        empty = int((~filled).sum())
        if empty and n > num_entries:
            err = (vectors - centroids[codes]).pow(2).sum(1)
            centroids[~filled] = vectors[err.topk(empty).indices]
        new_codes = _nearest(vectors, centroids)
        if torch.equal(new_codes, codes):
            break
        codes = new_codes
    return centroids, codes


def _residual_kmeans(vectors, num_entries, num_codebooks, iters, generator):
    """Codebook m fits what codebooks 0..m-1 leave; then one pass re-fits each in turn."""
    codebooks, codes = [], []
    residual = vectors.clone()
    for _ in range(num_codebooks):
        cb, code = _kmeans(residual, num_entries, iters, generator)
        residual -= cb[code]
        codebooks.append(cb)
        codes.append(code)
    if num_codebooks > 1:
        for m in range(num_codebooks):
            residual += codebooks[m][codes[m]]
            codebooks[m], codes[m] = _kmeans(
                residual, num_entries, iters, generator, init=codebooks[m]
            )
            residual -= codebooks[m][codes[m]]
    return codebooks, codes
