"""The gated delta rule on a real Apple GPU (device="mps") against the CPU op: forward and
backward over the emulator tests' shapes, the autograd entry point, opcheck, and errors.
Skipped where MPS is unavailable (Linux, and GitHub's hosted macOS runners, whose MPS device
is unusable: set RLX_SKIP_MPS=1 there)."""

import os

import pytest
import torch

import rlx_torch
from rlx_torch.ops.gated_delta import unpack_gradients
from tests.test_metal_gated_delta import BACKWARD_CASES, FORWARD_CASES, TOL, Problem

pytestmark = pytest.mark.skipif(
    not torch.backends.mps.is_available() or os.environ.get("RLX_SKIP_MPS") == "1",
    reason="needs an Apple GPU (torch.backends.mps.is_available())",
)


def to_mps(t):
    return None if t is None else t.to("mps")


def run_forward(p, device):
    d = (lambda t: t) if device == "cpu" else to_mps
    o, final, ckpt, _ = torch.ops.rlx.gated_delta_fwd(d(p.q), d(p.k), d(p.v), d(p.g),
                                                      d(p.beta), p.scale, d(p.h0), d(p.cu),
                                                      p.chunk)
    return o.cpu(), final.cpu(), ckpt.cpu()


def assert_close(a, e, tol, what):
    a, e = a.double(), e.double()
    err = (a - e).abs().max().item() if a.numel() else 0.0
    bound = tol * max(1.0, e.abs().max().item() if e.numel() else 0.0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def written_slots(p):
    from tests.test_metal_gated_delta import written_slots as slots

    return slots(p)


ALL_CASES = {**{f"fwd_{k}": v for k, v in FORWARD_CASES.items()},
             **{f"bwd_{k}": v for k, v in BACKWARD_CASES.items()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_forward_matches_cpu(case, dtype):
    p = Problem(**ALL_CASES[case], dtype=dtype, seed=7)
    o, final, ckpt = run_forward(p, "mps")
    o_ref, final_ref, ckpt_ref = run_forward(p, "cpu")
    assert_close(o, o_ref, TOL[dtype], "o")
    assert_close(final, final_ref, 1e-4, "final_state")
    slots = written_slots(p)
    assert_close(ckpt[slots], ckpt_ref[slots], 1e-4, "checkpoints")
    unused = sorted(set(range(ckpt.shape[0])) - set(slots))
    # Zero but for the tag in the last slot's first 4 bytes, which is the CPU forward's.
    if ckpt.shape[0]:
        assert ckpt.shape[0] - 1 in unused
        tag, tag_ref = (c[-1].reshape(-1)[:1].view(torch.int32) for c in (ckpt, ckpt_ref))
        assert tag.item() != 0 and torch.equal(tag, tag_ref), (tag, tag_ref)
        ckpt[-1].view(-1)[0] = 0
    assert torch.equal(ckpt[unused], torch.zeros_like(ckpt[unused])), "unused slots not zero"


def test_backward_rejects_checkpoints_of_another_forward():
    """As on the CPU: chunk_size 10 and 11 at T = 20 give the same slot count, and checkpoints
    of the other one (or of no forward) would give wrong gradients: they raise instead.
    Checkpoints carry the CPU op's tag, so they pass between the CPU and MPS ops."""
    p = Problem(B=1, T=20, H=1, HV=2, K=8, V=4, initial_state=True, chunk=10, seed=9)
    args = [to_mps(t) for t in (p.q, p.k, p.v, p.g, p.beta)]
    h0 = to_mps(p.h0)
    _, final, ckpt10, _ = torch.ops.rlx.gated_delta_fwd(*args, p.scale, h0, None, 10)
    _, _, ckpt11, _ = torch.ops.rlx.gated_delta_fwd(*args, p.scale, h0, None, 11)
    assert ckpt10.shape == ckpt11.shape
    grad_o, grad_h = torch.randn_like(args[2]), torch.randn_like(final)
    good = torch.ops.rlx.gated_delta_bwd(*args, p.scale, h0, None, ckpt10, grad_o, grad_h, 10)
    for ckpt, chunk in ((ckpt10, 11), (ckpt11, 10), (torch.zeros_like(ckpt10), 10)):
        with pytest.raises(RuntimeError, match="checkpoints do not come from"):
            torch.ops.rlx.gated_delta_bwd(*args, p.scale, h0, None, ckpt, grad_o, grad_h, chunk)
    # MPS checkpoints in the CPU backward (no vw: recomputed), and the other way round
    cpu_args = (p.q, p.k, p.v, p.g, p.beta, p.scale, p.h0, None)
    ref = torch.ops.rlx.gated_delta_bwd(*cpu_args, ckpt10.cpu(), grad_o.cpu(), grad_h.cpu(), 10)
    assert_close(good.cpu(), ref, 2e-4, "packed gradients")
    _, _, ckpt_cpu, _ = torch.ops.rlx.gated_delta_fwd(*cpu_args, 10)
    back = torch.ops.rlx.gated_delta_bwd(*args, p.scale, h0, None, ckpt_cpu.to("mps"), grad_o,
                                         grad_h, 10)
    assert_close(back.cpu(), ref, 2e-4, "packed gradients")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("grad_final", [True, False])
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_backward_matches_cpu(case, grad_final, dtype):
    p = Problem(**ALL_CASES[case], dtype=dtype, seed=8)
    _, final_ref, ckpt = run_forward(p, "cpu")
    grad_o = torch.randn(p.v.shape).to(dtype)
    gfin = torch.randn(final_ref.shape) if grad_final else None
    packed = torch.ops.rlx.gated_delta_bwd(
        to_mps(p.q), to_mps(p.k), to_mps(p.v), to_mps(p.g), to_mps(p.beta), p.scale,
        to_mps(p.h0), to_mps(p.cu), to_mps(ckpt), to_mps(grad_o), to_mps(gfin), p.chunk).cpu()
    ref = p.cpu_backward(ckpt, grad_o, gfin)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
    for name, a, e in zip(names, unpack_gradients(packed, p.q, p.v, p.g, p.h0, p.cu),
                          unpack_gradients(ref, p.q, p.v, p.g, p.h0, p.cu), strict=True):
        if e is not None:
            assert_close(a, e, 2e-4, name)


def test_autograd_entry_point_on_mps():
    p = Problem(B=2, T=37, H=2, HV=4, K=48, V=40, initial_state=True, chunk=16, seed=3)
    leaves = {}

    def run(device):
        ts = [t.to(device).requires_grad_() for t in (p.q, p.k, p.v, p.g, p.beta, p.h0)]
        leaves[device] = ts
        o, ht = rlx_torch.ops.gated_delta.gated_delta_rule(
            *ts[:5], initial_state=ts[5], output_final_state=True, use_qk_l2norm=True,
            chunk_size=p.chunk)
        (o.square().sum() + ht.sin().sum()).backward()
        return o.detach().cpu(), ht.detach().cpu()

    o_cpu, ht_cpu = run("cpu")
    o_mps, ht_mps = run("mps")
    assert_close(o_mps, o_cpu, 1e-4, "o")
    assert_close(ht_mps, ht_cpu, 1e-4, "final_state")
    for a, e in zip(leaves["mps"], leaves["cpu"], strict=True):
        assert_close(a.grad.cpu(), e.grad, 5e-4, "grad")


def test_non_contiguous_inputs_and_cpu_cu_seqlens():
    p = Problem(B=1, T=21, H=1, HV=2, K=30, V=12, cu_seqlens=[0, 9, 21], chunk=8, seed=4)
    q = p.q.to("mps").transpose(2, 3).contiguous().transpose(2, 3)  # strided view
    v = torch.cat([p.v, p.v], dim=-1).to("mps")[..., ::2]  # every other channel: a view
    v_cpu = torch.cat([p.v, p.v], dim=-1)[..., ::2]
    o, final, _, _ = torch.ops.rlx.gated_delta_fwd(q, p.k.to("mps"), v, p.g.to("mps"),
                                                   p.beta.to("mps"), p.scale, None, p.cu,
                                                   p.chunk)
    o_ref, final_ref, _, _ = torch.ops.rlx.gated_delta_fwd(p.q, p.k, v_cpu, p.g, p.beta,
                                                           p.scale, None, p.cu, p.chunk)
    assert_close(o.cpu(), o_ref, 1e-4, "o")
    assert_close(final.cpu(), final_ref, 1e-4, "final_state")


def test_opcheck():
    p = Problem(B=1, T=9, H=1, HV=2, K=16, V=8, initial_state=True, chunk=4, seed=5)
    args = [to_mps(t) for t in (p.q, p.k, p.v, p.g, p.beta)]
    torch.library.opcheck(torch.ops.rlx.gated_delta_fwd.default,
                          (*args, p.scale, to_mps(p.h0), None, p.chunk))
    _, final, ckpt, _ = torch.ops.rlx.gated_delta_fwd(*args, p.scale, to_mps(p.h0), None, p.chunk)
    torch.library.opcheck(torch.ops.rlx.gated_delta_bwd.default,
                          (*args, p.scale, to_mps(p.h0), None, ckpt, torch.randn_like(args[2]),
                           torch.randn_like(final), p.chunk))


def test_bad_inputs_raise_errors_naming_the_argument():
    q = torch.randn(1, 4, 1, 8, device="mps")
    g16 = torch.zeros(1, 4, 1, device="mps", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="g and beta must be"):
        torch.ops.rlx.gated_delta_fwd(q, q, q, g16, g16, 1.0, None, None, 64)
    g = torch.zeros(1, 4, 1, device="mps")
    for eps in (-1.0, float("nan")):
        with pytest.raises(RuntimeError, match="l2norm_eps must be None or a finite number"):
            torch.ops.rlx.gated_delta_fwd(q, q, q, g, g, 1.0, None, None, 64, eps)
    o, final, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, q, q, g, g, 1.0, None, None, 64)
    with pytest.raises(RuntimeError, match="l2norm_eps must be None or a finite number"):
        torch.ops.rlx.gated_delta_bwd(q, q, q, g, g, 1.0, None, None, ckpt, o, None, 64, -1.0)
    with pytest.raises(RuntimeError, match="checkpoints must be"):
        torch.ops.rlx.gated_delta_bwd(q, q, q, g, g, 1.0, None, None, ckpt[:0], o, None, 64)
    with pytest.raises(RuntimeError, match="all inputs must be on q's device mps"):
        torch.ops.rlx.gated_delta_bwd(q, q, q, g, g, 1.0, None, None, ckpt.cpu(), o, None, 64)
    assert vw.shape == q.shape  # as on the CPU: chunk_size > 0, one gate per head
    with pytest.raises(RuntimeError, match="vw must be the Float"):
        torch.ops.rlx.gated_delta_bwd(q, q, q, g, g, 1.0, None, None, ckpt, o, None, 64, None,
                                      vw[:, :2])


def _backward_args(device, chunk=4):
    p = Problem(B=1, T=9, H=1, HV=2, K=16, V=8, initial_state=True, chunk=chunk, seed=6)
    d = (lambda t: t) if device == "cpu" else to_mps
    ins = [d(t) for t in (p.q, p.k, p.v, p.g, p.beta)]
    o, final, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*ins, p.scale, d(p.h0), None, chunk)
    return p, ins, o, final, ckpt, vw


# (what is wrong, the backward's arguments after the forward's, the message)
MALFORMED_BACKWARD = [
    ("checkpoints", lambda c, o, f, vw: (c[:-1], o, f, vw), "checkpoints must be the Float"),
    ("checkpoints dtype", lambda c, o, f, vw: (c.half(), o, f, vw),
     "checkpoints must be the Float"),
    ("grad_o", lambda c, o, f, vw: (c, o[:, :3], f, vw), "grad_o must have o's shape"),
    ("grad_o dtype", lambda c, o, f, vw: (c, o.half(), f, vw), "grad_o must have o's shape"),
    ("grad_final_state", lambda c, o, f, vw: (c, o, f[..., :2], vw),
     "grad_final_state must be Float"),
    ("vw", lambda c, o, f, vw: (c, o, f, vw[:, :4]), "vw must be the Float"),
]


@pytest.mark.parametrize("what,change,message", MALFORMED_BACKWARD,
                         ids=[m[0] for m in MALFORMED_BACKWARD])
def test_malformed_backward_inputs_get_the_shared_messages(what, change, message):
    """The MPS backward checks its inputs with the checks every backend shares
    (rlx/gdn_checks.h): the CPU op rejects the same input with the same message."""
    errors = {}
    for device in ("cpu", "mps"):
        p, ins, o, final, ckpt, vw = _backward_args(device)
        d = (lambda t: t) if device == "cpu" else to_mps
        args = change(ckpt, torch.randn_like(o), torch.randn_like(final), vw)
        with pytest.raises(RuntimeError, match=message) as e:
            torch.ops.rlx.gated_delta_bwd(*ins, p.scale, d(p.h0), None, *args[:3], p.chunk,
                                          None, args[3])
        errors[device] = str(e.value).splitlines()[0].replace("mps:0", "DEV").replace(
            "cpu", "DEV").replace("mps", "DEV")
    assert errors["cpu"] == errors["mps"], errors


@pytest.mark.parametrize("per_channel", [False, True])
def test_vw_is_the_cpu_forwards(per_channel):
    """The forward's outputs have the same shapes on every backend: vw is v - P^T k per
    token when chunk_size > 0 and the gate is per head, else empty."""
    p = Problem(B=2, T=11, H=1, HV=2, K=20, V=9, per_channel=per_channel, initial_state=True,
                chunk=4, seed=2)
    ins = (p.q, p.k, p.v, p.g, p.beta)
    for chunk in (4, 0):
        want = torch.ops.rlx.gated_delta_fwd(*ins, p.scale, p.h0, None, chunk)
        got = torch.ops.rlx.gated_delta_fwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0),
                                            None, chunk)
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape and a.dtype == e.dtype and a.device.type == "mps"
        assert want[3].numel() == (p.v.numel() if chunk > 0 and not per_channel else 0)
        assert_close(got[3].cpu(), want[3], 1e-5, "vw")
    # the CPU backward takes the MPS forward's vw (and checks it against its checkpoints)
    _, _, ckpt, vw = got = torch.ops.rlx.gated_delta_fwd(*[to_mps(t) for t in ins], p.scale,
                                                         to_mps(p.h0), None, 4)
    grad_o, grad_h = torch.randn(p.v.shape), torch.randn(got[1].shape)
    ref = torch.ops.rlx.gated_delta_bwd(*ins, p.scale, p.h0, None, ckpt.cpu(), grad_o, grad_h,
                                        4, None, vw.cpu())
    back = torch.ops.rlx.gated_delta_bwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0), None,
                                         ckpt, grad_o.to("mps"), grad_h.to("mps"), 4, None, vw)
    assert_close(back.cpu(), ref, 2e-4, "packed gradients")


