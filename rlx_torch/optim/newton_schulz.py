"""Batched Newton–Schulz orthogonalization and its coefficient presets.

`newton_schulz` maps a batch of matrices `G[i]` (shape `[N, m, n]`) to approximately
`U_i V_iᵀ` (the orthogonal polar factor of `G_i = U_i S_i V_iᵀ`) with the quintic iteration

    X ← a·X + (b·A + c·A²)·X,    A = X·Xᵀ,

after normalising each matrix by its Frobenius norm (an upper bound of the spectral norm, so
all singular values start in [0, 1]). Every matrix of the batch is independent: one
`bmm`/`baddbmm` per line serves all of them, and a non-finite matrix only spoils itself.

On CPU, float32 and float64 matrices with an aspect ratio of at least 2 run the same
iteration in its Gram form (`_gram_iterations`), which needs far fewer FLOPs (never in 16-bit
dtypes: `uses_gram`). On CPUs with AMX the whole bf16 iteration of wide matrices with sides
that are multiples of 32 runs in `rlx::newton_schulz_amx` (`uses_amx`); on CPUs with
AVX512-BF16 and no AMX the bf16 products with symmetric results go through
`rlx::symmetric_matmul` (`_Products`), which computes only their upper triangle; see
docs/optim.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cpu_features import amx_kernel_pays, symmetric_kernel_pays

__all__ = ["KELLER", "POLAR_EXPRESS", "Workspace", "newton_schulz", "resolve_schedule"]

Triple = tuple[float, float, float]

# Keller Jordan's coefficients: maximise the slope at zero (muon.py, also torch.optim.Muon).
KELLER: Triple = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932), the published 5-step
# schedule computed with num_iters=5, safety_factor=2e-2, cushion=2 (the set modded-nanogpt and
# dion use). Its safety factor 1.02 enlarges the normaliser so that bf16 rounding never pushes
# a singular value above the interval the polynomials were optimised for.
POLAR_EXPRESS: tuple[Triple, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02

PRESETS = {
    "keller": ((KELLER,), 1.0),
    "polar_express": (POLAR_EXPRESS, POLAR_EXPRESS_SAFETY),
}


@dataclass(frozen=True)
class Schedule:
    """The per-step coefficients actually run, and the normaliser's safety factor."""

    coefficients: tuple[Triple, ...]
    safety: float = 1.0


def _as_triple(value, what: str) -> Triple:
    try:
        triple = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        triple = ()
    if len(triple) != 3:
        raise ValueError(f"ns_coefficients: {what} must be 3 numbers (a, b, c), got {value!r}")
    return triple  # type: ignore[return-value]


