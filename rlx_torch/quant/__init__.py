"""Quantizers and format conversions behind ``CodebookLinear``.

- :func:`dequantize`: the dense weight of a codebook-quantized matrix (differentiable).
- :func:`kmeans`, :func:`residual_kmeans`: the vector quantizers of ``CodebookLinear.from_linear``.
- :func:`from_aqlm_tensors`, :func:`to_aqlm_tensors`: AQLM's ``codes``/``codebooks``/``scales``
  to and from ``CodebookLinear``'s ``indices``/``codebook``/``scales``.
"""

from .aqlm_format import AqlmTensors, from_aqlm_tensors, to_aqlm_tensors
from .codebook import dequantize, index_dtype, max_entries, pack_indices
from .kmeans import kmeans, nearest, residual_kmeans

__all__ = [
    "AqlmTensors",
    "dequantize",
    "from_aqlm_tensors",
    "index_dtype",
    "kmeans",
    "max_entries",
    "nearest",
    "pack_indices",
    "residual_kmeans",
    "to_aqlm_tensors",
]
