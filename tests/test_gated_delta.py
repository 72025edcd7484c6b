"""rlx_torch.gated_delta_rule (CPU) against the plain-PyTorch recurrence, gradcheck, opcheck,
torch.compile, the packed backward layout, numerics at the edges and input validation."""

import functools

import pytest
import torch
import torch.nn.functional as F

import rlx_torch
from rlx_torch.ops import reference
from rlx_torch.ops.gated_delta import _bwd_layout, l2norm, unpack_gradients

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Relative RMS error thresholds (fla's metric), per dtype, for outputs and gradients.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def rel_rms(actual, expected):
    actual, expected = actual.double(), expected.double()
    denom = expected.pow(2).mean().sqrt().clamp_min(1e-12)
    return ((actual - expected).pow(2).mean().sqrt() / denom).item()


def make_inputs(B=2, T=65, H=2, HV=2, K=8, V=8, per_channel=False, dtype=torch.float32,
                state=False, cu_seqlens=None, normalize_k=True):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    if normalize_k:  # keeps the recurrence contractive, as l2norm does in practice
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V)
    g_shape = (B, T, HV, K) if per_channel else (B, T, HV)
    g = F.logsigmoid(torch.randn(g_shape) + 2.0)
    beta = torch.rand(B, T, HV)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g, beta = g.to(acc), beta.to(acc)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.randn(N, HV, K, V, dtype=acc) if state else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.long)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def run_both(inputs, use_qk_l2norm=False, grads=True, ours_kw=None, **kw):
    """Outputs and gradients of ours and of the reference for the same random cotangents."""
    results = []
    cot = None
    ours = functools.partial(rlx_torch.gated_delta_rule, **(ours_kw or {}))
    for fn in (ours, reference.gated_delta_rule):
        leaves = {name: (t.detach().clone().requires_grad_(grads and t.is_floating_point())
                         if t is not None else None) for name, t in inputs.items()}
        o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                   initial_state=leaves["initial_state"], output_final_state=True,
                   cu_seqlens=leaves["cu_seqlens"], use_qk_l2norm=use_qk_l2norm, **kw)
        out = {"o": o, "ht": ht}
        if grads:
            if cot is None:
                cot = (torch.randn_like(o.float()).to(o.dtype), torch.randn_like(ht))
            loss = (o.float() * cot[0].float()).sum() + (ht * cot[1]).sum()
            names = [n for n, t in leaves.items() if t is not None and t.requires_grad]
            grads = torch.autograd.grad(loss, [leaves[n] for n in names])
            out.update({"d" + n: gr for n, gr in zip(names, grads, strict=True)})
        results.append(out)
    return results


VARIANTS = {
    "per_head": dict(),
    "per_channel": dict(per_channel=True),
    "gva": dict(H=1, HV=3),
    "k_ne_v": dict(K=5, V=41),  # V = 4 vectors + 1 vector + 1 tail column of float32
    "state": dict(state=True),
    "varlen": dict(B=1, cu_seqlens=[0, 20, 20, 65], state=True),
    "kda_gva_varlen": dict(B=1, H=2, HV=4, K=6, V=3, per_channel=True,
                           cu_seqlens=[0, 64, 65], state=True),
    "l2norm": dict(normalize_k=False, state=True, use_qk_l2norm=True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_all_variants(variant, dtype):
    kw = dict(VARIANTS[variant])
    use_qk_l2norm = kw.pop("use_qk_l2norm", False)
    inputs = make_inputs(dtype=dtype, **kw)
    ours, ref = run_both(inputs, use_qk_l2norm=use_qk_l2norm)
    assert ours["o"].dtype == dtype and ours["o"].shape == inputs["v"].shape
    assert ours["ht"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for name, expected in ref.items():
        assert ours[name].shape == expected.shape, name
        assert ours[name].dtype == expected.dtype, name
        assert rel_rms(ours[name], expected) < TOL[dtype], name


@pytest.mark.parametrize("T", [1, 63, 65, 1000])
@pytest.mark.parametrize("variant", ["per_head", "per_channel"])
def test_sequence_lengths(T, variant):
    inputs = make_inputs(B=1, T=T, H=1, HV=2, K=16, V=8, state=True, **VARIANTS[variant])
    ours, ref = run_both(inputs, grads=T <= 65)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float32], name


@pytest.mark.parametrize("V", [48, 80, 112])
def test_value_blocks_off_the_vector_grid(V):
    # One head on two threads splits V into column blocks of a multiple of 8 (24 for V = 80):
    # the forward's vw rows are then not aligned to a 512-bit vector, and must not be written
    # with streaming stores that need that alignment (the AVX-512 copy crashed here).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ours, ref = run_both(make_inputs(B=1, T=100, H=1, HV=1, K=16, V=V, state=True))
    finally:
        torch.set_num_threads(threads)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float32], name


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_large_states_use_several_sub_chunks(per_channel):
    # The backward recomputes a chunk in sub-chunks of at most 8 MiB of states: 15 tokens
    # for a float64 256 x 256 state, so chunks of 20 split 15 + 5 (varlen, odd lengths).
    inputs = make_inputs(B=1, T=45, H=1, HV=1, K=256, V=256, dtype=torch.float64,
                         per_channel=per_channel, state=True, cu_seqlens=[0, 7, 45])
    ours, ref = run_both(inputs, ours_kw=dict(chunk_size=20))
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float64], name


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_lazy_decay_renormalization_matches_reference(per_channel):
    # Both directions keep the state (dS) scaled by accumulated decays and renormalize them
    # before they leave [2^-20, 2^20]: usual decays cross that every ~100 tokens, a run of
    # g = +0.05 crosses the upper bound, and g = -30 forces it on every token.
    T = 700
    inputs = make_inputs(B=1, T=T, H=1, HV=2, K=12, V=20, per_channel=per_channel, state=True,
                         dtype=torch.float64)
    g = inputs["g"]
    g[:, 200:500] = 0.05
    g[:, 600:610] = -30.0
    ours, ref = run_both(inputs)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float64], name


