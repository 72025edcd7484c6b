"""The gated delta ops' contract beyond their numbers: devices, the fakes against the real
kernels (every output's shape, stride and dtype; the same errors), the errors that name the
argument, the backward's checks of the forward's checkpoints and vw, its scratch, and
dynamic-shape compilation of the op."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import rlx_torch
from rlx_torch.ops.gated_delta import _bwd_layout, _checkpoint_slots, unpack_gradients

VARIANTS = {  # name: (B, T, H, HV, K, V, per_channel, state, cu_seqlens, l2norm_eps)
    "head": (2, 9, 2, 2, 4, 3, False, False, None, None),
    "channel": (2, 9, 2, 2, 4, 3, True, False, None, None),
    "gva_state": (2, 7, 1, 3, 5, 6, False, True, None, None),
    "packed_channel_state": (1, 12, 2, 2, 3, 3, True, True, [0, 5, 12], None),
    "packed_head": (1, 12, 2, 4, 3, 5, False, False, [0, 5, 5, 12], 1e-6),
    # the Gated DeltaNet layer's shapes in test_layers_gated_deltanet's packed compile test
    "packed_channel_l2": (1, 12, 2, 2, 3, 3, True, False, [0, 5, 12], 1e-6),
    "packed_channel_gva": (1, 13, 1, 3, 2, 4, True, True, [0, 1, 13], None),
    "empty_batch": (0, 5, 2, 2, 4, 3, False, True, None, None),
    "empty_time": (2, 0, 2, 2, 4, 3, True, False, None, None),
}


def make(B, T, H, HV, K, V, per_channel, state, cu, dtype=torch.float32, device="cpu"):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, HV, *((K,) if per_channel else ()), generator=gen).to(acc)
    beta = torch.rand(B, T, HV, generator=gen).to(acc)
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, HV, K, V, generator=gen).to(acc) if state else None
    cu = None if cu is None else torch.tensor(cu)
    return [t.to(device) if t is not None else None for t in (q, k, v, g, beta, h0, cu)]


def layout_of(t):
    return tuple(t.shape), t.stride(), t.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_fakes_match_real_outputs(name, dtype):
    """Shape, stride and dtype of every real output equal its fake's (a compiled backward
    sizes its buffers from the fakes), for the forward with and without checkpoints and for
    the packed backward and its split into gradients."""
    B, T, H, HV, K, V, per_channel, state, cu, eps = VARIANTS[name]
    q, k, v, g, beta, h0, cu_t = make(B, T, H, HV, K, V, per_channel, state, cu, dtype)
    for chunk in (0, 4, 64):
        args = (q, k, v, g, beta, 0.5, h0, cu_t, chunk, eps)
        real = torch.ops.rlx.gated_delta_fwd(*args)
        with FakeTensorMode() as mode:
            fake = torch.ops.rlx.gated_delta_fwd(*(mode.from_tensor(a) if isinstance(
                a, torch.Tensor) else a for a in args))
        assert [layout_of(t) for t in real] == [layout_of(t) for t in fake], chunk
        if chunk == 0:
            continue
        _, ht, ckpt, vw = real
        go = torch.randn_like(real[0])
        gh = torch.randn_like(ht)
        bargs = (q, k, v, g, beta, 0.5, h0, cu_t, ckpt, go, gh, chunk, eps, vw)
        packed = torch.ops.rlx.gated_delta_bwd(*bargs)
        with FakeTensorMode() as mode:
            fpacked = torch.ops.rlx.gated_delta_bwd(*(mode.from_tensor(a) if isinstance(
                a, torch.Tensor) else a for a in bargs))
        assert layout_of(packed) == layout_of(fpacked)
        # The split the Python backward makes of the packed buffer: the compiled backward
        # sizes each gradient from the fake's split (dq, dk, dv, per-head or per-channel dg,
        # dbeta, dh0), so every view must match the real one.
        with FakeTensorMode() as mode:
            fq, fv, fg, fh0, fcu = (mode.from_tensor(t) if t is not None else None
                                    for t in (q, v, g, h0, cu_t))
            fviews = unpack_gradients(mode.from_tensor(packed), fq, fv, fg, fh0, fcu)
            fviews = [layout_of(t) if t is not None else None for t in fviews]
        views = unpack_gradients(packed, q, v, g, h0, cu_t)
        assert [layout_of(t) if t is not None else None for t in views] == fviews
        for view, like in zip(views, (q, q, v, g, beta, h0), strict=True):
            if like is None:
                assert view is None
            else:  # contiguous, the input's shape, in the accumulation dtype
                assert layout_of(view) == layout_of(like.to(packed.dtype).contiguous())
            if view is not None:
                assert view.storage_offset() + view.numel() <= packed.numel()
        N = B if cu is None else len(cu) - 1
        assert packed.numel() == _bwd_layout(B, T, H, HV, K, V, N, per_channel, state)["total"]
        # Through autograd: every gradient has its input's shape and dtype (dbeta, a
        # per-channel dg and the packed sequences' dstate included).
        leaves = [t.detach().clone().requires_grad_() if t is not None else None
                  for t in (q, k, v, g, beta, h0)]
        o, ht2 = rlx_torch.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            output_final_state=True, cu_seqlens=cu_t,
                                            chunk_size=chunk, use_qk_l2norm=eps is not None)
        (o.float().sum() + ht2.sum()).backward()
        for leaf in leaves:
            if leaf is not None:
                assert layout_of(leaf.grad) == layout_of(leaf.detach().contiguous())


def test_checkpoint_slots_match_the_header():
    for N in (0, 1, 3):
        for tokens in (0, 1, 63, 64, 65, 200):
            for chunk in (0, 1, 7, 64, 65):
                assert _checkpoint_slots(N, tokens, chunk) == \
                    torch.ops.rlx.gated_delta_checkpoint_slots(N, tokens, chunk)


@pytest.mark.parametrize("where", ["k", "v", "g", "beta", "initial_state", "cu_seqlens"])
def test_mixed_meta_and_cpu_inputs_are_rejected(where):
    """One meta tensor among CPU ones would select the meta kernel, which returns CPU-looking
    tensors of uninitialized memory: every path rejects it."""
    q, k, v, g, beta, h0, cu = make(1, 12, 2, 2, 4, 3, False, True, [0, 5, 12])
    named = dict(k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)
    named[where] = named[where].to("meta")
    match = f"all inputs must be on q's device cpu, got {where} on meta"
    with pytest.raises(RuntimeError, match=match):
        rlx_torch.gated_delta_rule(q, **{n: t for n, t in named.items()
                                         if n not in ("initial_state", "cu_seqlens")},
                                   initial_state=named["initial_state"],
                                   cu_seqlens=named["cu_seqlens"])
    args = (q, named["k"], named["v"], named["g"], named["beta"], 0.5,
            named["initial_state"], named["cu_seqlens"], 4, None)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.rlx.gated_delta_fwd(*args)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_output_shapes_do_not_depend_on_the_device(name):
    """The forward's outputs (vw included) have the same shapes and dtypes on every backend:
    the fakes for CUDA and MPS tensors give the CPU kernel's (the MPS kernels are held to the
    CPU's values in tests/test_metal_mps_gated_delta.py, under the mock runtime on Linux)."""
    B, T, H, HV, K, V, per_channel, state, cu, eps = VARIANTS[name]
    args = make(B, T, H, HV, K, V, per_channel, state, cu)
    for chunk in (0, 4, 64):
        real = torch.ops.rlx.gated_delta_fwd(*args[:5], 0.5, *args[5:], chunk, eps)
        want = [(tuple(t.shape), t.dtype) for t in real]
        assert (want[3][0] == tuple(args[2].shape)) == (chunk > 0 and not per_channel)
        for device in ("cuda", "mps"):
            with FakeTensorMode() as mode:
                fakes = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=device)
                         for t in args[:6]]
                fakes.append(None if args[6] is None else mode.from_tensor(args[6]))  # (CPU)
                out = torch.ops.rlx.gated_delta_fwd(*fakes[:5], 0.5, *fakes[5:], chunk, eps)
            assert [(tuple(t.shape), t.dtype) for t in out] == want, (device, chunk)
            assert all(t.device.type == device for t in out)


