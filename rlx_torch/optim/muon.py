"""Muon (momentum + Newton–Schulz orthogonalization) with an AdamW side, for a whole model.

A drop-in for `torch.optim.Muon`: the same positional arguments with the same meanings (our
additions are keyword-only), and it reads torch.optim.Muon's `state_dict`. It matches
`torch.optim.Muon` when configured alike (`ns_dtype=torch.bfloat16`), and goes beyond it:
- same-shape matrices of a group are orthogonalized together, one batched Newton–Schulz;
- >= 2-D params: conv weights flattened to `[out, in*kh*kw]`, 3-D `[E, m, n]` as E matrices;
- `use_muon=False` groups are updated with AdamW by the same optimizer;
- coefficient presets (Keller, Polar Express), configurable NS dtype;
- `step()` never writes `p.grad`, never lets a momentum buffer alias the NS input, and makes no
  host-device synchronisation (no reads of device tensors, no branching on tensor values).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

from .cpu_features import native_bf16
from .newton_schulz import KELLER, Workspace, iterates_wide, newton_schulz, resolve_schedule

__all__ = ["Muon"]

# None means "original", as in torch.optim.Muon; "identity" leaves lr unadjusted.
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "identity")
ND_MODES = ("auto", "flatten", "batch")
# Upper bound on the elements stacked into one batched Newton–Schulz: bounds the optimizer's
# transient memory (a few copies of the batch) on very large models without costing speed
# (a batch this size already saturates any GPU).
MAX_BATCH_ELEMENTS = 1 << 28
# On CPU, batches of at most 512K elements (2 MiB in fp32; 8 [256, 256] or 2 [1024, 256]
# matrices): a batch's bf16 iterates then stay cache-resident through the whole iteration
# (the step time this saves: docs/benchmarks.md, "Figures behind code choices").
CPU_MAX_BATCH_ELEMENTS = 1 << 19


def matrix_view(shape: torch.Size, nd_mode: str) -> tuple[int, int, int]:
    """(count, rows, cols): how a Muon param of `shape` is seen as `count` matrices."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if nd_mode == "flatten" or (nd_mode == "auto" and len(shape) >= 4):
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def lr_scale(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Per-shape learning-rate multiplier giving rectangular updates a consistent size."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":  # Keller: sqrt(max(1, rows/cols))
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":  # Moonlight: update RMS ~ 0.2, like AdamW's
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def default_ns_dtype(device: torch.device, param_dtype: torch.dtype) -> torch.dtype:
    """The Newton–Schulz dtype used when `ns_dtype` is None.

    bfloat16 on CUDA (tensor cores; its rounding is well inside what NS tolerates) and on CPUs
    with native bf16 arithmetic (AVX512-BF16, AMX, Arm BF16: bf16 products at about twice the
    float32 rate or more). float32 on other CPUs, where bf16 matmuls are emulated and slower
    than float32 ones, and on MPS (bf16 emulated on M1/M2, measured slower than float32 on
    newer chips). float64 params on CPU keep float64.

    >>> default_ns_dtype(torch.device("cpu"), torch.float64)
    torch.float64
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu":
        if param_dtype == torch.float64:
            return torch.float64
        return torch.bfloat16 if native_bf16() else torch.float32
    return torch.float32


def _host_scalar(value):
    # A CPU tensor lr (LR schedulers may keep one) is read on the host: no device sync.
    # A device tensor lr stays a tensor and enters the arithmetic on the device.
    if isinstance(value, Tensor) and value.device.type == "cpu":
        return value.item()
    return value


def _check_nonnegative(name: str, value, tensor_ok: bool = False) -> None:
    if tensor_ok and isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: a Tensor {name} must have one element, got {value.numel()}")
        return  # not read back here: that would synchronise
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not value >= 0.0:  # also catches NaN
        raise ValueError(f"{name} must be >= 0, got {value}")


class Muon(Optimizer):
    r"""Muon for matrix params, AdamW for the rest, in one optimizer. See docs/optim.md.

    The positional arguments are torch.optim.Muon's, in its order and with its meanings;
    the rest are keyword-only. Defaults that differ from torch's: ``lr`` (0.02, not 1e-3),
    ``weight_decay`` (0, not 0.1); see docs/optim.md for why.

    Args:
        params: params or param groups. A group with ``use_muon=False`` is updated with AdamW
            (decoupled weight decay); :func:`muon_param_groups` builds the conventional split.
        lr: learning rate (default 0.02; AdamW groups normally set their own, e.g. 3e-4).
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay`` (default 0).
        momentum: EMA factor of the momentum buffer (default 0.95).
        nesterov: use the Nesterov look-ahead ``lerp(g, buf, momentum)`` (default True).
        ns_coefficients: one ``(a, b, c)`` (default Keller's (3.4445, -4.7750, 2.0315), as
            torch), a list of per-step triples (a list shorter than ``ns_steps`` repeats its
            last triple), or a preset name, ``"keller"`` or ``"polar_express"`` (5-step
            schedule, normaliser safety 1.02).
        eps: lower clamp of the Frobenius norm that normalises the NS input (default 1e-7).
        ns_steps: Newton–Schulz iterations (default 5).
        adjust_lr_fn: ``None`` or ``"original"``: sqrt(max(1, rows/cols)) (Keller Jordan);
            ``"match_rms_adamw"``: 0.2*sqrt(max(rows, cols)) (Moonlight); ``"identity"``: no
            adjustment (default None, as torch).
        ns_dtype: (keyword-only) dtype of the Newton–Schulz matmuls; None picks bfloat16 on
            CUDA and on CPUs with native bf16 arithmetic, float32 on other CPUs and on MPS,
            float64 for float64 params on CPU (default None).
        adamw_betas: (keyword-only) AdamW (beta1, beta2) for ``use_muon=False`` groups
            (default (0.9, 0.95)).
        adamw_eps: (keyword-only) AdamW epsilon (default 1e-8).
        nd_mode: (keyword-only) how > 2-D Muon params become matrices: ``"auto"`` (3-D =
            batch of matrices, >= 4-D flattened to ``[shape[0], -1]``), ``"flatten"`` or
            ``"batch"`` (all leading dims are batch) (default "auto"). Settable per group.

    Example:
        >>> from rlx_torch.optim import Muon, muon_param_groups
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        >>> opt = Muon(muon_param_groups(model), 0.02, 0.01)  # lr, weight_decay as in torch
        >>> model(torch.randn(2, 8)).sum().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]] = KELLER,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        nd_mode: str = "auto",
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            nd_mode=nd_mode,
            use_muon=True,
        )
        self._validate_hyperparameters(defaults)
        super().__init__(params, defaults)

    # ---- validation ----

    @staticmethod
    def _validate_hyperparameters(group: dict) -> None:
        _check_nonnegative("lr", group["lr"], tensor_ok=True)
        _check_nonnegative("momentum", group["momentum"])
        _check_nonnegative("weight_decay", group["weight_decay"])
        if not group["momentum"] < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
        if not (isinstance(group["eps"], int | float) and group["eps"] > 0.0):
            raise ValueError(f"eps must be a number > 0, got {group['eps']!r}")
        resolve_schedule(group["ns_coefficients"], group["ns_steps"])  # raises ValueError
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(
                f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {group['adjust_lr_fn']!r}"
            )
        ns_dtype = group["ns_dtype"]
        if ns_dtype is not None and not (
            isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point
        ):
            raise ValueError(f"ns_dtype must be None or a floating torch.dtype, got {ns_dtype!r}")
        if group["nd_mode"] not in ND_MODES:
            raise ValueError(f"nd_mode must be one of {ND_MODES}, got {group['nd_mode']!r}")
        betas = group["adamw_betas"]
        if not (isinstance(betas, tuple | list) and len(betas) == 2
                and all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"adamw_betas must be two numbers in [0, 1), got {betas!r}")
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"nesterov must be a bool, got {group['nesterov']!r}")
        if not isinstance(group["use_muon"], bool):
            raise ValueError(f"use_muon must be a bool, got {group['use_muon']!r}")
        if not isinstance(group["adamw_eps"], int | float) or not group["adamw_eps"] >= 0.0:
            raise ValueError(f"adamw_eps must be >= 0, got {group['adamw_eps']!r}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state saved by this class or by `torch.optim.Muon` (whose groups lack our
        keys: they are Muon groups and take ours from this optimizer's current groups).

        Validates before anything changes: each saved group's hyperparameters (as the
        constructor does), that a saved Muon group goes onto a Muon group and an AdamW one
        onto an AdamW one, and that each param's saved state has its keys and shapes.
        Raises ValueError naming the group and the problem.
        """
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: the state holds {len(saved_groups or [])} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        groups = []
        for i, (saved, current) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            group = dict(saved)
            group.setdefault("use_muon", True)  # torch.optim.Muon: every group is Muon
            for key, value in current.items():
                if key != "params":
                    group.setdefault(key, value)
            if bool(group["use_muon"]) != bool(current["use_muon"]):
                kind = {True: "Muon", False: "AdamW (use_muon=False)"}
                raise ValueError(
                    f"load_state_dict: param_groups[{i}] was saved as a "
                    f"{kind[bool(group['use_muon'])]} group but is a "
                    f"{kind[bool(current['use_muon'])]} group here; build the optimizer with "
                    "the same groups in the same order as the one that was saved"
                )
            try:
                self._validate_hyperparameters(group)
            except ValueError as e:
                raise ValueError(f"load_state_dict: param_groups[{i}]: {e}") from None
            groups.append(group)
        self._validate_saved_state(state_dict.get("state", {}), groups)
        super().load_state_dict({**state_dict, "param_groups": groups})

    def _validate_saved_state(self, state: dict, groups: list[dict]) -> None:
        needed = {True: ("momentum_buffer",), False: ("step", "exp_avg", "exp_avg_sq")}
        for i, (group, current) in enumerate(zip(groups, self.param_groups, strict=True)):
            for index, p in zip(group["params"], current["params"], strict=False):
                entry = state.get(index)
                if entry is None:
                    continue
                for key in needed[bool(group["use_muon"])]:
                    value = entry.get(key) if isinstance(entry, dict) else None
                    if value is None:
                        raise ValueError(f"load_state_dict: param_groups[{i}]: the state of "
                                         f"param {index} has no {key!r}")
                    if key != "step" and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(
                            f"load_state_dict: param_groups[{i}]: {key!r} of param {index} "
                            f"has shape {tuple(value.shape)}, the param {tuple(p.shape)}"
                        )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_hyperparameters(group)
        for i, p in enumerate(group["params"]):
            if p.is_complex():
                raise ValueError(f"Muon does not support complex parameters (param {i})")
            if group["use_muon"] and p.ndim < 2:
                raise ValueError(
                    f"param {i} of a Muon group has shape {tuple(p.shape)}: Muon orthogonalizes "
                    "matrices (>= 2 dims). Put 0-D/1-D params (biases, norms) in a group with "
                    "use_muon=False (AdamW), e.g. with rlx_torch.optim.muon_param_groups(model)."
                )

    # ---- step ----

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step; `closure` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _params_with_grad(self, group: dict):
        for p in group["params"]:
            if p.grad is None or p.numel() == 0:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            yield p

    def _muon_step(self, group: dict) -> None:
        # Each job's update is applied before the next job runs, so one workspace serves all
        # (its buffers are kept from step to step: newton_schulz.Workspace).
        workspace = self.__dict__.setdefault("_ns_workspace", Workspace())
        for job in self._muon_jobs(group):
            job.apply(job.orthogonalize(workspace))

    def _muon_jobs(self, group: dict):
        """The group's batches, in a fixed order (that of its params): same matrix shape, dtype
        and device -> one batched Newton–Schulz, split at the batch size limit. Each job has
        its momentum buffers already updated and its NS input built."""
        schedule = resolve_schedule(group["ns_coefficients"], group["ns_steps"])
        batches: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in self._params_with_grad(group):
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            count, rows, cols = matrix_view(p.shape, group["nd_mode"])
            batches[(rows, cols, p.dtype, p.device)].append(p)
        for (rows, cols, dtype, device), params in batches.items():
            limit = CPU_MAX_BATCH_ELEMENTS if device.type == "cpu" else MAX_BATCH_ELEMENTS
            for chunk in _chunks(params, limit):
                yield _MuonJob(self, group, schedule, chunk, rows, cols, dtype, device)

    def _adamw_step(self, group: dict) -> None:
        per_device = defaultdict(list)
        for p in self._params_with_grad(group):
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            per_device[(p.device, p.dtype)].append(p)
        for params in per_device.values():
            self._adamw_update(group, params)

    def _adamw_update(self, group: dict, params: list[Tensor]) -> None:
        # Same arithmetic as torch.optim.AdamW(foreach=True), so the two agree bit for bit.
        lr = _host_scalar(group["lr"])
        beta1, beta2 = group["adamw_betas"]
        weight_decay, eps = group["weight_decay"], group["adamw_eps"]
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]

        if weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)

        bias_c1 = [1.0 - beta1 ** s["step"] for s in states]
        bias_c2_sqrt = [math.sqrt(1.0 - beta2 ** s["step"]) for s in states]
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bias_c2_sqrt)
        torch._foreach_add_(denom, eps)
        if isinstance(lr, Tensor):
            steps = torch._foreach_div(exp_avgs, denom)
            for p, step_dir, bc1 in zip(params, steps, bias_c1, strict=True):
                p.add_(step_dir * (lr / -bc1))
        else:
            torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / bc1 for bc1 in bias_c1])


class _MuonJob:
    """One batch of same-shape matrices: building the NS input (momentum buffers updated),
    orthogonalizing it, applying the result. `orthogonalize` depends only on `X`, so it may
    run on another process (rlx_torch.optim.distributed)."""

    def __init__(self, opt, group, schedule, params, rows, cols, dtype, device) -> None:
        self.params, self.schedule, self.eps = params, schedule, group["eps"]
        self.lr = _host_scalar(group["lr"])
        self.weight_decay = group["weight_decay"]
        momentum = group["momentum"]
        grads = [p.grad for p in params]
        bufs = [opt.state[p]["momentum_buffer"] for p in params]
        self.ns_dtype = group["ns_dtype"] or default_ns_dtype(device, dtype)
        self.scale = lr_scale(group["adjust_lr_fn"], rows, cols)
        self.counts = [matrix_view(p.shape, group["nd_mode"])[0] for p in params]
        self.fused = _fused_cpu_step(params, grads, bufs, self.lr, self.ns_dtype)
        # Tall matrices that Newton–Schulz iterates wide (`iterates_wide`): the fused ops
        # write X as its transpose and read the result back transposed, so no copies.
        self.wide = self.fused and iterates_wide((rows, cols), device, self.ns_dtype)
        if self.fused:
            # The same step with its elementwise passes fused (csrc/cpu/muon_update.cpp).
            self.X = torch.ops.rlx.muon_ns_input(grads, bufs, rows, cols, momentum,
                                                 group["nesterov"], self.eps, schedule.safety,
                                                 self.ns_dtype, self.wide)
        else:
            torch._foreach_lerp_(bufs, grads, 1.0 - momentum)
            self.X = _ns_input(grads, bufs, momentum, group["nesterov"], self.counts, rows, cols)

    def ortho_like(self) -> Tensor:
        """An empty tensor of the shape and dtype `orthogonalize` returns (that of `X`, which
        holds the matrices transposed where `self.wide`)."""
        return torch.empty(self.X.shape, dtype=self.ns_dtype, device=self.X.device)

    def orthogonalize(self, workspace: Workspace | None = None) -> Tensor:
        """The orthogonalized update; with a `workspace`, a tensor in it (CPU), to be applied
        before the workspace's next use."""
        ortho = newton_schulz(self.X, self.schedule, self.eps, self.ns_dtype,
                              normalized=self.fused, workspace=workspace)
        return ortho.contiguous()

    def apply(self, ortho: Tensor) -> None:
        self.X = None  # the NS input is no longer needed
        if self.fused:
            ortho = ortho.mT if self.wide else ortho  # a view that muon_apply_ reads as such
            torch.ops.rlx.muon_apply_(self.params, ortho, self.lr, self.weight_decay, self.scale)
        else:
            _apply_update(self.params, ortho, self.counts, self.lr, self.weight_decay,
                          self.scale)