def test_per_head_gate_gradient_over_long_sequences():
    # With one gate per head the backward gets dg from a recursion over tokens that restarts
    # from an exact <dS, S> at every chunk end (backward_kernel); check in float32 over 32
    # chunks against the float64 reference that its rounding does not build up.
    inputs = make_inputs(B=1, T=2048, H=1, HV=2, K=16, V=16, state=True)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    go, gh = torch.randn(inputs["v"].shape), torch.randn(inputs["initial_state"].shape)
    results = []
    for fn, dtype in ((rlx_torch.gated_delta_rule, torch.float32),
                      (reference.gated_delta_rule, torch.float64)):
        leaves = [inputs[n].to(dtype).requires_grad_() for n in names]
        o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        loss = (o * go.to(dtype)).sum() + (ht * gh.to(dtype)).sum()
        results.append(torch.autograd.grad(loss, leaves))
    for name, ours, expected in zip(names, *results, strict=True):
        assert rel_rms(ours, expected) < TOL[torch.float32], name


def test_l2norm_and_scale_match_reference():
    inputs = make_inputs(T=40, normalize_k=False, state=True)
    ours, ref = run_both(inputs, use_qk_l2norm=True, scale=0.3)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float32], name


@pytest.mark.parametrize("kw", [
    dict(K=16, V=16),  # float32, one gate per head: the forward's raw-rows path
    dict(H=1, HV=3, K=16, V=5, state=True),  # GVA: l2norm's backward on the group's sum
    dict(K=13, V=7, state=True),  # rows that are not whole vectors
    dict(per_channel=True, K=16, V=9, state=True),
    dict(B=1, K=16, V=8, cu_seqlens=[0, 1, 1, 40, 65], state=True),
    dict(dtype=torch.bfloat16, K=16, V=16, state=True),
    dict(dtype=torch.float16, per_channel=True, H=1, HV=2, K=8, V=8),
])
def test_l2norm_in_kernel_matches_reference(kw):
    # On the CPU the ops normalize q and k themselves (l2norm_eps) and return the gradients
    # of the raw rows; every kernel path must agree with normalizing first.
    torch.manual_seed(3)
    dtype = kw.get("dtype", torch.float32)
    inputs = make_inputs(T=65, normalize_k=False, **kw)
    ours, ref = run_both(inputs, use_qk_l2norm=True)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[dtype], name


