"""Gated delta rule (Gated DeltaNet and Kimi Delta Attention), fla-compatible.

Per (sequence, value head hv), with q/k head ``h = hv // (HV // H)`` and state
``S in R^{K x V}`` (float32; float64 for float64 inputs)::

    S <- exp(g_t) * S            (per-channel gate: diag(exp(g_t)) @ S)
    u  = beta_t * (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = scale * S^T q_t

Public entry: :func:`gated_delta_rule`. It runs an ``autograd.Function`` whose forward and
backward call the native ops below.

Op contracts (schemas in ``csrc/ops.cpp``; packed layouts in
``csrc/include/rlx/gdn_backward_layout.h``). ``acc`` is float64 for float64 inputs, else
float32. ``B*T`` tokens are addressed as ``b*T + t`` (the packed position when varlen).

``rlx::gated_delta_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=64,
l2norm_eps=None) -> (o, final_state, checkpoints, vw)``
    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV % H == 0, 1 <= K, V <= 256), all one dtype
    (float16, bfloat16, float32, float64). g ``[B, T, HV]`` or ``[B, T, HV, K]`` and beta
    ``[B, T, HV]`` in acc. initial_state ``[N, HV, K, V]`` acc or None (zeros). cu_seqlens
    int64 ``[N + 1]``, from 0, non-decreasing, ending at T, requires B = 1; else N = B.
    Returns o (v's shape and dtype, contiguous), final_state ``[N, HV, K, V]`` acc, and
    checkpoints ``[slots, HV, K, V]`` acc, slots = ``gated_delta_checkpoint_slots(N, B*T, C)``:
    sequence n (first token bos_n) stores its state before its token ``j*C`` in slot
    ``n + bos_n // C + j``. Unused slots are zero but for the tag (the first 4 bytes of
    the last slot, which no sequence uses; see below). ``chunk_size=0`` keeps no checkpoints
    (0 slots), for forward passes no backward follows (the CPU kernel supports it; the
    public function uses it on the CPU when no gradient is needed). With ``l2norm_eps``
    (every backend), the kernels L2-normalize each q and k row first (fla's l2norm below,
    without rounding the normalized rows to the input dtype). vw ``[B, T, HV, V]`` acc is
    ``v_t - w_t`` per token (``w_t = P_t^T k_t``, the decayed state's prediction of v_t; u =
    beta vw), returned on every backend when ``chunk_size > 0`` and the gate is per head
    (``gdn_keeps_vw``; the CPU's chunked backward reads it instead of recomputing it);
    otherwise an empty ``[0]`` tensor.

``rlx::gated_delta_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoints,
grad_o, grad_final_state, chunk_size=64, l2norm_eps=None, vw=None) -> packed``
    Same inputs as the forward plus its checkpoints, grad_o (o's shape and dtype),
    grad_final_state (``[N, HV, K, V]`` acc, or None for zero) and its vw (None or empty:
    recomputed). Returns one flat acc buffer:
    dq ``[B,T,H,K]``, dk ``[B,T,H,K]``, dv ``[B,T,HV,V]``, dg (g's shape), dbeta ``[B,T,HV]``,
    then d_initial_state ``[N,HV,K,V]`` when initial_state is given; dq and dk are those of
    the raw q and k when ``l2norm_eps`` is given (as it was to the forward). The layout is the
    C++ GdnBackwardLayout (``rlx::gated_delta_bwd_layout`` returns its offsets); since every
    slice is its input's gradient, contiguous and in order, :func:`unpack_gradients` splits
    it by the inputs' own element counts, which stay symbolic under dynamic shapes. (The op
    returns the buffer rather than views into it because custom-op outputs must not alias
    each other under torch.compile.) The forward tags its checkpoints with what the backward
    must be given alike (chunk_size, l2norm_eps, whether the CPU forward keeps vw); the
    backward (CPU and MPS alike) rejects checkpoints whose tag does not match its arguments.

``rlx::gated_delta_bwd_layout(B, T, H, HV, K, V, N, gate_per_channel, has_initial_state)
-> [dq.offset, dq.numel, dk..., dv..., dg..., dbeta..., dstate..., total]``
``rlx::gated_delta_checkpoint_slots(N, tokens, chunk_size) -> int``

``rlx::gated_delta_l2norm_fwd(x, eps) -> (y, rstd)`` and
``rlx::gated_delta_l2norm_bwd(grad_y, x, rstd) -> grad_x`` (CPU; other devices use the same
formula in PyTorch ops): fla's ``y = x / sqrt(sum(x^2, -1) + eps)`` in x's dtype, rstd
``[x.shape[:-1]]`` in acc.
"""

