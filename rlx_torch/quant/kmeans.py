"""Lloyd's k-means and residual (additive) k-means for vector-quantizing weight rows."""

from __future__ import annotations

import torch

__all__ = ["kmeans", "nearest", "residual_kmeans"]


def nearest(vectors: torch.Tensor, centroids: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """Index of the nearest centroid for each row (squared Euclidean), chunked for memory.

    Example::

        >>> rlx_torch.quant.nearest(torch.tensor([[0.9], [0.1]]), torch.tensor([[0.0], [1.0]]))
        tensor([1, 0])
    """
    c_norm = centroids.pow(2).sum(1)
    out = torch.empty(vectors.shape[0], dtype=torch.long, device=vectors.device)
    for start in range(0, vectors.shape[0], chunk):
        v = vectors[start : start + chunk]
        out[start : start + chunk] = (c_norm - 2 * v @ centroids.T).argmin(1)
    return out


def kmeans(
    vectors: torch.Tensor,
    num_entries: int,
    iters: int,
    generator: torch.Generator | None = None,
    init: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means of the rows of ``vectors`` ``[n, D]`` into ``num_entries`` centroids,
    from ``init`` (else random data points); empty clusters are re-seeded with the worst-fit
    vectors. Returns ``(centroids [num_entries, D], codes [n] int64)``.

    Example::

        >>> centroids, codes = rlx_torch.quant.kmeans(torch.randn(1000, 8), 16, iters=10)
        >>> centroids.shape, codes.shape
        (torch.Size([16, 8]), torch.Size([1000]))
    """
    n = vectors.shape[0]
    if n == 0:
        empty_codes = torch.zeros(0, dtype=torch.long, device=vectors.device)
        return vectors.new_zeros(num_entries, vectors.shape[1]), empty_codes
    if init is not None:
        pick = None
    elif n >= num_entries:
        pick = torch.randperm(n, generator=generator, device=vectors.device)[:num_entries]
    else:
        pick = torch.randint(n, (num_entries,), generator=generator, device=vectors.device)
    centroids = init.clone() if init is not None else vectors[pick].clone()
    codes = nearest(vectors, centroids)
    for _ in range(iters):
        sums = torch.zeros_like(centroids).index_add_(0, codes, vectors)
        counts = torch.bincount(codes, minlength=num_entries)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None].to(sums.dtype)
        empty = int((~filled).sum())
        if empty and n > num_entries:
            err = (vectors - centroids[codes]).pow(2).sum(1)
            centroids[~filled] = vectors[err.topk(empty).indices]
        new_codes = nearest(vectors, centroids)
        if torch.equal(new_codes, codes):
            break
        codes = new_codes
    return centroids, codes


def residual_kmeans(
    vectors: torch.Tensor,
    num_entries: int,
    num_codebooks: int,
    iters: int,
    generator: torch.Generator | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Additive k-means: codebook m fits what codebooks 0..m-1 leave, then one pass re-fits
    each in turn. Returns ``num_codebooks`` centroid tensors ``[num_entries, D]`` and as many
    code vectors ``[n]``; ``sum_m codebooks[m][codes[m]]`` approximates ``vectors``.

    Example::

        >>> books, codes = rlx_torch.quant.residual_kmeans(torch.randn(500, 4), 8, 2, iters=5)
        >>> len(books), books[0].shape
        (2, torch.Size([8, 4]))
    """
    codebooks, codes = [], []
    residual = vectors.clone()
    for _ in range(num_codebooks):
        cb, code = kmeans(residual, num_entries, iters, generator)
        residual -= cb[code]
        codebooks.append(cb)
        codes.append(code)
    if num_codebooks > 1:
        for m in range(num_codebooks):
            residual += codebooks[m][codes[m]]
            codebooks[m], codes[m] = kmeans(
                residual, num_entries, iters, generator, init=codebooks[m]
            )
            residual -= codebooks[m][codes[m]]
    return codebooks, codes