def test_l2norm_in_kernel_op_equals_composition():
    # The op with l2norm_eps against the l2norm ops around the plain op, float64.
    inputs = make_inputs(B=1, T=40, H=1, HV=2, K=8, V=4, normalize_k=False, state=True,
                         dtype=torch.float64)
    q, k, v, g, beta, h0 = (inputs[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    ops = torch.ops.rlx
    o, ht, ckpt, vw = ops.gated_delta_fwd(q, k, v, g, beta, 0.4, h0, None, 8, 1e-6)
    qn, q_rstd = ops.gated_delta_l2norm_fwd(q, 1e-6)
    kn, k_rstd = ops.gated_delta_l2norm_fwd(k, 1e-6)
    o2, ht2, ckpt2, vw2 = ops.gated_delta_fwd(qn, kn, v, g, beta, 0.4, h0, None, 8)
    for a, b in ((o, o2), (ht, ht2), (ckpt, ckpt2), (vw, vw2)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    # (the first reads the forward's vw, the second recomputes it)
    packed = ops.gated_delta_bwd(q, k, v, g, beta, 0.4, h0, None, ckpt, go, gh, 8, 1e-6, vw)
    packed2 = ops.gated_delta_bwd(qn, kn, v, g, beta, 0.4, h0, None, ckpt2, go, gh, 8)
    grads = unpack_gradients(packed, q, v, g, h0, None)
    grads2 = list(unpack_gradients(packed2, q, v, g, h0, None))
    grads2[0] = ops.gated_delta_l2norm_bwd(grads2[0], q, q_rstd)
    grads2[1] = ops.gated_delta_l2norm_bwd(grads2[1], k, k_rstd)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), grads, grads2,
                          strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_bad_l2norm_eps_raises(eps):
    inputs = make_inputs(B=1, T=5)
    args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta")) + (0.5, None, None, 4)
    with pytest.raises(RuntimeError, match="l2norm_eps must be None or a finite number >= 0"):
        torch.ops.rlx.gated_delta_fwd(*args, eps)
    o, ht, ckpt, _ = torch.ops.rlx.gated_delta_fwd(*args)
    with pytest.raises(RuntimeError, match="l2norm_eps must be None or a finite number >= 0"):
        torch.ops.rlx.gated_delta_bwd(*args[:8], ckpt, o, None, 4, eps)


def test_chunk_size_does_not_change_results_with_l2norm():
    # Checkpoint intervals above 64 tokens take the l2norm factors in several blocks of rows.
    inputs = make_inputs(B=1, T=150, K=8, normalize_k=False, state=True, dtype=torch.float64)
    results = []
    for chunk_size in (7, 64, 100):
        torch.manual_seed(1)  # same cotangents for every run
        results.append(run_both(inputs, use_qk_l2norm=True, grads=True,
                                ours_kw=dict(chunk_size=chunk_size))[0])
    for other in results[1:]:
        for name in results[0]:
            torch.testing.assert_close(other[name], results[0][name], rtol=1e-12, atol=1e-12)


def test_chunk_size_does_not_change_results():
    inputs = make_inputs(T=50, state=True, dtype=torch.float64)
    torch.manual_seed(1)  # same cotangents for both runs
    a, _ = run_both(inputs)
    torch.manual_seed(1)
    b, _ = run_both(inputs, ours_kw=dict(chunk_size=7))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-12, atol=1e-12)


def _gradcheck(inputs, use_qk_l2norm=False, chunk_size=3):
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if inputs[n] is not None]
    leaves = [inputs[n].double().requires_grad_() for n in names]

    def fn(*args):
        kw = dict(zip(names, args, strict=True))
        o, ht = rlx_torch.gated_delta_rule(
            kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], initial_state=kw.get("initial_state"),
            output_final_state=True, cu_seqlens=inputs["cu_seqlens"],
            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        return o, ht  # the loss covers the final state too

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_per_head_with_state():
    _gradcheck(make_inputs(B=2, T=7, H=1, HV=2, K=3, V=2, state=True, dtype=torch.float64))


def test_gradcheck_per_channel_varlen():
    _gradcheck(make_inputs(B=1, T=8, H=1, HV=2, K=3, V=2, per_channel=True, state=True,
                           cu_seqlens=[0, 3, 3, 8], dtype=torch.float64))


def test_gradcheck_l2norm_no_state():
    _gradcheck(make_inputs(B=1, T=6, H=2, HV=2, K=3, V=4, normalize_k=False,
                           dtype=torch.float64), use_qk_l2norm=True)