def resolve_schedule(ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]],
                     ns_steps: int) -> Schedule:
    """Turns the user's `ns_coefficients` into exactly `ns_steps` triples.

    A preset name or a list of per-step triples shorter than `ns_steps` repeats its last triple
    (the final Polar Express polynomial is the one meant to be iterated); a longer list is cut.
    A single `(a, b, c)` is used for every step.

    Example::

        >>> resolve_schedule((3.0, -3.2, 1.2), 2)
        Schedule(coefficients=((3.0, -3.2, 1.2), (3.0, -3.2, 1.2)), safety=1.0)
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in PRESETS:
            raise ValueError(
                f"ns_coefficients: unknown preset {ns_coefficients!r}; "
                f"expected one of {sorted(PRESETS)}, one (a, b, c) or a list of triples"
            )
        steps, safety = PRESETS[ns_coefficients]
    elif isinstance(ns_coefficients, Sequence | torch.Tensor) and len(ns_coefficients) > 0:
        first = ns_coefficients[0]
        if isinstance(first, Sequence | torch.Tensor):
            steps = tuple(_as_triple(t, f"step {i}") for i, t in enumerate(ns_coefficients))
        else:
            steps = (_as_triple(ns_coefficients, "a single triple"),)
        safety = 1.0
    else:
        raise ValueError(
            "ns_coefficients must be a preset name ('keller', 'polar_express'), one (a, b, c) "
            f"or a non-empty list of triples, got {ns_coefficients!r}"
        )
    steps = steps[:ns_steps] + (steps[-1],) * max(0, ns_steps - len(steps))
    return Schedule(steps, safety)


# Gram form only from this aspect ratio on: with 5 steps it costs 8·m²n + 28·m³ FLOPs against
# 20·m²n + 10·m³ for the standard iteration (m <= n), a win from n > 1.5·m; 2 leaves a margin.
GRAM_MIN_ASPECT = 2
# The first phase of the Gram iteration (until its first restart) may grow a small or spuriously
# negative Gram eigenvalue by at most this factor (the product of a² over its updates of R):
# Keller's schedule restarts before step 3 (11.9² = 141), Polar Express before step 2 (66.5).
GRAM_MAX_GROWTH = 256.0
METHODS = ("auto", "standard", "gram")


def gram_restarts(coefficients: Sequence[Triple]) -> tuple[int, ...]:
    """Steps before which the Gram iteration rebuilds X and its Gram matrix from scratch.

    Within a phase the Gram matrix R is only updated (R ← P R P), never recomputed. Rounding
    leaves R slightly indefinite, and each update multiplies an eigenvalue r near zero,
    negative ones included, by about p(r)² ≈ a². The first phase ends before that growth
    passes GRAM_MAX_GROWTH; later phases hold at most one update (two steps): by then most
    singular values are near 1, R's entries and their rounding errors are larger, and two
    updates per later phase were measured to blow up (Keller coefficients, 8 steps, in bf16,
    where rounding errors are large enough to show it; the Gram form now runs only in float32
    and float64).
    """
    restarts: list[int] = []
    growth = 1.0
    for i in range(1, len(coefficients)):
        growth *= coefficients[i - 1][0] ** 2  # the update of R between steps i-1 and i
        if growth > GRAM_MAX_GROWTH or (restarts and i - restarts[-1] >= 2):
            restarts.append(i)
            growth = 1.0
    return tuple(restarts)


def uses_gram(shape: Sequence[int], device: torch.device, method: str = "auto",
              dtype: torch.dtype = torch.float32) -> bool:
    """Whether `newton_schulz` takes the Gram form for matrices of `shape` on `device`.

    Only float32 and float64 iterate in the Gram form. Rounded to a 16-bit dtype, R₀ = X·Xᵀ
    has eigenvalue errors of about 2⁻⁸ (bf16), so singular values below about 0.06 leave no
    trace in it; the Gram iteration then multiplies them by `a` at every step whatever their
    true size (3.4 for Keller), they pass 1, and the following steps blow them up (measured:
    outputs 10⁵ to 10¹⁵ times too large on small matrices with decaying spectra, bf16, with
    either preset). The standard iteration recomputes X·Xᵀ from X at every step and stays
    bounded. `method="gram"` with a 16-bit dtype is refused for the same reason.

    Example::

        >>> cpu = torch.device("cpu")
        >>> uses_gram((64, 256), cpu), uses_gram((64, 256), cpu, dtype=torch.bfloat16)
        (True, False)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    wide_enough = dtype in (torch.float32, torch.float64)
    if method != "auto":
        if method == "gram" and not wide_enough:
            raise ValueError(f"method='gram' needs float32 or float64, got {dtype}: in 16-bit "
                             "dtypes the Gram form blows up small singular values")
        return method == "gram"
    small, large = sorted(shape[-2:])
    # The Gram form is on only where benchmarks show it pays (CPU); CUDA and MPS keep the
    # standard iteration.
    return wide_enough and device.type == "cpu" and large >= GRAM_MIN_ASPECT * small


class Workspace:
    """Buffers that the standard iteration on CPU writes its iterates and m x m products into,
    kept from call to call (one per role, grown to the largest batch seen).

    A fresh tensor of a MiB or more is memory that the allocator may have handed back to the
    system, and touching it again costs a page fault per 4 KiB page: with new tensors for
    every product, Muon's CPU step spent about a third of its time in page faults on a 2-core
    Zen 4 (docs/optim.md, "Buffers kept between steps"). A result returned through a workspace
    lives in it, so it is valid until the next call that is given the same workspace.

    Example::

        >>> ws = Workspace()
        >>> G = torch.randn(2, 8, 16)
        >>> schedule = resolve_schedule("keller", 5)
        >>> X = newton_schulz(G, schedule, 1e-7, torch.float32, workspace=ws)
        >>> bool(torch.equal(X, newton_schulz(G, schedule, 1e-7, torch.float32)))
        True
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of `shape` with `like`'s dtype and device for `role` (its
        contents are left over from an earlier use).

        >>> ws = Workspace()
        >>> a = ws.take("gram", (2, 3, 3), torch.zeros(1))
        >>> b = ws.take("gram", (1, 3, 3), torch.zeros(1))  # smaller: the same memory
        >>> a.shape, a.data_ptr() == b.data_ptr()
        (torch.Size([2, 3, 3]), True)
        """
        numel = math.prod(shape)
        buf = self._buffers.get(role)
        if (buf is None or buf.numel() < numel or buf.dtype != like.dtype
                or buf.device != like.device):
            buf = self._buffers[role] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel].view(shape)