import numbers

import torch

from . import _gated_delta_autograd as _autograd
from . import _gated_delta_checks as _checks

__all__ = ["gated_delta_rule", "l2norm"]

_SLICES = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
L2NORM_EPS = 1e-6


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bwd_layout(B, T, H, HV, K, V, N, per_channel, has_state):
    """{slice name: (offset, numel), "total": n} of the packed backward buffer, from the C++
    header (GdnBackwardLayout), for checking that the split below matches it."""
    flat = torch.ops.rlx.gated_delta_bwd_layout(B, T, H, HV, K, V, N, per_channel, has_state)
    layout = {name: (flat[2 * i], flat[2 * i + 1]) for i, name in enumerate(_SLICES)}
    layout["total"] = flat[-1]
    return layout


def _checkpoint_slots(N, tokens, chunk_size):
    """gdn_checkpoint_slots (gdn_backward_layout.h) on possibly symbolic sizes (the fakes'
    shapes under torch.compile(dynamic=True)); test_checkpoint_slots_match_the_header holds
    the two to the same values."""
    return N + (tokens + chunk_size - 1) // chunk_size if chunk_size > 0 else 0


def _num_states(q, cu_seqlens):
    return cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]


@torch.library.register_fake("rlx::gated_delta_fwd")
def _fwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size=64,
              l2norm_eps=None):
    op = "rlx::gated_delta_fwd"
    N = _checks.check_inputs(op, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    _check_l2norm_eps(op, l2norm_eps)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    slots = _checkpoint_slots(N, B * T, chunk_size)
    o = v.new_empty(v.shape)  # contiguous, like the kernels' at::empty_like of a contiguous v
    final_state = q.new_empty((N, HV, K, V), dtype=acc)
    checkpoints = q.new_empty((slots, HV, K, V), dtype=acc)
    # gdn_keeps_vw (gdn_backward_layout.h): the same rule on every backend
    keeps_vw = chunk_size > 0 and g.dim() == 3
    vw = q.new_empty(v.shape if keeps_vw else (0,), dtype=acc)
    return o, final_state, checkpoints, vw


@torch.library.register_fake("rlx::gated_delta_bwd")
def _bwd_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, checkpoints, grad_o,
              grad_final_state, chunk_size=64, l2norm_eps=None, vw=None):
    op = "rlx::gated_delta_bwd"
    _check_l2norm_eps(op, l2norm_eps)
    N = _checks.check_inputs(op, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    slots = _checkpoint_slots(N, q.shape[0] * q.shape[1], chunk_size)
    _checks.check_backward_inputs(op, q, v, N, slots, checkpoints, grad_o, grad_final_state,
                                  chunk_size, vw)
    return q.new_empty((sum(_slice_numels(q, v, g, initial_state)),), dtype=_acc_dtype(q.dtype))


def _check_l2norm_eps(op, l2norm_eps):
    # gdn_check_l2norm_eps (csrc/include/rlx/gdn_checks.h)
    if l2norm_eps is not None and not (l2norm_eps >= 0 and l2norm_eps < float("inf")):
        raise RuntimeError(
            f"{op}: l2norm_eps must be None or a finite number >= 0, got {l2norm_eps}")


def _slice_numels(q, v, g, initial_state):
    """Element counts of the packed buffer's slices, in order: each gradient has its input's
    shape (GdnBackwardLayout; test_backward_layout_tiles_buffer holds the header to it).
    Taken from the inputs themselves, so they stay symbolic under dynamic shapes."""
    beta_numel = g.numel() // g.shape[3] if g.dim() == 4 else g.numel()
    dstate = initial_state.numel() if initial_state is not None else 0
    return [q.numel(), q.numel(), v.numel(), g.numel(), beta_numel, dstate]


def unpack_gradients(packed, q, v, g, initial_state, cu_seqlens):
    """Views of ``rlx::gated_delta_bwd``'s packed buffer: (dq, dk, dv, dg, dbeta, dstate).
    The slices tile the buffer in this order from offset 0 (GdnBackwardLayout; tested by
    test_backward_layout_tiles_buffer), so one split cuts them all."""
    shapes = [q.shape, q.shape, v.shape, g.shape, g.shape[:3]]
    numels = _slice_numels(q, v, g, initial_state)
    if initial_state is None:
        numels = numels[:5]
    else:
        shapes.append(initial_state.shape)
    parts = packed.split(numels)
    views = tuple(part.view(shape) for part, shape in zip(parts, shapes, strict=True))
    return views if initial_state is not None else views + (None,)


_NO_FORWARD_AD = _autograd.NO_FORWARD_AD.replace("{op}", "gated_delta_rule")
_NO_DOUBLE_BACKWARD = _autograd.NO_DOUBLE_BACKWARD.replace("{op}", "gated_delta_rule")


def _differentiable(t):
    """Whether autograd would differentiate through t beyond the current backward. A
    torch.func grad transform (grad, vjp, jacrev) runs backward with create_graph=True and
    saves its own wrappers, which require grad at its level: what counts is whether the
    wrapped tensor is tracked by an outer grad transform (jacrev(jacrev), grad(grad))."""
    functorch = torch._C._functorch
    if functorch.is_gradtrackingtensor(t):
        return functorch.is_gradtrackingtensor(functorch.get_unwrapped(t))
    return t.requires_grad


def _check_not_differentiated(named):
    """Raises where the backward's own result would be differentiated: its kernel is not
    differentiable, and autograd would silently treat it as a constant."""
    differentiated = _with_tangents(named)  # forward AD over the backward (jacfwd(jacrev))
    if not differentiated and torch.is_grad_enabled():  # create_graph=True
        differentiated = [n for n, t in named if t is not None and _differentiable(t)]
    if differentiated:
        raise RuntimeError(_NO_DOUBLE_BACKWARD.format(names=", ".join(differentiated)))


def _backward(ctx, grad_o, grad_final_state):
    q, k, v, g, beta, initial_state, cu_seqlens, checkpoints, vw = ctx.saved_tensors
    _check_not_differentiated((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                               ("initial_state", initial_state), ("grad_o", grad_o),
                               ("grad_final_state", grad_final_state)))
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    elif grad_o.dtype != v.dtype:
        grad_o = grad_o.to(v.dtype)
    packed = _autograd.call_below_autograd(
        torch.ops.rlx.gated_delta_bwd, q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens,
        checkpoints, grad_o, grad_final_state, ctx.chunk_size, ctx.l2norm_eps, vw)
    dq, dk, dv, dg, dbeta, dstate = unpack_gradients(packed, q, v, g, initial_state,
                                                     cu_seqlens)
    if q.dtype != packed.dtype:  # 16-bit inputs: gradients in the inputs' dtype
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return dq, dk, dv, dg, dbeta, None, dstate, None, None, None


def _save(ctx, inputs, outputs):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, l2norm_eps = inputs
    _, _, checkpoints, vw = outputs
    ctx.scale, ctx.chunk_size, ctx.l2norm_eps = scale, chunk_size, l2norm_eps
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, checkpoints, vw)
    ctx.mark_non_differentiable(checkpoints, vw)
    # Unused outputs (final_state when not returned, the checkpoints, vw) get None rather than
    # materialized zeros: 2 MiB of zero-filled checkpoint gradient per call at T = 2048.
    ctx.set_materialize_grads(False)


