"""Codebook (vector-quantized) matmul: ``out = x @ dequantize(indices, codebook).T``.

Op contract, shared by every backend (CPU in csrc/cpu/codebook.cpp, MPS in csrc/mps/):

``torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias) -> out``
    x         [..., K]            float32 / float64 / float16 / bfloat16, any strides
    indices   [N, K/D] or [N, K/D, M]   uint8 (E <= 256), or int16 / uint16 (E <= 65536;
                                  int16 codes are read as their 16-bit pattern, i.e. modulo
                                  2**16, as AQLM stores them); M additive codebooks
    codebook  [E, D] or [M, E, D] x's dtype (2-d with 2-d indices, 3-d with 3-d); on CPU with
                                  float32 x and 16-bit indices also float16 or bfloat16
    scales    [N] or None         x's dtype, per-output scale
    bias      [N] or None         x's dtype
    out       [..., N]            x's dtype:
        out[..., j] = scales[j] * sum_{m,kb,t} x[..., kb*D+t] * codebook[m, indices[j,kb,m], t]
                      + bias[j]
    Half inputs accumulate in float32. Every tensor is on x's device. Bad arguments raise
    ValueError naming the argument; on CPU an index >= E raises ValueError too.

``torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, output_mask)
  -> (grad_x, grad_codebook, grad_scales, grad_bias)``
    grad_out  [..., N] with x's leading dims and dtype.
    output_mask  four bools: which of the four gradients to compute. A gradient whose bit is
    False is returned as an empty tensor of shape [0] (x's dtype and device), not computed.
    grad_x [..., K] like x (contiguous); grad_codebook like codebook (its dtype); grad_scales [N]
    (requires scales; with scales None its bit must be False); grad_bias [N] = grad_out summed
    over the leading dims. indices get no gradient. Deterministic: bitwise identical results
    for identical inputs. An empty batch gives zero gradients.

Both ops are differentiable when called directly (autograd kernels registered below):
reverse mode to any order, forward mode (jvp), and torch.func's grad, jvp and vmap. The
derivatives are themselves calls of the two ops (rlx_torch/ops/_codebook_autograd.py).
"""

import torch

from . import _codebook_autograd