def newton_schulz(
    G: torch.Tensor, schedule: Schedule, eps: float, dtype: torch.dtype, method: str = "auto",
    normalized: bool = False, workspace: Workspace | None = None,
) -> torch.Tensor:
    """Orthogonalizes every matrix of `G` (`[..., m, n]`) in `dtype`; returns a new tensor
    (with a `workspace`, on CPU: a tensor in it, valid until its next use).

    The result never shares memory with `G` (the first operation writes into a fresh buffer),
    so callers may pass a momentum buffer. The Gram matrix is always the small side: `X·Xᵀ`
    for wide matrices, `Xᵀ·X` (and right-multiplication) for tall ones, which avoids
    transposed copies. `method`: "standard", "gram" (`_gram_iterations`) or "auto"
    (`uses_gram`). `normalized=True`: G is already in `dtype` and divided by its norm (and
    the schedule's safety factor), as `rlx::muon_ns_input` returns it; it is iterated on
    directly (never written). `workspace` (`Workspace`): on CPU, the standard iteration's
    intermediates and result go into its buffers instead of new tensors; elsewhere it is not
    used. Makes no host-device synchronisation.

    Example::

        >>> G = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))
        >>> X = newton_schulz(G, resolve_schedule("keller", 5), 1e-7, torch.float32)
        >>> S = torch.linalg.svdvals(X)  # Keller's schedule: singular values near 1
        >>> X.shape, bool((S > 0.5).all() and (S < 1.5).all())
        (torch.Size([3, 4, 6]), True)
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: G must have >= 2 dims, got shape {tuple(G.shape)}")
    batch_shape = G.shape[:-2]
    G = G.reshape(-1, *G.shape[-2:])
    tall = G.size(-2) > G.size(-1)
    if normalized and G.dtype != dtype:
        raise ValueError(f"newton_schulz: a normalized G must be {dtype}, got {G.dtype}")
    X = G if normalized else _normalize(G, schedule.safety, eps, dtype)
    products = _Products.for_batch(G, dtype)
    if G.device.type != "cpu":
        workspace = None  # (the CUDA and MPS allocators keep freed blocks for reuse)
    if tall and iterates_wide(G.shape, G.device, dtype):
        # The contiguous wide form Xᵀ (one copy); the result is transposed back (a view).
        X = _iterate(X.mT.contiguous(), schedule, False, products, method, workspace).mT
    else:
        X = _iterate(X, schedule, tall, products, method, workspace)
    return X.reshape(*batch_shape, *X.shape[-2:])


# Whether tall bf16 CPU batches are iterated in their wide form (module-level so that
# benchmarks and tests can run both).
WIDE_ON_CPU = True


def iterates_wide(shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether tall matrices of `shape` are iterated as their contiguous transposes.

    For bf16 products through `torch.bmm` on CPU (oneDNN; AMX where present): the tall
    form's Gram product Xᵀ·X reads X down its columns, a layout oneDNN's bf16 batched GEMM
    runs at well under its X·Xᵀ rate; on the wide form every product is X·Xᵀ or P·X with X
    row-major. `rlx::symmetric_matmul` reads tall operands in place, and float32 GEMMs (MKL)
    run both layouts alike, so they keep the tall form (no transposed copies).

    >>> iterates_wide((1024, 256), torch.device("cuda"), torch.bfloat16)
    False
    """
    return (WIDE_ON_CPU and device.type == "cpu" and dtype == torch.bfloat16
            and shape[-2] > shape[-1] and not symmetric_kernel_pays())


# Matrices whose largest entry exceeds 2^40 are scaled by 2^-80 (exact: a power of two)
# before their norm is taken, so that the float32 sum of squares cannot overflow (it would
# from entries of about 1.8e19) and 1/norm stays a normal number; orthogonalization is
# scale-invariant, so the result is the same as for the unscaled matrix.
_PRESCALE_ABOVE = 2.0**40
_PRESCALE = 2.0**-80


