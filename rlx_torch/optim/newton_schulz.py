"""Batched Newton–Schulz orthogonalization and its coefficient presets.

`newton_schulz` maps a batch of matrices `G[i]` (shape `[N, m, n]`) to approximately
`U_i V_iᵀ` (the orthogonal polar factor of `G_i = U_i S_i V_iᵀ`) with the quintic iteration

    X ← a·X + (b·A + c·A²)·X,    A = X·Xᵀ,

after normalising each matrix by its Frobenius norm (an upper bound of the spectral norm, so
all singular values start in [0, 1]). Every matrix of the batch is independent: one
`bmm`/`baddbmm` per line serves all of them, and a non-finite matrix only spoils itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def resolve_schedule(ns_coefficients, ns_steps: int) -> Schedule:
    """Turns the user's `ns_coefficients` into exactly `ns_steps` triples.

    A preset name or a list of per-step triples shorter than `ns_steps` repeats its last triple
    (the final Polar Express polynomial is the one meant to be iterated); a longer list is cut.
    A single `(a, b, c)` is used for every step.
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


def newton_schulz(
    G: torch.Tensor, schedule: Schedule, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Orthogonalizes every matrix of `G` (`[..., m, n]`) in `dtype`; returns a new tensor.

    The result never shares memory with `G` (the first operation writes into a fresh buffer),
    so callers may pass a momentum buffer. The Gram matrix is always the small side: `X·Xᵀ`
    for wide matrices, `Xᵀ·X` (and right-multiplication) for tall ones, which avoids
    transposed copies. Makes no host-device synchronisation.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz: G must have >= 2 dims, got shape {tuple(G.shape)}")
    batch_shape = G.shape[:-2]
    G = G.reshape(-1, *G.shape[-2:])
    tall = G.size(-2) > G.size(-1)
    # Normalise with the norm taken in float32 (a bf16 norm of a large matrix loses digits);
    # writing the quotient through `out=` casts to `dtype` without another pass.
    norm_dtype = torch.promote_types(G.dtype, torch.float32)
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    if schedule.safety != 1.0:
        norm = norm * schedule.safety
    X = torch.empty(G.shape, dtype=dtype, device=G.device)
    torch.div(G, norm.clamp_min_(eps), out=X)
    for a, b, c in schedule.coefficients:
        # B is a polynomial in the symmetric A, so X·B == (B·Xᵀ)ᵀ for the tall case.
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, X, B, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X.reshape(*batch_shape, *X.shape[-2:])
