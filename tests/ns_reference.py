"""Plain per-matrix Newton–Schulz in float64: the oracle of tests/test_newton_schulz.py and
tests/test_muon.py."""

KELLER = (3.4445, -4.7750, 2.0315)


def reference_ns(G, coefficients, eps=1e-7, safety=1.0):
    """Plain per-matrix Newton–Schulz in float64 (the test oracle)."""
    X = G.double()
    if X.shape[0] > X.shape[1]:
        return reference_ns(G.mT, coefficients, eps, safety).mT
    X = X / max(X.norm().item() * safety, eps)
    for a, b, c in coefficients:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X
