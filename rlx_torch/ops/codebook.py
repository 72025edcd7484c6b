"""Codebook (vector-quantized) matmul: ``out = x @ dequantize(indices, codebook).T``.

Op contract, shared by every backend (CPU in csrc/cpu/codebook.cpp, MPS in csrc/mps/):

``torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias) -> out``
    x         [..., K]            float32 / float64 / float16 / bfloat16, any strides
    indices   [N, K/D] or [N, K/D, M]   uint8 (M additive codebooks; 2-d means M = 1)
    codebook  [E, D] or [M, E, D] x's dtype, E <= 256 (2-d with 2-d indices, 3-d with 3-d)
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
    grad_x [..., K] like x (contiguous); grad_codebook like codebook; grad_scales [N]
    (requires scales; with scales None its bit must be False); grad_bias [N] = grad_out summed
    over the leading dims. indices get no gradient. Deterministic: bitwise identical results
    for identical inputs. An empty batch gives zero gradients.
"""

import torch

__all__ = ["codebook_matmul"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_shapes(x, indices, codebook, scales=None, bias=None):
    # The fake kernels see only shapes, dtypes and devices; the complete checks (same wording)
    # live in csrc/include/rlx/codebook.h and run in every backend. A mix of devices that
    # includes "meta" dispatches here instead of to a backend, so devices are checked here too.
    for name, t in (
        ("indices", indices),
        ("codebook", codebook),
        ("scales", scales),
        ("bias", bias),
    ):
        if t is not None and t.device != x.device:
            raise ValueError(
                f"codebook_matmul: {name} must be on x's device {x.device}, got {t.device}"
            )
    if x.dim() < 1 or x.dtype not in _FLOATS:
        raise ValueError(f"codebook_matmul: x must be a float tensor [..., K], got {x.dtype}")
    if indices.dtype != torch.uint8:
        raise ValueError(f"codebook_matmul: indices must be uint8, got {indices.dtype}")
    if indices.dim() not in (2, 3) or codebook.dim() != indices.dim():
        raise ValueError(
            "codebook_matmul: indices/codebook must be [N, K/D]/[E, D] or [N, K/D, M]/[M, E, D], "
            f"got {tuple(indices.shape)} and {tuple(codebook.shape)}"
        )


@torch.library.register_fake("rlx::codebook_matmul")
def _codebook_matmul_fake(x, indices, codebook, scales, bias):
    _check_shapes(x, indices, codebook, scales, bias)
    return x.new_empty((*x.shape[:-1], indices.shape[0]))


@torch.library.register_fake("rlx::codebook_matmul_backward")
def _codebook_matmul_backward_fake(grad_out, x, indices, codebook, scales, output_mask):
    _check_shapes(x, indices, codebook, scales)
    n = indices.shape[0]
    shapes = (x.shape, codebook.shape, (n,), (n,))
    return tuple(x.new_empty(s if on else (0,)) for s, on in zip(shapes, output_mask, strict=True))


class CodebookMatmul(torch.autograd.Function):
    """autograd wrapper: forward and backward are the native rlx ops."""

    @staticmethod
    def forward(x, indices, codebook, scales, bias):
        return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, indices, codebook, scales, _ = inputs
        ctx.save_for_backward(x, indices, codebook, scales)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, indices, codebook, scales = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3] and scales is not None, need[4]]
        if not any(mask):
            return None, None, None, None, None
        grads = torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)
        gx, gc, gs, gb = (g if on else None for g, on in zip(grads, mask, strict=True))
        return gx, None, gc, gs, gb


def codebook_matmul(x, indices, codebook, scales=None, bias=None):
    """``out[..., j] = scales[j] * (x @ W.T)[..., j] + bias[j]``, ``W`` the dequantized weight.

    Args:
        x: ``[..., K]`` float32/float64/float16/bfloat16.
        indices: uint8 ``[N, K/D]`` (one codebook) or ``[N, K/D, M]`` (M additive codebooks).
        codebook: ``[E, D]`` or ``[M, E, D]`` with E <= 256, x's dtype.
        scales: optional ``[N]`` per-output scale. bias: optional ``[N]``.

    Returns ``[..., N]`` in x's dtype. Differentiable in x, codebook, scales and bias (first
    order); the small-batch path never builds the dense N x K weight.
    """
    # Without autograd the op is called directly: Function.apply costs ~25 us per call, a
    # twentieth of a 4096 x 4096 one-row product.
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, codebook, scales, bias)
    ):
        return CodebookMatmul.apply(x, indices, codebook, scales, bias)
    return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)