def test_gradcheck_l2norm_gva_varlen_state():
    # l2norm's backward runs once the group's value heads are summed.
    _gradcheck(make_inputs(B=1, T=7, H=1, HV=2, K=4, V=3, normalize_k=False, state=True,
                           cu_seqlens=[0, 2, 7], dtype=torch.float64), use_qk_l2norm=True)


def _forward_backward(inputs, cot_o, cot_h):
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    leaves = [inputs[n].clone().requires_grad_() for n in names]
    o, ht = rlx_torch.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                       output_final_state=True, cu_seqlens=inputs["cu_seqlens"])
    grads = torch.autograd.grad((o * cot_o).sum() + (ht * cot_h).sum(), leaves)
    return o, ht, dict(zip(names, grads, strict=True))


def test_varlen_equals_separate_sequences():
    cu = [0, 13, 13, 70, 71]
    inputs = make_inputs(B=1, T=71, K=6, V=5, per_channel=True, state=True, cu_seqlens=cu)
    cot_o = torch.randn_like(inputs["v"])
    cot_h = torch.randn_like(inputs["initial_state"])
    o, ht, grads = _forward_backward(inputs, cot_o, cot_h)
    for n in range(len(cu) - 1):
        lo, hi = cu[n], cu[n + 1]
        one = {name: inputs[name][:, lo:hi] for name in ("q", "k", "v", "g", "beta")}
        one.update(initial_state=inputs["initial_state"][n:n + 1], cu_seqlens=None)
        o1, ht1, grads1 = _forward_backward(one, cot_o[:, lo:hi], cot_h[n:n + 1])
        torch.testing.assert_close(o[:, lo:hi], o1)
        torch.testing.assert_close(ht[n:n + 1], ht1)
        torch.testing.assert_close(grads["initial_state"][n:n + 1], grads1["initial_state"])
        for name in ("q", "k", "v", "g", "beta"):
            torch.testing.assert_close(grads[name][:, lo:hi], grads1[name])


def test_gva_equals_repeated_qk():
    inputs = make_inputs(B=2, T=30, H=2, HV=6, K=4, V=5, state=True, dtype=torch.float64)
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    o, ht = rlx_torch.gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                       leaves["beta"], initial_state=leaves["initial_state"],
                                       output_final_state=True)
    rep = {n: leaves[n].detach().repeat_interleave(3, dim=2).requires_grad_() for n in "qk"}
    o2, ht2 = rlx_torch.gated_delta_rule(rep["q"], rep["k"], leaves["v"], leaves["g"],
                                         leaves["beta"], initial_state=leaves["initial_state"],
                                         output_final_state=True)
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(ht, ht2)
    w = torch.randn_like(o)
    dq, dk = torch.autograd.grad((o * w).sum() + ht.sum(), [leaves["q"], leaves["k"]])
    dq2, dk2 = torch.autograd.grad((o2 * w).sum() + ht2.sum(), [rep["q"], rep["k"]])
    torch.testing.assert_close(dq, dq2.view(2, 30, 2, 3, 4).sum(3))
    torch.testing.assert_close(dk, dk2.view(2, 30, 2, 3, 4).sum(3))


def test_noncontiguous_and_empty_inputs():
    base = make_inputs(B=2, T=33, H=2, HV=2, K=4, V=6, state=True)
    # Non-contiguous views: time-major storage seen through a transpose, and a strided slice.
    nc = dict(base)
    nc["q"] = base["q"].transpose(0, 1).contiguous().transpose(0, 1)
    nc["v"] = torch.stack([base["v"], -base["v"]], dim=-1)[..., 0]
    nc["g"] = base["g"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not nc["q"].is_contiguous() and not nc["v"].is_contiguous()
    torch.testing.assert_close(nc["v"], base["v"])
    ours, ref = run_both(nc)
    for name, expected in ref.items():
        assert rel_rms(ours[name], expected) < TOL[torch.float32], name
    for B, T in ((0, 5), (2, 0)):
        empty = make_inputs(B=B, T=T, state=True)
        ours, ref = run_both(empty, grads=False)
        ht = ref["ht"]
        for name, expected in ref.items():
            assert ours[name].shape == expected.shape, name
            torch.testing.assert_close(ours[name], expected)
        # No tokens: the final state is the initial one, and so is its gradient.
        o, ht, grads = _forward_backward(empty, torch.randn_like(empty["v"]), torch.ones_like(ht))
        torch.testing.assert_close(grads["initial_state"], torch.ones_like(ht))
        assert grads["q"].shape == empty["q"].shape


def test_extreme_decay_long_sequence():
    # g = -30 every step: exp(-30) ~ 9e-14, so S_t = beta_t k_t v_t^T up to ~1e-13 relative.
    T, K, V = 65536, 4, 3
    q = torch.randn(1, T, 1, K)
    k = F.normalize(torch.randn(1, T, 1, K), dim=-1)
    v = torch.randn(1, T, 1, V)
    g = torch.full((1, T, 1), -30.0)
    beta = torch.rand(1, T, 1)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    o, ht = rlx_torch.gated_delta_rule(*leaves, output_final_state=True)
    expected = (K**-0.5 * (q * k).sum(-1, keepdim=True)) * beta.unsqueeze(-1) * v
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-4)
    assert torch.isfinite(ht).all()
    grads = torch.autograd.grad(o.sum() + ht.sum(), leaves)
    assert all(torch.isfinite(gr).all() for gr in grads)


