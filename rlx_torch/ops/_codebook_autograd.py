"""Autograd kernels of rlx::codebook_matmul and rlx::codebook_matmul_backward.

Both ops are multilinear, so every derivative is again a call of the two ops:

* forward ``out = op(x, C, s) + b`` is linear in x, C, s and b separately, so its jvp is
  ``op(tx, C, s) + op(x, tC, s) + op(x, C, ts) + tb``;
* the backward ``(gx, gC, gs, gb) = bw(g, x, C, s)`` has gx linear in (g, C, s), gC in
  (g, x, s), gs in (g, x, C) and gb = sum(g); its own vector-Jacobian product and jvp are
  written with the two ops below (derivations in docs/codebook.md).

The kernels are registered on the ops' Autograd key, so ``torch.ops.rlx.*`` called directly
are differentiable: reverse mode to any order (the backward's backward calls the ops through
these same kernels), forward mode, and torch.func (grad, jvp, vmap through
``generate_vmap_rule``).
"""

import torch
import torch.autograd.forward_ad as fwAD
from torch import _C
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._functorch.utils import enable_single_level_autograd_function

_LIB = torch.library.Library("rlx", "IMPL")  # noqa: TOR901 (kept alive with the module)


def _forward_ad_active():
    return _C._is_fwd_grad_enabled() and fwAD._current_level >= 0


def _needs_autograd(*tensors):
    if _forward_ad_active():
        return True
    return _C.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _functorch_active():
    return _C._are_functorch_transforms_active()


def matmul(x, indices, codebook, scales, bias=None):
    """rlx::codebook_matmul, differentiable under autograd and torch.func at any depth."""
    # Under torch.func the Function must be applied above the dispatcher (functorch routes
    # it level by level); the ops' own autograd kernels only see one level.
    # Compiled graphs call the op, whose autograd kernel AOTAutograd traces.
    if not torch.compiler.is_compiling() and (
        _functorch_active() or _needs_autograd(x, codebook, scales, bias)
    ):
        return _Forward.apply(x, indices, codebook, scales, bias)
    return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)


def matmul_backward(grad_out, x, indices, codebook, scales, mask):
    """rlx::codebook_matmul_backward, differentiable like `matmul`."""
    if not torch.compiler.is_compiling() and (
        _functorch_active() or _needs_autograd(grad_out, x, codebook, scales)
    ):
        return _Backward.apply(grad_out, x, indices, codebook, scales, _bits(mask))
    return torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)


def _bits(mask):
    # One int, not a list: torch.func flattens Function arguments, and a list would become
    # four inputs.
    return sum(int(bool(on)) << i for i, on in enumerate(mask))


def _unbits(bits):
    return [bool(bits >> i & 1) for i in range(4)]


def _raw_op(x, indices, codebook, scales, bias=None):
    return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)


def _raw_bw(grad_out, x, indices, codebook, scales, mask):
    return torch.ops.rlx.codebook_matmul_backward(grad_out, x, indices, codebook, scales, mask)


def _ops(ctx):
    """(forward, backward) for the derivatives: the ops themselves when the Function was
    applied by an op's autograd kernel (below torch.func's layers), else the differentiable
    entry points above."""
    if getattr(getattr(ctx, "_forward_cls", None), "raw", False):
        return _raw_op, _raw_bw
    return matmul, matmul_backward


def _add(total, term):
    return term if total is None else total + term


class _Forward(torch.autograd.Function):
    generate_vmap_rule = True
    op_name = "codebook_matmul"
    raw = False  # derivatives through the differentiable entry points (see _ops)

    @staticmethod
    def forward(x, indices, codebook, scales, bias):
        with _C._AutoDispatchBelowAutograd():
            return torch.ops.rlx.codebook_matmul(x, indices, codebook, scales, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, indices, codebook, scales, _ = inputs
        ctx.save_for_backward(x, indices, codebook, scales)
        ctx.save_for_forward(x, indices, codebook, scales)

    @staticmethod
    def backward(ctx, grad_out):
        x, indices, codebook, scales = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[2], need[3] and scales is not None, need[4]]
        if not any(mask):
            return None, None, None, None, None
        # Differentiable itself (through the backward op's autograd kernel) under create_graph.
        _, _bw = _ops(ctx)
        grads = _bw(grad_out, x, indices, codebook, scales, mask)
        gx, gc, gs, gb = (g if on else None for g, on in zip(grads, mask, strict=True))
        return gx, None, gc, gs, gb

    @staticmethod
    def jvp(ctx, tx, _t_indices, tc, ts, tb):
        x, indices, codebook, scales = ctx.saved_tensors
        _op, _ = _ops(ctx)
        out = None
        if tx is not None:
            out = _add(out, _op(tx, indices, codebook, scales))
        if tc is not None:
            out = _add(out, _op(x, indices, tc, scales))
        if ts is not None:
            out = _add(out, _op(x, indices, codebook, ts))
        if tb is not None:
            out = _add(out, tb.expand(*x.shape[:-1], tb.shape[0]))
        if out is None:
            out = x.new_zeros((*x.shape[:-1], indices.shape[0]))
        return out