@pytest.mark.parametrize("where", ["checkpoints", "grad_o", "grad_final_state", "vw"])
def test_mixed_devices_in_backward_are_rejected(where):
    q, k, v, g, beta, h0, cu = make(2, 9, 2, 2, 4, 3, False, True, None)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, 0.5, h0, None, 4)
    named = dict(checkpoints=ckpt, grad_o=torch.randn_like(o), grad_final_state=ht, vw=vw)
    named[where] = named[where].to("meta")
    with pytest.raises(RuntimeError, match=f"got {where} on meta"):
        torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, 0.5, h0, None, named["checkpoints"],
                                      named["grad_o"], named["grad_final_state"], 4, None,
                                      named["vw"])


BAD_INPUTS = {  # name: (change to the inputs, message)
    "k_shape": (lambda a: a.update(k=a["k"][:, :-1]), "k must have q's shape"),
    "v_time": (lambda a: a.update(v=a["v"][:, :-1]), "v must share q's batch and time"),
    "g_shape": (lambda a: a.update(g=a["g"][..., None, None]), "g must be"),
    "beta_shape": (lambda a: a.update(beta=a["beta"][:, :-1]), "beta must be"),
    "k_dtype": (lambda a: a.update(k=a["k"].double()), "q, k and v must share one dtype"),
    "g_dtype": (lambda a: a.update(g=a["g"].double()), "g and beta must be Float"),
    "heads": (lambda a: a.update(v=a["v"][:, :, :1].expand(-1, -1, 3, -1).contiguous(),
                                 g=a["g"][:, :, :1].expand(-1, -1, 3).contiguous(),
                                 beta=a["beta"][:, :, :1].expand(-1, -1, 3).contiguous()),
              "positive multiple of the q/k heads"),
    "K_zero": (lambda a: a.update(q=a["q"][..., :0], k=a["k"][..., :0]),
               "key head dim K must be in"),
    "K_big": (lambda a: a.update(q=a["q"].new_zeros(2, 9, 2, 257),
                                 k=a["k"].new_zeros(2, 9, 2, 257)), "key head dim K must be in"),
    "state_shape": (lambda a: a.update(h0=a["h0"][:, :, :-1]), "initial_state must be"),
    "cu_batch": (lambda a: a.update(cu=torch.tensor([0, 9])), "B must be 1"),
    "cu_dtype": (lambda a: a.update(q=a["q"][:1], k=a["k"][:1], v=a["v"][:1], g=a["g"][:1],
                                    beta=a["beta"][:1], h0=None, cu=torch.tensor([0, 9.0])),
                 "cu_seqlens must be a 1-D int64"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_fakes_reject_what_the_kernels_reject(name):
    """Eager and fake (meta, torch.compile) calls fail alike, with the same message."""
    q, k, v, g, beta, h0, _ = make(2, 9, 2, 2, 4, 3, False, True, None)
    a = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu=None)
    change, match = BAD_INPUTS[name]
    change(a)
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"], 0.5, a["h0"], a["cu"], 4, None)
    with pytest.raises(RuntimeError, match=match) as eager:
        torch.ops.rlx.gated_delta_fwd(*args)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=match) as fake:
        torch.ops.rlx.gated_delta_fwd(*(mode.from_tensor(x) if isinstance(x, torch.Tensor)
                                        else x for x in args))
    assert str(eager.value).splitlines()[0] == str(fake.value).splitlines()[0]