@pytest.mark.parametrize("case", ["beta_zero", "k_one", "v_one", "strong_decay_per_channel"])
def test_edge_cases_match_reference(case):
    kw = dict(B=1, T=70, K=6, V=5, state=True)
    if case == "k_one":
        kw["K"] = 1
    if case == "v_one":
        kw["V"] = 1
    if case == "strong_decay_per_channel":
        kw["per_channel"] = True
    inputs = make_inputs(**kw)
    if case == "beta_zero":
        inputs["beta"] = torch.zeros_like(inputs["beta"])
    if case == "strong_decay_per_channel":
        inputs["g"] = -30.0 * torch.rand_like(inputs["g"])
    ours, ref = run_both(inputs)
    for name, expected in ref.items():
        assert torch.isfinite(ours[name]).all(), name
        assert rel_rms(ours[name], expected) < TOL[torch.float32] or \
            (ours[name] - expected).abs().max() < 1e-6, name


def test_inference_keeps_no_checkpoints():
    inputs = make_inputs(B=2, T=70, state=True, per_channel=True)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 0.3,
            inputs["initial_state"], None)
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*args, 0)
    o64, ht64, ckpt64, _ = torch.ops.rlx.gated_delta_fwd(*args, 64)
    assert ckpt.shape[0] == 0 and ckpt64.shape[0] > 0 and vw.numel() == 0
    assert torch.equal(o, o64) and torch.equal(ht, ht64)
    per_head = make_inputs(B=2, T=70)  # (keeps vw only for a backward: not with C = 0)
    head_args = tuple(per_head[n] for n in ("q", "k", "v", "g", "beta")) + (0.3, None, None)
    assert torch.ops.rlx.gated_delta_fwd(*head_args, 0)[3].numel() == 0
    assert torch.ops.rlx.gated_delta_fwd(*head_args, 64)[3].shape == per_head["v"].shape
    torch.library.opcheck(torch.ops.rlx.gated_delta_fwd.default, args + (0,))
    with torch.no_grad():  # the public function takes this path on its own
        o2, ht2 = rlx_torch.gated_delta_rule(*args[:5], scale=0.3,
                                             initial_state=inputs["initial_state"],
                                             output_final_state=True)
    assert torch.equal(o2, o) and torch.equal(ht2, ht)
    with pytest.raises(RuntimeError, match="needs the forward's checkpoints"):
        torch.ops.rlx.gated_delta_bwd(*args, ckpt, o, None, 0)