class _Backward(torch.autograd.Function):
    generate_vmap_rule = True
    op_name = "codebook_matmul_backward"
    raw = False

    @staticmethod
    def forward(grad_out, x, indices, codebook, scales, mask_bits):
        with _C._AutoDispatchBelowAutograd():
            return torch.ops.rlx.codebook_matmul_backward(
                grad_out, x, indices, codebook, scales, _unbits(mask_bits)
            )

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, x, indices, codebook, scales, mask_bits = inputs
        output_mask = _unbits(mask_bits)
        ctx.mask = output_mask
        ctx.save_for_backward(grad_out, x, indices, codebook, scales)
        ctx.save_for_forward(grad_out, x, indices, codebook, scales)
        ctx.set_materialize_grads(False)
        off = [t for t, on in zip(output, output_mask, strict=True) if not on]
        if off:
            ctx.mark_non_differentiable(*off)

    @staticmethod
    def backward(ctx, ugx, ugc, ugs, ugb):
        g, x, indices, codebook, scales = ctx.saved_tensors
        _op, _bw = _ops(ctx)
        ugx, ugc, ugs, ugb = (u if on else None for u, on in zip((ugx, ugc, ugs, ugb), ctx.mask,
                                                                 strict=True))
        need = ctx.needs_input_grad  # grad_out, x, indices, codebook, scales, mask_bits
        n_g, n_x, n_c = need[0], need[1], need[3]
        n_s = need[4] and scales is not None
        dg = dx = dc = ds = None
        if ugx is not None:  # <ugx, gx> = <g, op(ugx, C, s)>
            if n_g:
                dg = _add(dg, _op(ugx, indices, codebook, scales))
            if n_c or n_s:
                r = _bw(g, ugx, indices, codebook, scales, [False, n_c, n_s, False])
                dc = _add(dc, r[1]) if n_c else dc
                ds = _add(ds, r[2]) if n_s else ds
        if ugc is not None:  # <ugc, gC> = <g, op(x, ugc, s)>
            if n_g:
                dg = _add(dg, _op(x, indices, ugc, scales))
            if n_x or n_s:
                r = _bw(g, x, indices, ugc, scales, [n_x, False, n_s, False])
                dx = _add(dx, r[0]) if n_x else dx
                ds = _add(ds, r[2]) if n_s else ds
        if ugs is not None:  # <ugs, gs> = <g, op(x, C, ugs)>
            if n_g:
                dg = _add(dg, _op(x, indices, codebook, ugs))
            if n_x or n_c:
                r = _bw(g, x, indices, codebook, ugs, [n_x, n_c, False, False])
                dx = _add(dx, r[0]) if n_x else dx
                dc = _add(dc, r[1]) if n_c else dc
        if ugb is not None and n_g:  # <ugb, gb> = <g, ugb broadcast>
            dg = _add(dg, ugb.expand(g.shape))
        return dg, dx, None, dc, ds, None

    @staticmethod
    def jvp(ctx, tg, tx, _t_indices, tc, ts, _t_mask):
        g, x, indices, codebook, scales = ctx.saved_tensors
        _, _bw = _ops(ctx)
        mask = ctx.mask
        out = [None] * 4
        # Each output is linear in each input it depends on: gx in (g, C, s), gC in (g, x, s),
        # gs in (g, x, C), gb in g. Replace one input by its tangent per term.
        terms = [
            (tg, lambda t: _bw(t, x, indices, codebook, scales, mask), (0, 1, 2, 3)),
            (tx, lambda t: _bw(g, t, indices, codebook, scales, mask), (1, 2)),
            (tc, lambda t: _bw(g, x, indices, t, scales, mask), (0, 2)),
            (ts, lambda t: _bw(g, x, indices, codebook, t, [mask[0], mask[1], False, False]),
             (0, 1)),
        ]
        for tangent, call, outputs in terms:
            if tangent is None or not any(mask[i] for i in outputs):
                continue
            r = call(tangent)
            for i in outputs:
                if mask[i]:
                    out[i] = _add(out[i], r[i])
        shapes = (x.shape, codebook.shape, (indices.shape[0],), (indices.shape[0],))
        result = []
        for i in range(4):
            if not mask[i]:  # a non-differentiable placeholder output
                result.append(None)
            else:
                result.append(out[i] if out[i] is not None else x.new_zeros(shapes[i]))
        return tuple(result)


class _RawForward(_Forward):
    raw = True


class _RawBackward(_Backward):
    raw = True


def _apply(function, *args):
    # The kernels run below functorch's layers (their tensors are unwrapped for the current
    # transform level), where Function.apply's functorch route does not exist: use the plain
    # autograd route, as a C++ autograd kernel would. That is right for one level only.
    if len(retrieve_all_functorch_interpreters()) > 1:
        raise RuntimeError(
            f"torch.ops.rlx.{function.op_name} under nested torch.func transforms is not "
            "supported (its autograd kernel sees a single transform level); call "
            "rlx_torch.codebook_matmul instead, which supports any nesting"
        )
    with enable_single_level_autograd_function():
        return super(torch.autograd.Function, function).apply(*args)


def _forward_kernel(keyset, x, indices, codebook, scales, bias):
    if _needs_autograd(x, codebook, scales, bias):
        return _apply(_RawForward, x, indices, codebook, scales, bias)
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.rlx.codebook_matmul.default.redispatch(
            keyset & _C._after_autograd_keyset, x, indices, codebook, scales, bias
        )


def _backward_kernel(keyset, grad_out, x, indices, codebook, scales, output_mask):
    if _needs_autograd(grad_out, x, codebook, scales):
        return _apply(_RawBackward, grad_out, x, indices, codebook, scales, _bits(output_mask))
    with _C._AutoDispatchBelowAutograd():
        return torch.ops.rlx.codebook_matmul_backward.default.redispatch(
            keyset & _C._after_autograd_keyset, grad_out, x, indices, codebook, scales,
            output_mask
        )


def register():
    """Registers the two autograd kernels (once, from rlx_torch.ops.codebook)."""
    _LIB.impl("codebook_matmul", _forward_kernel, "Autograd", with_keyset=True)
    _LIB.impl("codebook_matmul_backward", _backward_kernel, "Autograd", with_keyset=True)