class GatedDeltaRuleFunction(torch.autograd.Function):
    """Differentiable ``(o, final_state) = f(q, k, v, g, beta, initial_state)``; g, beta and
    initial_state already in the accumulation dtype. With ``l2norm_eps``, the ops
    L2-normalize q and k themselves and return the raw rows' gradients.

    Written with ``ctx`` in ``forward`` rather than a ``setup_context``: ``apply`` then skips
    binding the arguments through ``inspect.signature``, a sizeable part of a short-sequence
    step (docs/benchmarks.md, "Figures behind code choices"). torch.func transforms need a
    ``setup_context``: under them :class:`GatedDeltaRuleFunctorch` runs instead. No ``jvp``
    (torch.compile does not trace Functions that define one): forward-mode AD raises, in
    gated_delta_rule, and autograd's own error for a Function without one."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size,
                l2norm_eps):
        inputs = (q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, l2norm_eps)
        outputs = _autograd.call_below_autograd(torch.ops.rlx.gated_delta_fwd, *inputs)
        _save(ctx, inputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx, grad_o, grad_final_state, _grad_checkpoints, _grad_vw):
        return _backward(ctx, grad_o, grad_final_state)


class GatedDeltaRuleFunctorch(torch.autograd.Function):
    """:class:`GatedDeltaRuleFunction` in the form torch.func transforms take (``grad``,
    ``vjp``, ``jacrev``; ``vmap`` through the generated rule, which runs the op once per
    batch element)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, l2norm_eps):
        return torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, scale, initial_state,
                                             cu_seqlens, chunk_size, l2norm_eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_o, grad_final_state, _grad_checkpoints, _grad_vw):
        return _backward(ctx, grad_o, grad_final_state)

    @staticmethod
    def jvp(ctx, *tangents):  # (jacfwd over a grad transform reaches here, e.g. hessian)
        names = ("q", "k", "v", "g", "beta", "initial_state")
        given = tangents[:5] + tangents[6:7]
        raise RuntimeError(_NO_FORWARD_AD.format(names=", ".join(
            n for n, t in zip(names, given, strict=True) if t is not None)))