def test_l2norm_paths_agree():
    # With gradients, the autograd Function calls the forward op with checkpoints; without
    # (a decode step's path), the op directly without them. Both normalize q and k in the
    # kernel, and the outputs must be bitwise equal.
    inputs = make_inputs(B=2, T=33, state=True, normalize_k=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    kw = dict(initial_state=inputs["initial_state"], output_final_state=True,
              use_qk_l2norm=True)
    with torch.no_grad():
        o, ht = rlx_torch.gated_delta_rule(*args, **kw)
    leaves = [t.clone().requires_grad_() for t in args]
    o_g, ht_g = rlx_torch.gated_delta_rule(*leaves, **kw)
    assert o_g.grad_fn is not None
    assert torch.equal(o, o_g.detach()) and torch.equal(ht, ht_g.detach())
    # Only v needs a gradient: q and k are still normalized, and dv is the same.
    v = args[2].clone().requires_grad_()
    o_v, _ = rlx_torch.gated_delta_rule(args[0], args[1], v, *args[3:], **kw)
    assert torch.equal(o_v.detach(), o)
    (dv,) = torch.autograd.grad(o_v.sum(), [v])
    (dv_all,) = torch.autograd.grad(o_g.sum(), [leaves[2]])
    assert torch.equal(dv, dv_all)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_deterministic_bitwise(per_channel):
    inputs = make_inputs(B=2, T=100, H=2, HV=4, K=16, V=16, state=True, per_channel=per_channel)
    torch.manual_seed(1)
    first, _ = run_both(inputs)
    torch.manual_seed(1)
    second, _ = run_both(inputs)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_bitwise_equal_across_thread_counts():
    # The forward's column blocks shrink with more threads (V = 67: blocks of 40 columns on
    # one thread, 24 on two, 16 on four), which must not change any column's arithmetic.
    inputs = make_inputs(B=2, T=150, H=2, HV=4, K=13, V=67, state=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            torch.manual_seed(1)
            results.append(run_both(inputs)[0])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for name in results[0]:
            assert torch.equal(results[0][name], other[name]), name


@pytest.mark.parametrize("variant", ["per_head", "gva", "k_ne_v", "state", "varlen", "l2norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_chunked_and_token_by_token_backward_agree(variant, dtype, monkeypatch):
    # One gate per head with every g <= 0 takes the chunked backward; a gate per channel, any
    # g > 0, or RLX_GDN_RECURRENT_BACKWARD=1 the token-by-token one. Both match the reference
    # (odd chunk and sub-chunk lengths: T = 150, checkpoints every 48 tokens) and each other.
    kw = dict(VARIANTS[variant])
    use_qk_l2norm = kw.pop("use_qk_l2norm", False)
    kw.setdefault("T", 150)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = [0, 20, 20, 97, 150]
    inputs = make_inputs(dtype=dtype, **kw)
    results = {}
    for path in ("chunked", "token"):
        monkeypatch.setenv("RLX_GDN_RECURRENT_BACKWARD", "1" if path == "token" else "0")
        torch.manual_seed(1)
        results[path], ref = run_both(inputs, use_qk_l2norm=use_qk_l2norm,
                                      ours_kw=dict(chunk_size=48))
        for name, expected in ref.items():
            assert rel_rms(results[path][name], expected) < TOL[dtype], (path, name)
    for name in results["chunked"]:
        assert rel_rms(results["chunked"][name], results["token"][name]) < TOL[dtype], name


def reference_vw(inputs, scale_eps):
    """vw_t = v_t - (exp(g_t) S_{t-1})^T k_t per token and value head, float64 recurrence
    (one gate per head; k L2-normalized first when scale_eps is not None)."""
    k, v, g, beta = (inputs[n].double() for n in ("k", "v", "g", "beta"))
    if scale_eps is not None:
        k = k * (k.pow(2).sum(-1, keepdim=True) + scale_eps).rsqrt()
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    cu = inputs["cu_seqlens"]
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [
        (0, int(cu[n]), int(cu[n + 1])) for n in range(len(cu) - 1)]
    h0 = inputs["initial_state"]
    vw = torch.zeros(B, T, HV, V, dtype=torch.float64)
    for n, (b, bos, eos) in enumerate(bounds):
        for hv in range(HV):
            S = h0[n, hv].double().clone() if h0 is not None else torch.zeros(K, V).double()
            for t in range(bos, eos):
                kt = k[b, t, hv // (HV // H)]
                S = S * g[b, t, hv].exp()
                vw[b, t, hv] = v[b, t, hv] - S.T @ kt
                S = S + torch.outer(kt, beta[b, t, hv] * vw[b, t, hv])
    return vw


@pytest.mark.parametrize("variant", ["per_head", "gva", "k_ne_v", "state", "varlen", "l2norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_backward_reads_or_recomputes_vw_alike(variant, dtype):
    # With one gate per head the forward keeps vw = v - P^T k per token (its fourth output)
    # and the chunked backward reads it; given None, the backward solves for it per sub-chunk
    # instead. vw matches the reference recurrence, and both backward paths agree.
    kw = dict(VARIANTS[variant])
    eps = 1e-6 if kw.pop("use_qk_l2norm", False) else None
    kw.setdefault("T", 150)
    if "cu_seqlens" in kw:
        kw["cu_seqlens"] = [0, 20, 20, 97, 150]
    inputs = make_inputs(dtype=dtype, **kw)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta")) + (
        0.3, inputs["initial_state"], inputs["cu_seqlens"])
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*args, 48, eps)
    assert vw.shape == inputs["v"].shape and vw.dtype == acc
    tol = TOL[acc]
    assert rel_rms(vw, reference_vw(inputs, eps)) < tol
    go, gh = torch.randn_like(o), torch.randn_like(ht)
    saved = torch.ops.rlx.gated_delta_bwd(*args, ckpt, go, gh, 48, eps, vw)
    recomputed = torch.ops.rlx.gated_delta_bwd(*args, ckpt, go, gh, 48, eps, None)
    assert rel_rms(saved, recomputed) < tol
    empty = torch.ops.rlx.gated_delta_bwd(*args, ckpt, go, gh, 48, eps, vw[:0])
    assert torch.equal(empty, recomputed)  # empty means "not kept": recomputed
    with pytest.raises(RuntimeError, match="vw must be the"):
        torch.ops.rlx.gated_delta_bwd(*args, ckpt, go, gh, 48, eps, vw[:, 1:])
    with pytest.raises(RuntimeError, match="vw must be the"):
        torch.ops.rlx.gated_delta_bwd(*args, ckpt, go, gh, 48, eps, vw.half())


@pytest.mark.parametrize("per_channel,state", [(False, False), (True, False), (False, True)])
def test_backward_layout_tiles_buffer(per_channel, state):
    B, T, H, HV, K, V, N = 2, 9, 2, 6, 5, 7, 2
    lay = _bwd_layout(B, T, H, HV, K, V, N, per_channel, state)
    expected = {"dq": B * T * H * K, "dk": B * T * H * K, "dv": B * T * HV * V,
                "dg": B * T * HV * (K if per_channel else 1), "dbeta": B * T * HV,
                "dstate": N * HV * K * V if state else 0}
    at = 0
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate"):  # in order, no gap, no overlap
        offset, numel = lay[name]
        assert offset == at and numel == expected[name], name
        at += numel
    assert lay["total"] == at
    # The views handed to autograd cover every element of the buffer exactly once.
    inputs = make_inputs(B=B, T=T, H=H, HV=HV, K=K, V=V, per_channel=per_channel, state=state)
    packed = torch.arange(lay["total"], dtype=torch.float32)
    views = unpack_gradients(packed, inputs["q"], inputs["v"], inputs["g"],
                             inputs["initial_state"], None)
    seen = torch.cat([t.reshape(-1) for t in views if t is not None])
    assert torch.equal(seen, packed)


def test_opcheck_ops():
    for kw in (dict(state=True), dict(B=1, per_channel=True, cu_seqlens=[0, 4, 9], state=True),
               dict(H=1, HV=2, K=3, V=5), dict(K=8, l2norm_eps=1e-6, state=True)):
        eps = kw.pop("l2norm_eps", None)
        inputs = make_inputs(T=9, K=kw.pop("K", 4), V=kw.pop("V", 3), **kw)
        args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], 0.5,
                inputs["initial_state"], inputs["cu_seqlens"], 4, eps)
        torch.library.opcheck(torch.ops.rlx.gated_delta_fwd.default, args)
        o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(*args)  # (vw empty: per-channel gate)
        bwd_args = args[:8] + (ckpt, torch.randn_like(o), torch.randn_like(ht), 4, eps, vw)
        torch.library.opcheck(torch.ops.rlx.gated_delta_bwd.default, bwd_args)


def test_l2norm_op_matches_formula_gradcheck_and_opcheck():
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = torch.randn(3, 5, 7).to(dtype)
        x[0, 0] = 0  # eps keeps a zero row finite
        xf = x.double()
        expected = xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(l2norm(x).double(), expected, atol=tol, rtol=tol)
    x = torch.randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2norm, (x,))
    y, rstd = torch.ops.rlx.gated_delta_l2norm_fwd(x.detach(), 1e-6)
    torch.library.opcheck(torch.ops.rlx.gated_delta_l2norm_fwd.default, (x.detach(), 1e-6))
    torch.library.opcheck(torch.ops.rlx.gated_delta_l2norm_bwd.default,
                          (torch.randn_like(y), x.detach(), rstd))
    with pytest.raises(RuntimeError, match="x must be float16"):
        l2norm(torch.ones(3, 4, dtype=torch.long))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def layer(q, k, v, a, b, h0):
        g = F.logsigmoid(a)
        beta = torch.sigmoid(b)
        o, ht = rlx_torch.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True, use_qk_l2norm=True)
        return (o * 2).sum() + ht.square().sum()

    inputs = make_inputs(B=2, T=20, H=2, HV=4, K=8, V=4, state=True)
    a = torch.randn(2, 20, 4)
    b = torch.randn(2, 20, 4)
    args = [inputs["q"], inputs["k"], inputs["v"], a, b, inputs["initial_state"]]
    eager_args = [t.clone().requires_grad_() for t in args]
    comp_args = [t.clone().requires_grad_() for t in args]
    loss = layer(*eager_args)
    loss.backward()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss_c = compiled(*comp_args)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss)
    for x, y in zip(comp_args, eager_args, strict=True):
        torch.testing.assert_close(x.grad, y.grad)