def _normalize(G: torch.Tensor, safety: float, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """G / max(safety * ||G||_F, eps) per matrix, in `dtype`, in a fresh tensor; the norm in
    float32 (or float64 for float64 G: a bf16 norm of a large matrix loses digits), safe from
    overflow for any finite G. No host-device synchronisation."""
    norm_dtype = torch.promote_types(G.dtype, torch.float32)
    amax = torch.linalg.vector_norm(G, ord=math.inf, dim=(-2, -1), keepdim=True,
                                    dtype=norm_dtype)
    pre = torch.where(amax > _PRESCALE_ABOVE, _PRESCALE, 1.0).to(norm_dtype)
    scaled = G * pre  # a new tensor in norm_dtype
    norm = torch.linalg.vector_norm(scaled, dim=(-2, -1), keepdim=True)
    if safety != 1.0:
        norm = norm * safety
    norm = torch.maximum(norm, pre * eps)  # the clamp at eps, on the unscaled norm
    if G.device.type == "cpu":
        # Divide in place, then one rounding to `dtype`: on CPU `torch.div(..., out=X)` into
        # bf16 takes a slow path.
        return scaled.div_(norm).to(dtype)
    X = torch.empty(G.shape, dtype=dtype, device=G.device)  # one fused pass; `out=` casts
    torch.div(scaled, norm, out=X)
    return X


class _Products:
    """The products of the iteration whose results are symmetric: Gram matrices X·Xᵀ, and
    `sym(a, b, c, alpha, beta)` = beta·c + alpha·a·b for symmetric b with a·b symmetric
    (polynomials in one symmetric matrix commute). On CPUs with AVX512-BF16, bf16 batches
    use `rlx::symmetric_matmul` (a·bᵀ = a·b; only the upper triangle is computed, then
    mirrored: about half the work); elsewhere one bmm/baddbmm each."""

    def __init__(self, native: bool):
        self.native = native

    @staticmethod
    def for_batch(G: torch.Tensor, dtype: torch.dtype) -> _Products:
        return _Products(G.device.type == "cpu" and dtype == torch.bfloat16
                         and symmetric_kernel_pays())

    def sym(self, a, b, c, alpha=1.0, beta=1.0, diag=0.0, out=None):
        """In a new tensor, or into `out` (which shares no memory with a, b, c)."""
        if self.native:
            if out is not None:
                torch.ops.rlx.symmetric_matmul_out(a, b, c, alpha, beta, False, diag, out)
                return out
            return torch.ops.rlx.symmetric_matmul(a, b, c, alpha, beta, False, diag)
        if out is not None:
            out = torch.baddbmm(c, a, b, beta=beta, alpha=alpha, out=out)
        else:
            out = torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
        if diag != 0.0:
            out.diagonal(dim1=-2, dim2=-1).add_(diag)
        return out

    def gram(self, X: torch.Tensor, tall: bool, out=None) -> torch.Tensor:
        """The small-side Gram matrices of the batch X: Xᵀ·X when tall, X·Xᵀ otherwise (in a
        new tensor, or into `out`)."""
        if self.native:
            if out is not None:
                torch.ops.rlx.symmetric_matmul_out(X, X, None, 1.0, 0.0, tall, 0.0, out)
                return out
            return torch.ops.rlx.symmetric_matmul(X, X, None, 1.0, 0.0, tall)
        lhs, rhs = (X.mT, X) if tall else (X, X.mT)
        return torch.bmm(lhs, rhs, out=out) if out is not None else torch.bmm(lhs, rhs)


# The AMX op runs each matrix on one core with its working set (about 4·m·n + 6·m² bytes) in
# that core's L2; up to 2^18 elements (256 x 1024, 512 x 512) it beat oneDNN's bmm on the
# Xeon with AMX (1.2-2.5x), from 2^20 on it lost (0.33-0.75x; docs/optim.md).
AMX_MAX_ELEMENTS = 1 << 18


def uses_amx(shape: Sequence[int], device: torch.device, dtype: torch.dtype,
             method: str = "auto") -> bool:
    """Whether the standard bf16 iteration of matrices of `shape` (as iterated: wide) runs in
    `rlx::newton_schulz_amx`: on CPUs with AMX (`amx_kernel_pays`), for m <= n, both
    multiples of 32, at most AMX_MAX_ELEMENTS per matrix.

    >>> uses_amx((256, 1024), torch.device("cuda"), torch.bfloat16)
    False
    """
    m, n = shape[-2:]
    return (device.type == "cpu" and dtype == torch.bfloat16 and method != "gram"
            and 0 < m <= n and m % 32 == 0 and n % 32 == 0 and m * n <= AMX_MAX_ELEMENTS
            and amx_kernel_pays())


def _iterate(X, schedule, tall, products, method, workspace=None):
    if not tall and uses_amx(X.shape, X.device, X.dtype, method):
        coefficients = [v for step in schedule.coefficients for v in step]
        return torch.ops.rlx.newton_schulz_amx(X.contiguous(), coefficients)
    if uses_gram(X.shape, X.device, method, X.dtype):
        return _gram_iterations(X, schedule, tall, products)
    small = X.size(-1) if tall else X.size(-2)
    square = (X.size(0), small, small)

    def take(role, shape):
        return workspace.take(role, shape, X) if workspace is not None else None

    for i, (a, b, c) in enumerate(schedule.coefficients):
        A = products.gram(X, tall, out=take("gram", square))
        # B is a polynomial in the symmetric A, so X·B == (B·Xᵀ)ᵀ for the tall case.
        if products.native or X.device.type == "cpu":
            # a·X + B·X as (a·I + B)·X: a plain bmm, where baddbmm on CPU first copies X into
            # its result, a sizeable part of the product (docs/benchmarks.md, "Figures behind
            # code choices"; with oneDNN's bf16 bmm on AMX too).
            P = products.sym(A, A, A, alpha=c, beta=b, diag=a, out=take("poly", square))
            # (the iterates alternate between two buffers: a product never writes its input)
            X_next = take(f"iterate{i % 2}", X.shape)
            lhs, rhs = (X, P) if tall else (P, X)
            X = torch.bmm(lhs, rhs, out=X_next) if X_next is not None else torch.bmm(lhs, rhs)
        else:
            B = products.sym(A, A, A, alpha=c, beta=b)  # b·A + c·A²
            X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X


def _gram_iterations(X: torch.Tensor, schedule: Schedule, tall: bool,
                     products: _Products) -> torch.Tensor:
    """The Newton–Schulz iteration for `X` (`[N, m, n]`) run on its small-side Gram matrices.

    For wide X, every iterate is X_k = Q_k·X_0 with Q_k a polynomial in R_0 = X_0·X_0ᵀ, so
    with P = a·I + b·R + c·R² (all polynomials in R_0 commute):
        Q ← Q·P,    R ← P·R·P  (= X_k+1·X_k+1ᵀ),
    and only R_0 and the final Q·X_0 touch the wide matrix (Dao, Zhang, Amsel, Chen 2026,
    "Gram Newton-Schulz"). Tall X mirrors it: R_0 = X_0ᵀ·X_0 and X_k = X_0·Q_k (no transposed
    copies of X). Because R is updated rather than recomputed, rounding can make it
    indefinite, and the iteration blows a negative eigenvalue up geometrically (measured in
    bf16: outputs 10-10⁴ times too large). Restarts (`gram_restarts`) rebuild X and R from
    scratch, which keeps the error at the standard iteration's level in float32 and float64
    (tests/test_newton_schulz.py); 16-bit dtypes never come here (`uses_gram`).
    Every m x m product has a symmetric result (commuting symmetric factors).
    """

    def apply(Q, X):
        return torch.bmm(X, Q) if tall else torch.bmm(Q, X)

    restarts = gram_restarts(schedule.coefficients)
    last = len(schedule.coefficients) - 1
    R = products.gram(X, tall)
    Q = None  # None stands for the identity
    for i, (a, b, c) in enumerate(schedule.coefficients):
        if i in restarts:
            X = apply(Q, X)
            R = products.gram(X, tall)
            Q = None
        Z = products.sym(R, R, R, alpha=c, beta=b)  # P - a·I
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)  # Q = P
        else:
            Q = products.sym(Q, Z, Q, beta=a)  # Q·P
        if i < last and i + 1 not in restarts:
            RP = products.sym(R, Z, R, beta=a)  # R·P
            R = products.sym(Z, RP, RP, beta=a)  # P·R·P
    return apply(Q, X)
