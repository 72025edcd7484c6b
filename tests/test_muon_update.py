"""rlx::muon_ns_input and rlx::muon_apply_ (rlx_torch/ops/muon_update.py, the fused CPU parts
of a Muon step) against their formulas, opcheck, and their input checks. The optimizer's use of
them: tests/test_muon.py."""

import pytest
import torch

import rlx_torch  # noqa: F401  (registers the ops)


def test_fused_ops_opcheck_and_reference():
    g = [torch.randn(6, 10), torch.randn(2, 6, 10)]
    b = [torch.randn(6, 10), torch.randn(2, 6, 10)]
    b_ref = [t.clone() for t in b]
    X = torch.ops.rlx.muon_ns_input(g, b, 6, 10, 0.9, True, 1e-7, 1.02, torch.float32)
    for t, gt in zip(b_ref, g, strict=True):
        t.lerp_(gt, 0.1)
    torch.testing.assert_close(b, b_ref)
    u = torch.cat([gt.lerp(bt, 0.9).reshape(-1, 6, 10) for gt, bt in zip(g, b_ref, strict=True)])
    expected = u / (1.02 * u.norm(dim=(-2, -1), keepdim=True))
    torch.testing.assert_close(X, expected)
    p = [torch.randn(6, 10), torch.randn(2, 6, 10)]
    p_ref = [t.clone() for t in p]
    torch.ops.rlx.muon_apply_(p, X, 0.1, 0.5, 2.0)
    torch.testing.assert_close(p[0], p_ref[0] * 0.95 - 0.2 * X[0])
    torch.testing.assert_close(p[1], p_ref[1] * 0.95 - 0.2 * X[1:])
    torch.library.opcheck(torch.ops.rlx.muon_ns_input.default,
                          ([t.clone() for t in g], [t.clone() for t in b], 6, 10, 0.9, False,
                           1e-7, 1.0, torch.bfloat16))
    torch.library.opcheck(torch.ops.rlx.muon_apply_.default,
                          ([t.clone() for t in p], X.bfloat16(), 0.1, 0.5, 2.0))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: torch.ops.rlx.muon_ns_input([torch.randn(6, 10)], [torch.randn(6, 9)], 6, 10,
                                             0.9, True, 1e-7, 1.0, torch.float32),
         "bufs\\[0\\] must have shape"),
        (lambda: torch.ops.rlx.muon_ns_input([torch.randn(6, 10).double()],
                                             [torch.randn(6, 10)], 6, 10, 0.9, True, 1e-7, 1.0,
                                             torch.float32),
         "grads\\[0\\] must be a contiguous float32"),
        (lambda: torch.ops.rlx.muon_ns_input([torch.randn(6, 10)], [torch.randn(6, 10)], 4, 4,
                                             0.9, True, 1e-7, 1.0, torch.float32),
         "not a whole number"),
        (lambda: torch.ops.rlx.muon_ns_input([torch.randn(6, 10)], [torch.randn(6, 10)], 6, 10,
                                             0.9, True, 1e-7, 1.0, torch.float16),
         "dtype must be float32 or bfloat16"),
        (lambda: torch.ops.rlx.muon_apply_([torch.randn(6, 10)], torch.randn(2, 6, 10), 0.1,
                                           0.0, 1.0),
         "params hold 1 matrices but ortho has 2"),
    ],
)
def test_fused_ops_reject_bad_input(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()