def _call(**overrides):
    inputs = make_inputs(B=2, T=5, H=2, HV=4, K=3, V=2)
    inputs.update(overrides)
    return rlx_torch.gated_delta_rule(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        initial_state=inputs["initial_state"], cu_seqlens=inputs["cu_seqlens"])


@pytest.mark.parametrize("overrides,match", [
    (dict(q=torch.randn(2, 5, 2)), "q must be"),
    (dict(k=torch.randn(2, 5, 2, 4)), "k must have q's shape"),
    (dict(v=torch.randn(2, 5, 2)), "v must be"),
    (dict(v=torch.randn(2, 5, 3, 2), g=torch.randn(2, 5, 3), beta=torch.rand(2, 5, 3)),
     "multiple of the q/k heads"),
    (dict(v=torch.randn(2, 6, 4, 2)), "v must share q's batch and time"),
    (dict(g=torch.randn(2, 5, 3)), "g must be"),
    (dict(beta=torch.rand(2, 4, 4)), "beta must be"),
    (dict(cu_seqlens=torch.tensor([0, 2, 5])), "B must be 1"),
    (dict(q=torch.randn(2, 5, 2, 3, dtype=torch.float64)), "share one dtype"),
    (dict(q=torch.randn(2, 5, 2, 3).int()), "float16, bfloat16, float32 or float64"),
    (dict(initial_state=torch.randn(2, 4, 2, 3)), "initial_state must be"),
    (dict(initial_state=torch.randn(3, 4, 3, 2)), "initial_state must be"),
    (dict(g=torch.ones(2, 5, 4, dtype=torch.long)), "g must be a floating-point"),
])
def test_bad_input_raises(overrides, match):
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        _call(**overrides)