__all__ = ["codebook_matmul"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Largest codebook each index dtype can address.
_MAX_ENTRIES = {torch.uint8: 256, torch.int16: 65536, torch.uint16: 65536}


def _check_vector(v, name, x, n):
    if v is None:
        return
    if v.dim() != 1 or v.shape[0] != n:
        raise ValueError(
            f"codebook_matmul: {name} must have shape [N] = [{n}], got {tuple(v.shape)}"
        )
    if v.dtype != x.dtype:
        raise ValueError(f"codebook_matmul: {name} must have x's dtype {x.dtype}, got {v.dtype}")
    if v.device != x.device:
        raise ValueError(
            f"codebook_matmul: {name} must be on x's device {x.device}, got {v.device}"
        )


def check_inputs(x, indices, codebook, scales=None, bias=None):
    """The rules of rlx::codebook::check_inputs (csrc/include/rlx/codebook.h), in the same
    order and wording, for the fake kernels: eager, meta and compiled calls fail alike.
    (A mix of devices that includes "meta" dispatches to the fakes, so devices matter here.)
    """
    if x.dim() < 1:
        raise ValueError("codebook_matmul: x must have shape [..., K], got a 0-d tensor")
    if x.dtype not in _FLOATS:
        raise ValueError(
            f"codebook_matmul: x must be float32, float64, float16 or bfloat16, got {x.dtype}"
        )
    if indices.dtype not in _MAX_ENTRIES:
        raise ValueError(
            f"codebook_matmul: indices must be uint8, int16 or uint16, got {indices.dtype}"
        )
    if indices.dim() not in (2, 3):
        raise ValueError(
            "codebook_matmul: indices must have shape [N, K/D] or [N, K/D, M], got "
            f"{tuple(indices.shape)}"
        )
    if codebook.dim() != indices.dim():
        raise ValueError(
            "codebook_matmul: codebook must have shape [E, D] for 2-d indices or [M, E, D] for "
            f"3-d indices; got codebook {tuple(codebook.shape)} with indices {tuple(indices.shape)}"
        )
    half_ok = (
        x.dtype == torch.float32
        and codebook.dtype in (torch.float16, torch.bfloat16)
        and indices.dtype != torch.uint8
        and x.device.type in ("cpu", "meta")
        and codebook.device.type in ("cpu", "meta")
    )
    if codebook.dtype != x.dtype and not half_ok:
        raise ValueError(
            f"codebook_matmul: codebook must have x's dtype {x.dtype} (or float16/bfloat16 with "
            f"float32 x and 16-bit indices on CPU), got {codebook.dtype}"
        )
    for name, t in (("indices", indices), ("codebook", codebook)):
        if t.device != x.device:
            raise ValueError(
                f"codebook_matmul: {name} must be on x's device {x.device}, got {t.device}"
            )
    k, n, groups = x.shape[-1], indices.shape[0], indices.shape[1]
    m = indices.shape[2] if indices.dim() == 3 else 1
    e, d = codebook.shape[-2], codebook.shape[-1]
    if m < 1:
        raise ValueError("codebook_matmul: indices' last dim M must be >= 1")
    if codebook.dim() == 3 and codebook.shape[0] != m:
        raise ValueError(
            f"codebook_matmul: codebook has {codebook.shape[0]} codebooks but indices' last dim "
            f"M is {m}"
        )
    top = _MAX_ENTRIES[indices.dtype]
    if not 1 <= e <= top:
        bits = "uint8" if top == 256 else "16-bit"
        raise ValueError(
            f"codebook_matmul: codebook must have 1 to {top} entries E ({bits} indices), got E={e}"
        )
    if d < 1:
        raise ValueError("codebook_matmul: codebook entry dim D must be >= 1")
    if k % d != 0:
        raise ValueError(
            f"codebook_matmul: x's last dim K={k} must be a multiple of the codebook entry dim "
            f"D={d}"
        )
    if groups != k // d:
        tail = ", M]" if indices.dim() == 3 else "]"
        raise ValueError(
            f"codebook_matmul: indices must have shape [N, K/D{tail} with K/D = {k // d}, got "
            f"{tuple(indices.shape)}"
        )
    _check_vector(scales, "scales", x, n)
    _check_vector(bias, "bias", x, n)


def check_backward_inputs(grad_out, x, indices, codebook, scales, output_mask):
    """rlx::codebook::check_backward_inputs, for the backward's fake."""
    check_inputs(x, indices, codebook, scales, None)
    expected = (*x.shape[:-1], indices.shape[0])
    if tuple(grad_out.shape) != expected:
        raise ValueError(
            f"codebook_matmul_backward: grad_out must have shape {expected}, got "
            f"{tuple(grad_out.shape)}"
        )
    if grad_out.dtype != x.dtype:
        raise ValueError(
            f"codebook_matmul_backward: grad_out must have x's dtype {x.dtype}, got "
            f"{grad_out.dtype}"
        )
    if grad_out.device != x.device:
        raise ValueError(
            f"codebook_matmul_backward: grad_out must be on x's device {x.device}, got "
            f"{grad_out.device}"
        )
    if output_mask[2] and scales is None:
        raise ValueError("codebook_matmul_backward: output_mask[2] (grad_scales) needs scales")


@torch.library.register_fake("rlx::codebook_matmul")
def _codebook_matmul_fake(x, indices, codebook, scales, bias):
    check_inputs(x, indices, codebook, scales, bias)
    return x.new_empty((*x.shape[:-1], indices.shape[0]))


@torch.library.register_fake("rlx::codebook_matmul_backward")
def _codebook_matmul_backward_fake(grad_out, x, indices, codebook, scales, output_mask):
    check_backward_inputs(grad_out, x, indices, codebook, scales, output_mask)
    n = indices.shape[0]
    shapes = (x.shape, codebook.shape, (n,), (n,))
    dtypes = (x.dtype, codebook.dtype, x.dtype, x.dtype)
    # grad_x is contiguous (the kernels write a fresh [..., K] tensor); the others are new too.
    # Skipped gradients are [0] in x's dtype; grad_codebook has the codebook's dtype.
    return tuple(
        x.new_empty(s if on else (0,), dtype=t if on else x.dtype)
        for s, t, on in zip(shapes, dtypes, output_mask, strict=True)
    )


_codebook_autograd.register()

from . import _codebook_packed  # noqa: E402, F401  (registers the packed ops' fakes, autograd)


def codebook_matmul(
    x: torch.Tensor,
    indices: torch.Tensor,
    codebook: torch.Tensor,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[..., j] = scales[j] * (x @ W.T)[..., j] + bias[j]``, ``W`` the dequantized weight.

    Args:
        x: ``[..., K]`` float32/float64/float16/bfloat16.
        indices: ``[N, K/D]`` (one codebook) or ``[N, K/D, M]`` (M additive codebooks); uint8
            for E <= 256 entries, int16 or uint16 for E <= 65536 (int16 read modulo 2**16).
        codebook: ``[E, D]`` or ``[M, E, D]``, x's dtype; on CPU with float32 x and 16-bit
            indices also float16 or bfloat16 (AQLM's codebooks, read as they are).
        scales: optional ``[N]`` per-output scale. bias: optional ``[N]``.

    Returns ``[..., N]`` in x's dtype. Differentiable in x, codebook, scales and bias (reverse
    mode to any order, forward mode, torch.func); the small-batch paths never build the dense
    N x K weight.

    Example:
        >>> x = torch.randn(2, 16)
        >>> indices = torch.randint(0, 256, (4, 2), dtype=torch.uint8)
        >>> codebook_matmul(x, indices, torch.randn(256, 8)).shape
        torch.Size([2, 4])
    """
    return _codebook_autograd.matmul(x, indices, codebook, scales, bias)
