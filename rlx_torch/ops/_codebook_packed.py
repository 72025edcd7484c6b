"""The packed 16-bit codebook forward on CPU: fake kernels, autograd, and the cache.

``torch.ops.rlx.codebook_pack_indices(indices, num_entries, slice_entries=0, block_rows=0)``
    int16/uint16 ``[N, K/D]`` codes (one codebook) reordered once into a 1-d int32 layout
    (csrc/cpu/codebook_packed.h); its length depends on the codes (a dynamic size under
    torch.compile). 0 picks the default slice and row block.
``torch.ops.rlx.codebook_matmul_packed(x, packed, indices, codebook, scales, bias)``
    equals ``codebook_matmul(x, indices, codebook, scales, bias)`` for
    ``packed = codebook_pack_indices(indices, E)``; raises ValueError when packed's header does
    not match indices' shape and E. The fast kernel covers float32 x, D = 8 and up to 16 rows;
    other calls run codebook_matmul. A call that needs gradients (reverse or forward mode) is
    codebook_matmul's call, with its autograd: the layout serves inference.
"""

import torch

from . import _codebook_autograd
from .codebook import check_inputs


@torch.library.register_fake("rlx::codebook_pack_indices")
def _pack_fake(indices, num_entries, slice_entries=0, block_rows=0):
    if indices.dtype not in (torch.int16, torch.uint16) or indices.dim() != 2:
        raise ValueError(
            "codebook_pack_indices: indices must be [N, K/D] int16 or uint16, got "
            f"{tuple(indices.shape)} {indices.dtype}"
        )
    size = torch.library.get_ctx().new_dynamic_size()
    return indices.new_empty((size,), dtype=torch.int32)


@torch.library.register_fake("rlx::codebook_matmul_packed")
def _matmul_packed_fake(x, packed, indices, codebook, scales, bias):
    check_inputs(x, indices, codebook, scales, bias)
    if indices.dim() != 2 or indices.dtype == torch.uint8:
        raise ValueError(
            "codebook_matmul_packed: indices must be 16-bit with one codebook "
            "([N, K/D] int16 or uint16)"
        )
    if packed.dtype != torch.int32 or packed.dim() != 1:
        raise ValueError(
            "codebook_matmul_packed: packed must be a 1-d int32 CPU tensor from "
            "codebook_pack_indices"
        )
    return x.new_empty((*x.shape[:-1], indices.shape[0]))


def _autograd_kernel(keyset, x, packed, indices, codebook, scales, bias):
    # Under autograd (reverse or forward mode) the call is codebook_matmul's, whose autograd
    # kernel covers every mode; the packed layout only serves calls without gradients.
    if _codebook_autograd._needs_autograd(x, codebook, scales, bias):
        return _codebook_autograd._forward_kernel(keyset, x, indices, codebook, scales, bias)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.rlx.codebook_matmul_packed.default.redispatch(
            keyset & torch._C._after_autograd_keyset, x, packed, indices, codebook, scales, bias
        )


_LIB = torch.library.Library("rlx", "IMPL")  # noqa: TOR901 (kept alive with the module)
_LIB.impl("codebook_matmul_packed", _autograd_kernel, "Autograd", with_keyset=True)


def usable(x, indices, codebook):
    """Whether a forward of these inputs takes the packed kernel (CPU, float32 x, 16-bit
    codes of one codebook, D = 8, at most 16 rows)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and indices.dim() == 2
        and indices.dtype in (torch.int16, torch.uint16)
        and codebook.shape[-1] == 8
        and x.numel() <= 16 * x.shape[-1]
    )


class PackedIndices:
    """The packed layout of one indices tensor, rebuilt when the tensor changes: keyed on its
    storage, ``_version`` (bumped by every in-place write), shape and E."""

    def __init__(self):
        self._key = None
        self._packed = None

    def get(self, indices, num_entries):
        key = (indices.data_ptr(), indices._version, tuple(indices.shape), num_entries)
        if key != self._key:
            self._packed = torch.ops.rlx.codebook_pack_indices(indices, num_entries)
            self._key = key
        return self._packed