def test_public_errors_name_the_argument():
    q, k, v, g, beta, _, _ = make(1, 6, 2, 2, 4, 3, False, False, None)
    for chunk in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
            rlx_torch.gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    with pytest.raises(TypeError, match="scale must be a real number"):
        rlx_torch.gated_delta_rule(q, k, v, g, beta, scale="0.5")
    with pytest.raises(ValueError, match="scale must be finite"):
        rlx_torch.gated_delta_rule(q, k, v, g, beta, scale=float("nan"))
    with pytest.raises(RuntimeError, match="key head dim K must be in"):  # not ZeroDivisionError
        rlx_torch.gated_delta_rule(q[..., :0], k[..., :0], v, g, beta)


def _forward(chunk, eps=None, T=128):
    q, k, v, g, beta, h0, _ = make(1, T, 2, 2, 8, 8, False, True, None)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, 0.5, h0, None, chunk, eps)
    return (q, k, v, g, beta, h0), o, ht, ckpt, vw


def test_backward_rejects_checkpoints_of_another_forward():
    """chunk_size 64 and 65 at T = 128 give the same slot count: checkpoints of the other one
    would give wrong gradients, so the backward rejects them; l2norm_eps alike."""
    inputs, o, ht, ckpt, vw = _forward(64)
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    _, _, _, ckpt65, _ = _forward(65)
    assert ckpt65.shape == ckpt.shape
    good = torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None, ckpt, go, gh, 64)
    assert torch.isfinite(good).all()
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None, ckpt, go, gh, 65)
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None, ckpt65, go, gh, 64)
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None, ckpt, go, gh, 64, 1e-6)
    _, _, _, ckpt_l2, _ = _forward(64, 1e-6)
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None, ckpt_l2, go, gh, 64)
    with pytest.raises(RuntimeError, match="checkpoints do not come from"):
        torch.ops.rlx.gated_delta_bwd(*inputs[:5], 0.5, inputs[5], None,
                                      torch.zeros_like(ckpt), go, gh, 64)