L2NORM_CASES = {
    "basic": dict(B=2, T=9, H=1, HV=1, K=16, V=8, chunk=4),
    "gva_varlen_state": dict(B=1, T=13, H=2, HV=4, K=37, V=9, cu_seqlens=[0, 6, 6, 13],
                             initial_state=True, chunk=4),
    "per_channel_vblocks": dict(B=1, T=7, H=1, HV=2, K=70, V=21, per_channel=True, chunk=3,
                                initial_state=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(L2NORM_CASES))
def test_l2norm_eps_matches_cpu(case, dtype):
    """l2norm_eps means on MPS what it means on the CPU: the kernels normalize the raw q and
    k rows (x / sqrt(sum x^2 + eps), in float), and the backward returns the raw rows'
    gradients. Raw (unnormalized, scaled) q and k, and a large eps, so that it matters."""
    p = Problem(**L2NORM_CASES[case], dtype=dtype, seed=11)
    gen = torch.Generator().manual_seed(3)
    q = (torch.randn(p.q.shape, generator=gen) * 0.7).to(dtype)
    k = (torch.randn(p.k.shape, generator=gen) * 0.7).to(dtype)
    eps = 0.25
    ins = (q, k, p.v, p.g, p.beta)
    want = torch.ops.rlx.gated_delta_fwd(*ins, p.scale, p.h0, p.cu, p.chunk, eps)
    got = torch.ops.rlx.gated_delta_fwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0),
                                        to_mps(p.cu), p.chunk, eps)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for name, a, e in zip(("o", "final_state", "checkpoints", "vw"), got, want, strict=True):
        assert a.shape == e.shape, name
        if name == "checkpoints":
            a, e = a[written_slots(p)], e[written_slots(p)]
        assert_close(a.cpu(), e, tol if name == "o" else 1e-4, name)
    grad_o = torch.randn(p.v.shape, generator=gen).to(dtype)
    grad_h = torch.randn(want[1].shape, generator=gen)
    ref = torch.ops.rlx.gated_delta_bwd(*ins, p.scale, p.h0, p.cu, want[2], grad_o, grad_h,
                                        p.chunk, eps, want[3])
    packed = torch.ops.rlx.gated_delta_bwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0),
                                           to_mps(p.cu), got[2], grad_o.to("mps"),
                                           grad_h.to("mps"), p.chunk, eps, got[3]).cpu()
    names = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
    for name, a, e in zip(names, unpack_gradients(packed, q, p.v, p.g, p.h0, p.cu),
                          unpack_gradients(ref, q, p.v, p.g, p.h0, p.cu), strict=True):
        if e is not None:
            assert_close(a, e, 5e-4, name)
    # the tag holds l2norm_eps: checkpoints of a forward without it are rejected
    plain = torch.ops.rlx.gated_delta_fwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0),
                                          to_mps(p.cu), p.chunk)
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*[to_mps(t) for t in ins], p.scale, to_mps(p.h0),
                                      to_mps(p.cu), plain[2], grad_o.to("mps"), None, p.chunk,
                                      eps)