def _apply_update(params: list[Tensor], ortho: Tensor, counts: list[int], lr, weight_decay: float,
                  scale: float) -> None:
    """p <- (1 - lr*wd) p - lr*scale*O for the params of a batch (O: `ortho`, split by
    `counts`), in the params' dtype, for a float or a device-tensor lr."""
    p0 = params[0]
    delta = torch.empty(ortho.shape, dtype=p0.dtype, device=p0.device)

    def pieces():
        return [d.view(p.shape) for d, p in zip(delta.split(counts), params, strict=True)]

    if isinstance(lr, Tensor):  # device-resident lr: tensor arithmetic, no read-back
        delta.copy_(ortho)
        if weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        delta.mul_(lr * -scale)
        torch._foreach_add_(params, pieces())
    elif weight_decay != 0.0 and lr != 0.0 and _lerp_target_fits(scale / weight_decay, p0.dtype):
        # Decay and update in one pass over the params:
        # (1 - lr*wd) p - lr*scale*O  ==  lerp(p, -(scale/wd) O, lr*wd).
        torch.mul(ortho, -scale / weight_decay, out=delta)
        torch._foreach_lerp_(params, pieces(), lr * weight_decay)
    else:
        if weight_decay != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        delta.copy_(ortho)  # back to the param dtype and the [rows, cols] layout
        torch._foreach_add_(params, pieces(), alpha=-lr * scale)