def test_backward_rejects_vw_of_other_inputs():
    inputs, o, ht, ckpt, vw = _forward(64)
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    q, k, v, g, beta, h0 = inputs
    ok = torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, 0.5, h0, None, ckpt, go, gh, 64, None,
                                       vw)
    recomputed = torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, 0.5, h0, None, ckpt, go, gh, 64)
    torch.testing.assert_close(ok, recomputed, rtol=1e-4, atol=1e-5)
    other_v = torch.randn_like(v)
    _, _, _, vw_other = torch.ops.rlx.gated_delta_fwd(q, k, other_v, g, beta, 0.5, h0, None, 64)
    with pytest.raises(RuntimeError, match="vw does not match"):
        torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, 0.5, h0, None, ckpt, go, gh, 64, None,
                                      vw_other)


@pytest.mark.parametrize("per_channel", [False, True])
def test_huge_chunk_size_needs_no_huge_scratch(per_channel):
    """chunk_size = 2^24 at T = 40 asked the backward for 42 GB of scratch; it is now sized
    by the longest sequence. The gradients equal those of a chunk that covers it."""
    q, k, v, g, beta, h0, _ = make(2, 40, 2, 2, 64, 64, per_channel, True, None)
    grads = []
    for chunk in (2**24, 40):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        o, ht = rlx_torch.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                           output_final_state=True, chunk_size=chunk)
        (o.sum() + ht.sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dynamic_compile_with_gradients_over_shapes():
    """torch.compile(fullgraph=True, dynamic=True) with gradients failed on the second shape
    (assume_constant_result of the layout with symbolic sizes)."""
    torch._dynamo.reset()

    def loss(q, k, v, g, beta, h0):
        o, ht = rlx_torch.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, use_qk_l2norm=True)
        return o.square().sum() + ht.sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True)
    for B, T in ((2, 5), (3, 9), (2, 17), (1, 33)):
        for per_channel in (False, True):
            inputs = make(B, T, 2, 2, 4, 3, per_channel, True, None)[:6]
            got, want = ([t.clone().requires_grad_() for t in inputs] for _ in range(2))
            compiled(*got).backward()
            loss(*want).backward()
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