@pytest.mark.parametrize("cu,match", [
    ([0, 4, 2, 5], "non-decreasing"),
    ([0, 2, 4], "must end at T"),
    ([1, 2, 5], "must start at 0"),
    ([5], "N >= 1"),
])
def test_bad_cu_seqlens_raises(cu, match):
    one = dict(q=torch.randn(1, 5, 2, 3), k=torch.randn(1, 5, 2, 3), v=torch.randn(1, 5, 4, 2),
               g=torch.randn(1, 5, 4), beta=torch.rand(1, 5, 4))
    with pytest.raises(RuntimeError, match=match):
        _call(cu_seqlens=torch.tensor(cu), **one)
    with pytest.raises(RuntimeError, match="int64"):
        _call(cu_seqlens=torch.tensor([0, 5], dtype=torch.int16), **one)


def test_int32_cu_seqlens_give_the_int64_results():
    # transformers and FlashAttention build int32 offsets; the function accepts them as they
    # are, the raw op keeps its one int64 contract.
    x = make_inputs(B=1, T=13, H=2, HV=4, K=5, V=3, state=True, cu_seqlens=[0, 4, 4, 13])
    results = []
    for dtype in (torch.int64, torch.int32):
        leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta",
                                                                       "initial_state")}
        o, h = rlx_torch.gated_delta_rule(
            *(leaves[n] for n in ("q", "k", "v", "g", "beta")),
            initial_state=leaves["initial_state"], output_final_state=True,
            cu_seqlens=x["cu_seqlens"].to(dtype))
        (o.square().sum() + h.sum()).backward()
        results.append([o, h, *(leaves[n].grad for n in leaves)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.rlx.gated_delta_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 1.0, None,
                                      x["cu_seqlens"].int(), 64, None)