# |O| entries stay below ~1.5 (singular values of the NS result are at most ~1.2); with this
# margin the lerp target -(scale/wd) O cannot overflow the param dtype.
_ORTHO_BOUND = 4.0


def _lerp_target_fits(ratio: float, dtype: torch.dtype) -> bool:
    """Whether -(scale/wd) O is finite and normal in `dtype` (a tiny or subnormal wd makes the
    ratio overflow: inf in the target would turn the param into inf or NaN)."""
    return math.isfinite(ratio) and abs(ratio) * _ORTHO_BOUND <= torch.finfo(dtype).max


@functools.cache
def _native_ops() -> bool:
    return hasattr(torch.ops.rlx, "muon_ns_input") and hasattr(torch.ops.rlx, "muon_apply_")


def _fused_cpu_step(params, grads, bufs, lr, ns_dtype) -> bool:
    """Whether the fused CPU ops serve this batch: contiguous float32 CPU params, grads and
    buffers, a host lr, NS in float32 or bf16, and the compiled extension loaded."""
    p0 = params[0]
    return (
        p0.device.type == "cpu"
        and p0.dtype == torch.float32
        and not isinstance(lr, Tensor)
        and ns_dtype in (torch.float32, torch.bfloat16)
        and all(t.is_contiguous() for t in params)
        and all(g.is_contiguous() and g.dtype == torch.float32 for g in grads)
        and all(b.is_contiguous() for b in bufs)
        and _native_ops()
    )


