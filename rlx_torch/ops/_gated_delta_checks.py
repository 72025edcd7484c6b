"""Input checks of the gated delta rule ops for the fake (meta) kernels.

They apply the rules of ``csrc/include/rlx/gdn_checks.h`` (shapes, dtypes, devices), with
the same messages, so that eager, meta and compiled calls reject the same inputs alike.
What only the real kernels can check is the values of ``cu_seqlens`` (they live in device
memory). Sizes may be symbolic (``torch.compile(dynamic=True)``): comparisons then become
guards, never specializations.
"""

import torch

# c10's names of the dtypes, as the C++ checks print them.
_C10_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
              torch.float64: "Double", torch.int64: "Long", torch.int32: "Int"}
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def c10_name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shape(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _fail(op: str, message: str):
    raise RuntimeError(f"{op}: {message}")


def check_same_device(op: str, q: torch.Tensor, tensors: dict) -> None:
    """Every tensor on q's device; cu_seqlens may also live on the CPU (it is read on the
    host). A tensor on another device would otherwise let that device's kernel (meta's:
    uninitialized outputs) run for all of them."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != q.device and not (name == "cu_seqlens" and t.device.type == "cpu"):
            _fail(op, f"all inputs must be on q's device {q.device}, got {name} on {t.device}")


def check_inputs(op, q, k, v, g, beta, initial_state, cu_seqlens, chunk_size):
    """gdn_check_inputs without reading cu_seqlens' values; returns N (the state count)."""
    if q.dim() != 4:
        _fail(op, f"q must be [B, T, H, K], got a {q.dim()}-D tensor {_shape(q)}")
    if k.shape != q.shape:
        _fail(op, f"k must have q's shape [B, T, H, K] = {_shape(q)}, got {_shape(k)}")
    if v.dim() != 4:
        _fail(op, f"v must be [B, T, HV, V], got a {v.dim()}-D tensor {_shape(v)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[0] != B or v.shape[1] != T:
        _fail(op, f"v must share q's batch and time sizes (B, T) = ({B}, {T}), got v {_shape(v)}")
    if not (H >= 1 and HV >= 1 and HV % H == 0):
        _fail(op, f"the value heads HV = {HV} must be a positive multiple of the q/k heads H = {H}")
    if not 1 <= K <= 256:
        _fail(op, f"the key head dim K must be in [1, 256], got {K}")
    if not 1 <= V <= 256:
        _fail(op, f"the value head dim V must be in [1, 256], got {V}")
    g_head = g.dim() == 3 and tuple(g.shape) == (B, T, HV)
    g_chan = g.dim() == 4 and tuple(g.shape) == (B, T, HV, K)
    if not (g_head or g_chan):
        _fail(op, f"g must be [B, T, HV] = [{B}, {T}, {HV}] (per-head gate) or [B, T, HV, K] = "
                  f"[{B}, {T}, {HV}, {K}] (per-channel gate), got {_shape(g)}")
    if not (beta.dim() == 3 and tuple(beta.shape) == (B, T, HV)):
        _fail(op, f"beta must be [B, T, HV] = [{B}, {T}, {HV}], got {_shape(beta)}")
    if q.dtype not in INPUT_DTYPES:
        _fail(op, f"q must be float16, bfloat16, float32 or float64, got {c10_name(q.dtype)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(op, f"q, k and v must share one dtype, got q {c10_name(q.dtype)}, k "
                  f"{c10_name(k.dtype)}, v {c10_name(v.dtype)}")
    acc = acc_dtype(q.dtype)
    if g.dtype != acc or beta.dtype != acc:
        _fail(op, f"g and beta must be {c10_name(acc)} (the accumulation dtype for "
                  f"{c10_name(q.dtype)} inputs), got g {c10_name(g.dtype)}, beta "
                  f"{c10_name(beta.dtype)}")
    check_same_device(op, q, {"k": k, "v": v, "g": g, "beta": beta,
                              "initial_state": initial_state, "cu_seqlens": cu_seqlens})
    if chunk_size < 0:
        _fail(op, f"chunk_size must be >= 0 (0 keeps no checkpoints), got {chunk_size}")
    N = B
    if cu_seqlens is not None:
        cu = cu_seqlens
        if not (cu.dim() == 1 and cu.shape[0] >= 2 and cu.dtype == torch.int64):
            _fail(op, f"cu_seqlens must be a 1-D int64 tensor [N + 1] with N >= 1, got "
                      f"{c10_name(cu.dtype)} {_shape(cu)}")
        if B != 1:
            _fail(op, f"cu_seqlens packs sequences along T, so B must be 1, got B = {B}")
        N = cu.shape[0] - 1
    if initial_state is not None:
        h0 = initial_state
        if not (h0.dim() == 4 and tuple(h0.shape) == (N, HV, K, V)):
            _fail(op, f"initial_state must be [N, HV, K, V] = [{N}, {HV}, {K}, {V}], got "
                      f"{_shape(h0)}")
        if h0.dtype != acc:
            _fail(op, f"initial_state must be {c10_name(acc)}, got {c10_name(h0.dtype)}")
    return N


def check_backward_inputs(op, q, v, N, slots, checkpoints, grad_o, grad_final_state, chunk_size,
                          vw):
    """The backward's own arguments: gdn_check_backward_inputs (gdn_checks.h), in its order
    (shapes and dtypes, devices, vw)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc = acc_dtype(q.dtype)
    if chunk_size < 1:
        _fail(op, "chunk_size must be >= 1: the backward needs the forward's checkpoints, got "
                  f"{chunk_size}")
    if not (checkpoints.dim() == 4 and tuple(checkpoints.shape) == (slots, HV, K, V)
            and checkpoints.dtype == acc):
        _fail(op, f"checkpoints must be the {c10_name(acc)} [{slots}, {HV}, {K}, {V}] tensor that "
                  f"rlx::gated_delta_fwd returned for these inputs, got "
                  f"{c10_name(checkpoints.dtype)} {_shape(checkpoints)}")
    if grad_o.shape != v.shape or grad_o.dtype != q.dtype:
        _fail(op, f"grad_o must have o's shape {_shape(v)} and dtype {c10_name(q.dtype)}, got "
                  f"{c10_name(grad_o.dtype)} {_shape(grad_o)}")
    if grad_final_state is not None:
        gh = grad_final_state
        if not (gh.dim() == 4 and tuple(gh.shape) == (N, HV, K, V) and gh.dtype == acc):
            _fail(op, f"grad_final_state must be {c10_name(acc)} [{N}, {HV}, {K}, {V}], got "
                      f"{c10_name(gh.dtype)} {_shape(gh)}")
    check_same_device(op, q, {"checkpoints": checkpoints, "grad_o": grad_o,
                              "grad_final_state": grad_final_state, "vw": vw})
    if vw is not None and vw.numel() > 0:
        if vw.shape != v.shape or vw.dtype != acc:
            _fail(op, f"vw must be the {c10_name(acc)} {_shape(v)} tensor that "
                      f"rlx::gated_delta_fwd returned for these inputs (or None), got "
                      f"{c10_name(vw.dtype)} {_shape(vw)}")