def test_l2norm_eps_gradient_matches_float64_reference():
    """The MPS gradients with l2norm_eps against autograd through the float64 reference of
    the math (l2norm, then the recurrence)."""
    from rlx_torch.ops import reference

    p = Problem(B=1, T=10, H=1, HV=2, K=24, V=6, initial_state=True, chunk=4, seed=12)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(p.q.shape, generator=gen) for _ in range(2))
    eps = 0.5
    leaves = [t.double().requires_grad_() for t in (q, k, p.v, p.g, p.beta, p.h0)]

    def norm(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)

    o, ht = reference.gated_delta_rule(norm(leaves[0]), norm(leaves[1]), *leaves[2:5],
                                       p.scale, leaves[5], True, None)
    grad_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    grad_h = torch.randn(ht.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((o * grad_o).sum() + (ht * grad_h).sum(), leaves)
    ins = [to_mps(t) for t in (q, k, p.v, p.g, p.beta)]
    o_mps, _, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*ins, p.scale, to_mps(p.h0), None, 4, eps)
    assert_close(o_mps.cpu(), o.detach(), 1e-4, "o")
    packed = torch.ops.rlx.gated_delta_bwd(*ins, p.scale, to_mps(p.h0), None, ckpt,
                                           grad_o.float().to("mps"), grad_h.float().to("mps"),
                                           4, eps, vw).cpu()
    names = ("dq", "dk", "dv", "dg", "dbeta", "dstate")
    for name, a, e in zip(names, unpack_gradients(packed, q, p.v, p.g, p.h0, None), want,
                          strict=True):
        assert_close(a, e, 5e-4, name)