# The ops' own autograd (torch.ops.rlx.gated_delta_fwd/bwd called directly), with this
# module's backward.
_autograd.register(GatedDeltaRuleFunctorch)


@torch.library.register_fake("rlx::gated_delta_l2norm_fwd")
def _l2norm_fwd_fake(x, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_acc_dtype(x.dtype))


@torch.library.register_fake("rlx::gated_delta_l2norm_bwd")
def _l2norm_bwd_fake(grad_y, x, rstd):
    return x.new_empty(x.shape)


class L2NormFunction(torch.autograd.Function):
    """Native l2norm (``rlx::gated_delta_l2norm_fwd/bwd``, CPU)."""

    @staticmethod
    def forward(x, eps):
        return torch.ops.rlx.gated_delta_l2norm_fwd(x, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # rstd's gradient stays None, not zeros

    @staticmethod
    def backward(ctx, grad_y, _grad_rstd):
        if grad_y is None:
            return None, None
        x, rstd = ctx.saved_tensors
        return torch.ops.rlx.gated_delta_l2norm_bwd(grad_y.contiguous(), x, rstd), None


_with_tangents = _autograd.with_tangents


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """fla's l2norm: ``x / sqrt(sum(x^2, -1) + eps)``, computed in float32 (float64 for
    float64 input) and returned in x's dtype. Native on CPU (one op each way); elsewhere, and
    for forward-mode AD, plain PyTorch ops.

    Example:
        >>> y = l2norm(torch.randn(2, 5, 3, 8))
        >>> bool(torch.allclose(y.norm(dim=-1), torch.ones(2, 5, 3), atol=1e-5))
        True
    """
    if x.device.type == "cpu" and not _with_tangents((("x", x),)):
        if not (x.requires_grad and torch.is_grad_enabled()):
            # The op directly: Function.apply binds its arguments with inspect.signature,
            # which costs more than the op itself at a decode step's T = 1.
            return torch.ops.rlx.gated_delta_l2norm_fwd(x, float(eps))[0]
        return L2NormFunction.apply(x, float(eps))[0]
    xf = x.to(_acc_dtype(x.dtype))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _as_acc(name, t, acc, required=True):
    if t is None and not required:
        return None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"gated_delta_rule: {name} must be a floating-point tensor, got {got}")
    return t.to(acc)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, forward and backward natively (fla's ``chunk_gated_delta_rule``
    semantics).

    ``q, k, v, g, beta`` are positional; the options after them are keyword-only (fla's
    positional order is :func:`rlx_torch.compat.fla.chunk_gated_delta_rule`).

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]``, HV a multiple of H (value head hv
            reads q/k head ``hv // (HV // H)``). One dtype: float16, bfloat16, float32 or
            float64.
        g: log-space decay, ``[B, T, HV]`` (one per head, Gated DeltaNet) or
            ``[B, T, HV, K]`` (one per key channel, KDA).
        beta: ``[B, T, HV]``, in (0, 1).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (cast to float32; float64 for float64 inputs).
        output_final_state: also return the final state ``[N, HV, K, V]``.
        cu_seqlens: int64 or int32 ``[N + 1]`` packing N sequences along T (requires B = 1); the
            state resets at every boundary.
        use_qk_l2norm: L2-normalize q and k over K first (fla's eps 1e-6), differentiably.
        chunk_size: checkpoint interval of the forward (memory O(T / chunk_size * K * V)).

    Returns:
        ``(o, final_state or None)``; o has v's shape and dtype; state math is float32.

    Reverse-mode autograd (also torch.func.grad/vjp/jacrev and vmap) is supported;
    forward-mode AD and double backward raise a clear error.

    Example:
        >>> B, T, H, K, V = 1, 6, 2, 8, 4
        >>> q = torch.randn(B, T, H, K)
        >>> k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H))
        >>> o, state = gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        >>> o.shape, state.shape
        (torch.Size([1, 6, 2, 4]), torch.Size([1, 2, 8, 4]))
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise TypeError("gated_delta_rule: q, k and v must be tensors")
    if q.dim() != 4:
        raise ValueError(f"gated_delta_rule: q must be [B, T, H, K], got shape {tuple(q.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"gated_delta_rule: chunk_size must be an int >= 1, got {chunk_size!r}")
    if scale is None:
        # (K = 0 is left to the op's check of K, which names it)
        scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError("gated_delta_rule: scale must be a real number (or None for K ** -0.5), "
                        f"got {type(scale).__name__}")
    elif not float("-inf") < scale < float("inf"):
        raise ValueError(f"gated_delta_rule: scale must be finite, got {scale}")
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int32:
        cu_seqlens = cu_seqlens.long()  # as transformers and FlashAttention build them
    acc = _acc_dtype(q.dtype)
    g, beta = _as_acc("g", g, acc), _as_acc("beta", beta, acc)
    initial_state = _as_acc("initial_state", initial_state, acc, required=False)
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
             ("initial_state", initial_state))
    tangents = _with_tangents(named)
    if tangents:
        raise RuntimeError(_NO_FORWARD_AD.format(names=", ".join(tangents)))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for _, t in named)
    on_cpu = q.device.type == "cpu"
    # inside the ops (every backend): q and k rows are normalized as they are read
    l2norm_eps = L2NORM_EPS if use_qk_l2norm else None
    if torch._C._are_functorch_transforms_active():
        o, final_state, _, _ = GatedDeltaRuleFunctorch.apply(
            q, k, v, g, beta, float(scale), initial_state, cu_seqlens, chunk_size, l2norm_eps)
    elif needs_grad or not on_cpu:
        o, final_state, _, _ = GatedDeltaRuleFunction.apply(
            q, k, v, g, beta, float(scale), initial_state, cu_seqlens, chunk_size, l2norm_eps)
    else:  # inference: no checkpoints (saves O(T / C * K * V) memory per head)
        o, final_state, _, _ = _autograd.call_below_autograd(
            torch.ops.rlx.gated_delta_fwd, q, k, v, g, beta, float(scale), initial_state,
            cu_seqlens, 0, l2norm_eps)
    return o, (final_state if output_final_state else None)
