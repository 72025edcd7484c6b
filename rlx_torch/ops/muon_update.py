"""Fused elementwise parts of a Muon step on CPU (float32 params); see csrc/cpu/muon_update.cpp.

``rlx::muon_ns_input(grads, bufs, rows, cols, momentum, nesterov, eps, safety, dtype,
transposed=False)``
    grads, bufs: contiguous float32 tensors of whole ``rows x cols`` matrices each. Updates
    every buffer in place, ``buf = lerp(buf, g, 1 - momentum)``, and returns the Newton–Schulz
    input ``[matrices, rows, cols]`` in ``dtype`` (float32 or bfloat16): the update
    (``lerp(g, buf, momentum)`` with Nesterov, else ``buf``) of each matrix divided by
    ``max(safety * ||update||_F, eps)``. ``transposed``: each matrix written as its transpose,
    ``[matrices, cols, rows]`` (Newton–Schulz iterates tall bf16 matrices in that wide form).
``rlx::muon_apply_(params, ortho, lr, weight_decay, scale)``
    ``p = (1 - lr * weight_decay) * p - lr * scale * ortho`` for the matrices of ``params``
    (contiguous float32) in order; ortho ``[matrices, rows, cols]`` float32 or bfloat16,
    contiguous or the transposed view (``.mT``) of a contiguous ``[matrices, cols, rows]``.
"""

import torch

__all__: list[str] = []  # the ops are called by rlx_torch.optim.Muon; nothing here is public


@torch.library.register_fake("rlx::muon_ns_input")
def _muon_ns_input_fake(grads, bufs, rows, cols, momentum, nesterov, eps, safety, dtype,
                        transposed=False):
    matrices = sum(g.numel() for g in grads) // (rows * cols)
    shape = (matrices, cols, rows) if transposed else (matrices, rows, cols)
    return grads[0].new_empty(shape, dtype=dtype)


@torch.library.register_fake("rlx::muon_apply_")
def _muon_apply_fake(params, ortho, lr, weight_decay, scale):
    return None
