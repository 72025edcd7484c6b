"""Autograd kernels of rlx::gated_delta_fwd and rlx::gated_delta_bwd.

Registered on the ops' Autograd key, so ``torch.ops.rlx.*`` called directly behave like the
public function in every autograd mode:

* reverse mode through ``gated_delta_fwd``: the backward op, split by ``unpack_gradients``
  (the same backward as :func:`rlx_torch.gated_delta_rule`'s);
* forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``/``jacfwd``) on either op:
  a clear error naming the inputs that carry tangents (without these kernels the tangents
  were dropped and the outputs came back with none, read as zeros);
* double backward: ``gated_delta_bwd``'s output is not differentiable; differentiating it
  raises instead of treating it as a constant.

Without gradients or tangents the kernels redispatch below autograd at once. The public
function calls the ops below autograd itself in eager mode (see ``call_below_autograd``),
so its path does not run these kernels.
"""

import torch
import torch.autograd.forward_ad as fwAD
from torch import _C
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._functorch.utils import enable_single_level_autograd_function

_LIB = torch.library.Library("rlx", "IMPL")  # noqa: TOR901 (kept alive with the module)

NO_FORWARD_AD = (
    "{op} does not support forward-mode AD (torch.func.jvp, jacfwd, "
    "torch.autograd.forward_ad): its inputs {names} carry tangents. Use reverse mode "
    "(backward, torch.autograd.grad, torch.func.grad, vjp or jacrev).")
NO_DOUBLE_BACKWARD = (
    "{op} does not support double backward: its backward is a native kernel "
    "that is not differentiable, so gradients of its gradients (create_graph=True with "
    "{names} requiring grad, e.g. a gradient penalty, or torch.func.hessian) would come back "
    "wrong. Differentiate once, or use rlx_torch.ops.reference.gated_delta_rule for "
    "higher-order gradients.")

_FWD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
_BWD_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "checkpoints", "grad_o",
              "grad_final_state", "vw")


def with_tangents(named):
    """Names of the tensors that carry a forward-mode tangent (forward AD or torch.func.jvp)."""
    if fwAD._current_level < 0 or not _C._is_fwd_grad_enabled():
        return []  # no dual level, or inside a Function's forward: nothing to unpack
    return [name for name, t in named
            if isinstance(t, torch.Tensor) and fwAD.unpack_dual(t).tangent is not None]


def reject_tangents(op, named):
    names = with_tangents(named)
    if names:
        raise RuntimeError(NO_FORWARD_AD.format(op=op, names=", ".join(names)))


def call_below_autograd(op, *args):
    """``op(*args)`` without its autograd kernel (the caller is an autograd.Function that
    handles autograd itself): one Python kernel call less per op call in eager mode. Traced
    graphs call the op as it is (dynamo does not trace the guard; the kernel is cheap to
    trace)."""
    if torch.compiler.is_compiling():
        return op(*args)
    with _C._AutoDispatchBelowAutograd():
        return op(*args)


def _apply(function, *args, nested_ok=False):
    # The kernels run below functorch's layers, where Function.apply's functorch route does
    # not exist: use the plain autograd route, as a C++ autograd kernel would (one level).
    # That is right for one transform level only; nested_ok for a Function whose backward
    # only raises (the node merely marks its outputs as not differentiable at this level).
    if not nested_ok and len(retrieve_all_functorch_interpreters()) > 1:
        raise RuntimeError(
            f"torch.ops.rlx.{function.op_name} with gradients under nested torch.func "
            "transforms is not supported (its autograd kernel sees a single transform "
            "level); call rlx_torch.gated_delta_rule instead")
    with enable_single_level_autograd_function():
        return super(torch.autograd.Function, function).apply(*args)


def _requires_grad(named):
    return _C.is_grad_enabled() and any(
        t is not None and t.requires_grad for _, t in named)


def register(functorch_function):
    """Registers both kernels (once, from rlx_torch.ops.gated_delta). functorch_function:
    the public function's setup_context Function (its setup_context and backward are
    reused, so the raw op and the public function differentiate alike)."""
    fwd_op = torch.ops.rlx.gated_delta_fwd.default
    bwd_op = torch.ops.rlx.gated_delta_bwd.default

    class RawForward(functorch_function):
        op_name = "gated_delta_fwd"

        @staticmethod
        def forward(*args):
            with _C._AutoDispatchBelowAutograd():
                return fwd_op(*args)

    class RawBackward(torch.autograd.Function):
        op_name = "gated_delta_bwd"

        @staticmethod
        def forward(*args):
            with _C._AutoDispatchBelowAutograd():
                return bwd_op(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.differentiable = [n for n, t in zip(_BWD_NAMES, _bwd_tensors(inputs),
                                                    strict=True)
                                  if t is not None and t.requires_grad]

        @staticmethod
        def backward(ctx, _grad_packed):
            raise RuntimeError(NO_DOUBLE_BACKWARD.format(
                op="rlx::gated_delta_bwd", names=", ".join(ctx.differentiable)))

    def fwd_kernel(keyset, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                   chunk_size=64, l2norm_eps=None):
        args = (q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, l2norm_eps)
        named = tuple(zip(_FWD_NAMES, (q, k, v, g, beta, initial_state), strict=True))
        reject_tangents("rlx::gated_delta_fwd", named)
        if _requires_grad(named):
            return _apply(RawForward, *args)
        with _C._AutoDispatchBelowAutograd():
            return fwd_op.redispatch(keyset & _C._after_autograd_keyset, *args)

    def bwd_kernel(keyset, q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoints,
                   grad_o, grad_final_state, chunk_size=64, l2norm_eps=None, vw=None):
        args = (q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoints, grad_o,
                grad_final_state, chunk_size, l2norm_eps, vw)
        named = tuple(zip(_BWD_NAMES, _bwd_tensors(args), strict=True))
        reject_tangents("rlx::gated_delta_bwd", named)
        if _requires_grad(named):
            return _apply(RawBackward, *args, nested_ok=True)
        with _C._AutoDispatchBelowAutograd():
            return bwd_op.redispatch(keyset & _C._after_autograd_keyset, *args)

    _LIB.impl("gated_delta_fwd", fwd_kernel, "Autograd", with_keyset=True)
    _LIB.impl("gated_delta_bwd", bwd_kernel, "Autograd", with_keyset=True)


def _bwd_tensors(args):
    q, k, v, g, beta, _, initial_state, _, checkpoints, grad_o, grad_final_state = args[:11]
    vw = args[13] if len(args) > 13 else None
    return (q, k, v, g, beta, initial_state, checkpoints, grad_o, grad_final_state, vw)