def _ns_input(grads, bufs, momentum, nesterov, counts, rows, cols) -> Tensor:
    """The stacked Newton–Schulz input `[sum(counts), rows, cols]`: the Nesterov look-ahead
    (1 - mu) g + mu buf, or the momentum buffers. Always a new tensor, so the NS input never
    aliases a momentum buffer, and p.grad is never written."""
    if grads[0].device.type == "cpu":
        # Written straight into one buffer: on CPU a foreach lerp into new tensors and a cat
        # is several times slower (docs/benchmarks.md, "Figures behind code choices").
        stacked = torch.empty((sum(counts), rows, cols), dtype=grads[0].dtype)
        for piece, g, b in zip(stacked.split(counts), grads, bufs, strict=True):
            if nesterov:
                torch.lerp(g, b, momentum, out=piece.view(g.shape))
            else:
                piece.view(g.shape).copy_(b)
        return stacked
    updates = torch._foreach_lerp(grads, bufs, momentum) if nesterov else bufs
    return torch.cat([u.reshape(-1, rows, cols) for u in updates])


def _chunks(params: list[Tensor], limit: int):
    """Splits same-shape params into runs of at most `limit` elements (>= 1 param each)."""
    chunk, size = [], 0
    for p in params:
        if chunk and size + p.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk
