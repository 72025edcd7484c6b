"""The CUDA gated delta kernels (csrc/cuda/gated_delta_{forward,backward}.cu) run on the CPU:
their device code is compiled with g++ against tests/cuda_emu/cuda_shim.h (threads, block
barriers, warp shuffles, shared memory) and compared, float32, with the CPU kernels. This checks
the kernels' indexing, synchronization and math without a GPU; tests/test_gated_delta_cuda.py
runs them for real."""

import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from rlx_torch.ops import reference
from tests.cuda_emu import build_emulator


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu"), "gdn_emu_main")


def _write(path, t):
    t.detach().float().contiguous().numpy().tofile(path)


def _read(path, shape):
    return torch.from_file(path, size=int(torch.Size(shape).numel()), dtype=torch.float32
                           ).view(shape).clone()


CASES = {
    "per_head_T65": dict(B=2, T=65, H=2, HV=2, K=8, V=8),
    "per_channel_state": dict(B=2, T=65, H=2, HV=2, K=8, V=8, per_channel=True, state=True),
    "gva_state": dict(B=1, T=40, H=1, HV=3, K=5, V=7, state=True),
    "two_warps_two_tiles": dict(B=1, T=37, H=1, HV=1, K=40, V=41, per_channel=True,
                                state=True),
    "varlen_empty": dict(B=1, T=30, H=1, HV=2, K=4, V=6, state=True, cu=[0, 7, 7, 30]),
    "T1": dict(B=2, T=1, H=1, HV=1, K=4, V=4, state=True),
    "chunk1": dict(B=1, T=9, H=1, HV=1, K=4, V=4, state=True, chunk=1),
    "chunk3": dict(B=1, T=20, H=1, HV=1, K=4, V=4, per_channel=True, state=True, chunk=3),
    "chunk100": dict(B=1, T=230, H=1, HV=1, K=4, V=4, state=True, chunk=100),
}


# float64 (2-token sub-chunks in the backward) on the cases that exercise the sub-chunking
RUNS = [(case, "float32") for case in CASES] + [
    (case, "float64") for case in ("two_warps_two_tiles", "varlen_empty", "chunk3")]


@pytest.mark.parametrize(("case", "real"), RUNS)
def test_emulated_cuda_kernels_match_cpu(case, real, emulator, tmp_path):
    c = dict(B=1, T=8, H=1, HV=1, K=4, V=4, per_channel=False, state=False, cu=None, chunk=64)
    c.update(CASES[case])
    B, T, H, HV, K, V = (c[n] for n in ("B", "T", "H", "HV", "K", "V"))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn((B, T, HV, K) if c["per_channel"] else (B, T, HV),
                                 generator=gen) + 2.0)
    beta = torch.rand(B, T, HV, generator=gen)
    cu = torch.tensor(c["cu"]) if c["cu"] else None
    N = len(c["cu"]) - 1 if c["cu"] else B
    h0 = torch.randn(N, HV, K, V, generator=gen) if c["state"] else None
    do = torch.randn(B, T, HV, V, generator=gen)
    dht = torch.randn(N, HV, K, V, generator=gen)
    scale, chunk = 0.3, c["chunk"]
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, do=do, dht=dht, h0=h0).items():
        if t is not None:
            _write(str(tmp_path / f"{name}.bin"), t)
    args = [emulator, str(tmp_path), B, T, H, HV, K, V, int(c["per_channel"]),
            int(h0 is not None), chunk, scale, len(c["cu"] or [])] + list(c["cu"] or [])
    env = dict(os.environ, RLX_EMU_SERIAL_WARPS="1",  # a missing barrier shows (cuda_shim.h)
               **({"RLX_EMU_DOUBLE": "1"} if real == "float64" else {}))
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, scale, h0, cu, chunk, None)
    packed = torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, scale, h0, cu, ckpt, do, dht, chunk,
                                           None, vw)
    from rlx_torch.ops.gated_delta import unpack_gradients

    dq, dk, dv, dg, dbeta, dh0 = unpack_gradients(packed, q, v, g, h0, cu)
    expected = dict(o=o, ht=ht, dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta)
    assert (vw.numel() > 0) == (not c["per_channel"])  # as the CUDA forward keeps it
    if vw.numel() > 0:
        expected["vw"] = vw
    if h0 is not None:
        expected["dh0"] = dh0
    for name, want in expected.items():
        got = _read(str(tmp_path / f"{name}.bin"), want.shape)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"{case}: {name}")


@pytest.fixture(scope="module")
def chunk_emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_chunk"), "gdn_chunk_emu_main")


def _rel_rms(got, want):
    return ((got.double() - want.double()).pow(2).mean().sqrt()
            / want.double().pow(2).mean().sqrt().clamp_min(1e-12)).item()


CHUNK_CASES = {
    "T65_state": dict(B=2, T=65, H=2, HV=2, K=8, V=8, state=True),
    "T130_ragged_k_v": dict(B=1, T=130, H=1, HV=1, K=42, V=41),
    "gva_varlen": dict(B=1, T=150, H=1, HV=2, K=16, V=24, state=True, cu=[0, 64, 64, 150]),
    "K128_narrow": dict(B=1, T=70, H=1, HV=1, K=72, V=20, state=True, chunk=128, narrow=True),
    "strong_decay": dict(B=1, T=100, H=1, HV=1, K=8, V=8, state=True, g_scale=30.0),
    "T1_no_ckpt": dict(B=1, T=1, H=1, HV=1, K=4, V=4, state=True, chunk=0),
    # a per-channel gate (KDA, gated_delta_chunk_kda.cuh)
    "kda_T65_state": dict(B=2, T=65, H=2, HV=2, K=8, V=8, state=True, per_channel=True),
    "kda_T130_odd_k_v": dict(B=1, T=130, H=1, HV=1, K=37, V=23, per_channel=True),
    "kda_gva_varlen_empty": dict(B=1, T=150, H=1, HV=2, K=16, V=24, state=True,
                                 cu=[0, 64, 64, 150], per_channel=True),
    "kda_K128_narrow_chunk128": dict(B=1, T=200, H=1, HV=1, K=100, V=72, state=True,
                                     chunk=128, narrow=True, per_channel=True),
    "kda_strong_decay": dict(B=1, T=100, H=1, HV=1, K=24, V=8, state=True, g_scale=30.0,
                             per_channel=True),
    "kda_T1_no_ckpt": dict(B=1, T=1, H=1, HV=1, K=4, V=4, state=True, chunk=0,
                           per_channel=True),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_emulated_chunked_forward_matches_cpu(case, chunk_emulator, tmp_path):
    """The chunked kernels (bf16 products, as on the GPU for bf16 inputs) against the CPU op on
    the same bf16-rounded q, k, v in float32: o, final state, the checkpoints and vw. A
    per-channel gate's also against the float64 reference (o and final state)."""
    c = dict(state=False, cu=None, chunk=64, narrow=False, g_scale=None, per_channel=False)
    c.update(CHUNK_CASES[case])
    B, T, H, HV, K, V = (c[n] for n in ("B", "T", "H", "HV", "K", "V"))
    gen = torch.Generator().manual_seed(1)
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    q = bf(torch.randn(B, T, H, K, generator=gen))
    k = bf(F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1))
    v = bf(torch.randn(B, T, HV, V, generator=gen))
    g_shape = (B, T, HV, K) if c["per_channel"] else (B, T, HV)
    g = F.logsigmoid(torch.randn(g_shape, generator=gen) + 2.0)
    if c["g_scale"] is not None:  # down to -g_scale per step: exp of cumsums would overflow
        g = -c["g_scale"] * torch.rand(g_shape, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    cu = torch.tensor(c["cu"]) if c["cu"] else None
    N = len(c["cu"]) - 1 if c["cu"] else B
    h0 = torch.randn(N, HV, K, V, generator=gen) if c["state"] else None
    scale, chunk = 0.3, c["chunk"]
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0).items():
        if t is not None:
            _write(str(tmp_path / f"{name}.bin"), t)
    args = [chunk_emulator, str(tmp_path), B, T, H, HV, K, V, int(h0 is not None), chunk, scale,
            len(c["cu"] or [])] + list(c["cu"] or [])
    env = dict(os.environ, RLX_EMU_SERIAL_WARPS="1",  # a missing barrier shows (cuda_shim.h)
               **({"RLX_EMU_NARROW": "1"} if c["narrow"] else {}),
               **({"RLX_EMU_PER_CHANNEL": "1"} if c["per_channel"] else {}))
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, scale, h0, cu, chunk, None)
    assert (vw.numel() > 0) == (chunk > 0 and not c["per_channel"])  # rlx::gdn_keeps_vw
    if c["per_channel"]:
        o64, ht64 = reference.gated_delta_rule(
            q.double(), k.double(), v.double(), g.double(), beta.double(), scale,
            None if h0 is None else h0.double(), True, cu)
        for name, want in dict(o=o64, ht=ht64).items():
            got = _read(str(tmp_path / f"{name}.bin"), want.shape)
            err = _rel_rms(got, want)
            assert err < 1e-2, f"{case}: {name} against float64, rel rms {err}"
    expected = dict(o=o, ht=ht, vw=vw)
    if ckpt.numel() > 0:  # the tag in the last slot is the host's, not the kernels'
        expected["ckpt"] = ckpt[:-1]
    for name, want in expected.items():
        if want.numel() == 0:
            continue
        got = _read(str(tmp_path / f"{name}.bin"), (ckpt if name == "ckpt" else want).shape)
        if name == "ckpt":
            got = got[:-1]
        assert torch.isfinite(got).all(), f"{case}: {name} not finite"
        assert _rel_rms(got, want) < 1e-2, f"{case}: {name} rel rms {_rel_rms(got, want)}"


@pytest.fixture(scope="module")
def chunk_bwd_emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_chunk_bwd"), "gdn_chunk_bwd_emu_main")


def _recurrence_f64(q, k, v, g, beta, h0, scale, bounds):
    """The gated delta rule token by token in float64 (DESIGN.md's equations), differentiable:
    q, k [tokens, H, K], v [tokens, HV, V], g [tokens, HV] or [tokens, HV, K] (per channel),
    beta [tokens, HV], h0 [N, HV, K, V] or None."""
    H, K, HV, V = q.shape[1], q.shape[2], v.shape[1], v.shape[2]
    rows, finals = {}, []
    for n in range(len(bounds) - 1):
        heads = []
        for hv in range(HV):
            S = h0[n, hv] if h0 is not None else q.new_zeros(K, V)
            for t in range(bounds[n], bounds[n + 1]):
                kt = k[t, hv // (HV // H)]
                a = torch.exp(g[t, hv])
                S = (a.unsqueeze(-1) if a.dim() else a) * S
                S = S + torch.outer(kt, beta[t, hv] * (v[t, hv] - S.T @ kt))
                rows[t, hv] = scale * S.T @ q[t, hv // (HV // H)]
            heads.append(S)
        finals.append(torch.stack(heads))
    o = torch.stack([torch.stack([rows[t, hv] for hv in range(HV)]) for t in range(q.shape[0])])
    return o, torch.stack(finals)


CHUNK_BWD_CASES = {
    "T20": dict(B=1, T=20, H=1, HV=1, K=8, V=8, state=True),
    "T64_no_dht": dict(B=1, T=64, H=1, HV=1, K=8, V=8, state=True, dht=False),
    "T65_gva_state": dict(B=2, T=65, H=1, HV=2, K=8, V=8, state=True),
    "T130_ragged_k_v": dict(B=1, T=130, H=1, HV=1, K=42, V=41),
    "gva_varlen_empty": dict(B=1, T=150, H=1, HV=2, K=16, V=24, state=True, cu=[0, 64, 64, 150]),
    "two_k_and_v_tiles": dict(B=1, T=70, H=1, HV=1, K=72, V=80, state=True),
    "K72_narrow": dict(B=1, T=70, H=1, HV=1, K=72, V=20, state=True, narrow=True),
    "strong_decay_varlen": dict(B=1, T=200, H=1, HV=1, K=8, V=8, state=True, g_scale=30.0,
                                cu=[0, 30, 30, 200]),
    "T1_batch": dict(B=4, T=1, H=1, HV=1, K=4, V=4, state=True),
    # the fused q/k L2 norm: wy_kernel<.., true> finishes dq and dk with its backward
    "l2norm_two_k_tiles": dict(B=1, T=130, H=1, HV=1, K=72, V=40, state=True, l2norm=True),
    "l2norm_K128_two_heads": dict(B=2, T=70, H=2, HV=2, K=128, V=24, l2norm=True),
    # a per-channel gate (KDA): the re-run kda prep and state kernels, the per-channel dv_local,
    # dh and dqk, and kda_wy_kernel (gated_delta_chunk_kda_bwd.cuh)
    "kda_T20": dict(B=1, T=20, H=1, HV=1, K=8, V=8, state=True, per_channel=True),
    "kda_T64_no_dht": dict(B=1, T=64, H=1, HV=1, K=8, V=8, state=True, dht=False,
                           per_channel=True),
    "kda_T65_gva_state": dict(B=2, T=65, H=1, HV=2, K=8, V=8, state=True, per_channel=True),
    "kda_T130_odd_k_v": dict(B=1, T=130, H=1, HV=1, K=37, V=41, per_channel=True),
    "kda_gva_varlen_empty": dict(B=1, T=150, H=1, HV=2, K=16, V=24, state=True,
                                 cu=[0, 64, 64, 150], per_channel=True),
    "kda_two_k_and_v_tiles": dict(B=1, T=70, H=1, HV=1, K=72, V=80, state=True,
                                  per_channel=True),
    "kda_K128_narrow": dict(B=1, T=130, H=1, HV=1, K=128, V=20, state=True, narrow=True,
                            per_channel=True),
    "kda_strong_decay_varlen": dict(B=1, T=200, H=1, HV=1, K=24, V=8, state=True, g_scale=30.0,
                                    cu=[0, 30, 30, 200], per_channel=True),
    "kda_T1_batch": dict(B=4, T=1, H=1, HV=1, K=4, V=4, state=True, per_channel=True),
}
L2NORM_EPS = 1e-6


def _run_chunk_bwd(exe, c, tmp_path, seed=1, rerun_state=False):
    B, T, H, HV, K, V = (c[n] for n in ("B", "T", "H", "HV", "K", "V"))
    gen = torch.Generator().manual_seed(seed)
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    tokens = B * T
    q = bf(torch.randn(tokens, H, K, generator=gen))
    k = torch.randn(tokens, H, K, generator=gen)
    k = bf(k if c["l2norm"] else F.normalize(k, dim=-1))  # (raw rows with the l2norm)
    v = bf(torch.randn(tokens, HV, V, generator=gen))
    g_shape = (tokens, HV, K) if c["per_channel"] else (tokens, HV)
    g = F.logsigmoid(torch.randn(g_shape, generator=gen) + 2.0)
    if c["g_scale"] is not None:  # down to -g_scale per step: exp of cumsums would overflow
        g = -c["g_scale"] * torch.rand(g_shape, generator=gen)
    beta = torch.rand(tokens, HV, generator=gen)
    bounds = c["cu"] or [n * T for n in range(B + 1)]
    N = len(bounds) - 1
    h0 = torch.randn(N, HV, K, V, generator=gen) if c["state"] else None
    do = bf(torch.randn(tokens, HV, V, generator=gen))
    dht = torch.randn(N, HV, K, V, generator=gen) if c["dht"] else None
    for name, t in dict(q=q, k=k, v=v, g=g, beta=beta, do=do, h0=h0, dht=dht).items():
        if t is not None:
            _write(str(tmp_path / f"{name}.bin"), t)
    args = [exe, str(tmp_path), B, T, H, HV, K, V, int(h0 is not None), int(dht is not None), 0.3,
            len(c["cu"] or [])] + list(c["cu"] or [])
    # warps one at a time between barriers (cuda_shim.h): a missing barrier shows
    env = dict(os.environ, RLX_EMU_SERIAL_WARPS="1",
               **({"RLX_EMU_NARROW": "1"} if c["narrow"] else {}),
               **({"RLX_EMU_RERUN_STATE": "1"} if rerun_state else {}),
               **({"RLX_EMU_L2NORM_EPS": str(L2NORM_EPS)} if c["l2norm"] else {}),
               **({"RLX_EMU_PER_CHANNEL": "1"} if c["per_channel"] else {}))
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, bounds=bounds,
                  l2norm=c["l2norm"])
    shapes = dict(dq=q.shape, dk=k.shape, dv=v.shape, dg=g.shape, dbeta=beta.shape)
    if h0 is not None:
        shapes["dh0"] = h0.shape
    return inputs, {n: _read(str(tmp_path / f"{n}.bin"), s) for n, s in shapes.items()}


def _chunk_bwd_case(case):
    c = dict(state=False, dht=True, cu=None, narrow=False, g_scale=None, l2norm=False,
             per_channel=False)
    c.update(CHUNK_BWD_CASES[case])
    return c


# S0 and u from a re-run of the state kernel (the path of checkpoints sparser than 64 tokens;
# a per-channel gate's always)
RERUN_STATE_CASES = ("T65_gva_state", "gva_varlen_empty", "K72_narrow")


@pytest.mark.parametrize(("case", "rerun_state"), [(c, False) for c in CHUNK_BWD_CASES] + [
    (c, True) for c in RERUN_STATE_CASES])
def test_emulated_chunked_backward_matches_float64(case, rerun_state, chunk_bwd_emulator,
                                                   tmp_path):
    """The chunked backward (its kernels after the forward's and the re-run prep kernel; S0
    and u from the forward's checkpoints and vw, or from a re-run state kernel; bf16 products
    as on the GPU for bf16 inputs) against autograd through a float64 token recurrence of the
    same bf16-rounded inputs: every gradient, with an initial state dh0. With the l2norm, q and
    k are raw rows, normalized in the reference's graph (float64) and by the emulation's host
    code (float32, rounded to bf16 as the kernels read them). A per-channel gate's also against
    the CPU op (float32) on the same inputs."""
    x, got = _run_chunk_bwd(chunk_bwd_emulator, _chunk_bwd_case(case), tmp_path,
                            rerun_state=rerun_state)
    leaves = {n: x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    if x["h0"] is not None:
        leaves["h0"] = x["h0"].double().requires_grad_()
    q, k = leaves["q"], leaves["k"]
    if x["l2norm"]:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + L2NORM_EPS) for t in (q, k))
    o, ht = _recurrence_f64(q, k, leaves["v"], leaves["g"], leaves["beta"], leaves.get("h0"),
                            0.3, x["bounds"])
    loss = (o * x["do"].double()).sum()
    if x["dht"] is not None:
        loss = loss + (ht * x["dht"].double()).sum()
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    for name, w in want.items():
        gname = "d" + name
        assert torch.isfinite(got[gname]).all(), f"{case}: {gname} not finite"
        err = _rel_rms(got[gname], w)
        assert err < 2e-2, f"{case}: {gname} rel rms {err}"
    if x["g"].dim() == 3:
        for name, w in _cpu_op_grads(x).items():
            err = _rel_rms(got["d" + name], w)
            assert err < 2e-2, f"{case}: d{name} against the CPU op, rel rms {err}"


def _cpu_op_grads(x):
    """rlx::gated_delta_fwd / _bwd on the CPU (float32) for _run_chunk_bwd's inputs (packed as
    one varlen batch), split into the gradients by name."""
    from rlx_torch.ops.gated_delta import unpack_gradients

    def batch(t):
        return t.unsqueeze(0)

    cu = torch.tensor(x["bounds"])
    q, k, v, g, beta = (batch(x[n]) for n in ("q", "k", "v", "g", "beta"))
    do = batch(x["do"])
    _, _, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, 0.3, x["h0"], cu, 64, None)
    packed = torch.ops.rlx.gated_delta_bwd(q, k, v, g, beta, 0.3, x["h0"], cu, ckpt, do,
                                           x["dht"], 64, None, vw)
    dq, dk, dv, dg, dbeta, dh0 = unpack_gradients(packed, q, v, g, x["h0"], cu)
    out = dict(q=dq[0], k=dk[0], v=dv[0], g=dg[0], beta=dbeta[0])
    if dh0 is not None:
        out["h0"] = dh0
    return out


@pytest.mark.parametrize("case", ["gva_varlen_empty", "kda_gva_varlen_empty"])
def test_emulated_chunked_backward_is_deterministic(case, chunk_bwd_emulator, tmp_path):
    c = _chunk_bwd_case(case)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, first = _run_chunk_bwd(chunk_bwd_emulator, c, tmp_path / "a")
    _, second = _run_chunk_bwd(chunk_bwd_emulator, c, tmp_path / "b")
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_emulated_chunked_backward_states_from_forward_are_the_rerun_ones(chunk_bwd_emulator,
                                                                          tmp_path):
    """S0 and u taken from the forward's checkpoints and vw round the same float32 values as
    the state kernel's re-run: the gradients are bitwise equal either way."""
    c = _chunk_bwd_case("two_k_and_v_tiles")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, kept = _run_chunk_bwd(chunk_bwd_emulator, c, tmp_path / "a")
    _, rerun = _run_chunk_bwd(chunk_bwd_emulator, c, tmp_path / "b", rerun_state=True)
    for name in kept:
        assert torch.isfinite(kept[name]).all(), name
        assert torch.equal(kept[name], rerun[name]), name


@pytest.fixture(scope="module")
def l2norm_emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("cuda_emu_l2norm"), "gdn_l2norm_emu_main")


def _l2norm_f64(x, eps):
    """fla's l2norm from its definition, in float64: (x r, r), r = (sum x^2 + eps)^-1/2."""
    r = (x.double().square().sum(-1, keepdim=True) + eps).rsqrt()
    return x.double() * r, r.squeeze(-1)


def _l2norm_grad_f64(x, dy, eps):
    """d/dx of sum(dy * l2norm(x)) by autograd through the float64 definition."""
    xd = x.double().requires_grad_()
    (y, _) = _l2norm_f64(xd, eps)
    return torch.autograd.grad((y * dy.double()).sum(), xd)[0]


# rows: a partial last block of 8 warps; K: rows held in registers at 1, 2, 4 and 8 values
# per lane, full and partly filled, and the generic path (K > 256); parts x group: the
# backward's column tiles and GVA heads
@pytest.mark.parametrize(("rows", "K", "parts", "group"),
                         [(37, 1, 1, 1), (9, 5, 2, 3), (17, 32, 1, 2), (11, 33, 3, 1),
                          (8, 128, 2, 2), (6, 100, 1, 1), (7, 200, 2, 1), (5, 256, 1, 1),
                          (5, 300, 1, 1)])
def test_emulated_l2norm_kernels_match_the_definition(rows, K, parts, group, l2norm_emulator,
                                                      tmp_path):
    gen = torch.Generator().manual_seed(rows * 1000 + K)
    x = torch.randn(rows, K, generator=gen) * 3
    x[0] = 0.0  # a zero row: r = eps^-1/2, y = 0
    dy = torch.randn(parts, rows, group, K, generator=gen)
    eps = 1e-6
    _write(str(tmp_path / "x.bin"), x)
    _write(str(tmp_path / "dy.bin"), dy)
    proc = subprocess.run([l2norm_emulator, str(tmp_path), str(rows), str(K), str(parts),
                           str(group), str(eps)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    y, r = _l2norm_f64(x, eps)
    torch.testing.assert_close(_read(str(tmp_path / "y.bin"), (rows, K)).double(), y,
                               rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(_read(str(tmp_path / "rstd.bin"), (rows,)).double(), r,
                               rtol=2e-6, atol=0)
    # bf16: the rounded x normalized in float32, then rounded once to bf16 (within one ulp
    # of the float64 value rounded, as float32 sums may fall on either side of a tie)
    xb = x.bfloat16().float()
    yb_want = _l2norm_f64(xb, eps)[0]
    yb = _read(str(tmp_path / "y_bf16.bin"), (rows, K)).double()
    torch.testing.assert_close(yb, yb_want, rtol=2 ** -8, atol=1e-7)
    assert torch.equal(yb.bfloat16().double(), yb), "y_bf16 is not a bf16 value"
    dy_sum = dy.double().sum((0, 2))  # the parts and the group's rows, added
    torch.testing.assert_close(_read(str(tmp_path / "dx_fused.bin"), (rows, K)).double(),
                               _l2norm_grad_f64(x, dy_sum, eps), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_read(str(tmp_path / "dx_fused_bf16.bin"), (rows, K)).double(),
                               _l2norm_grad_f64(xb, dy_sum, eps), rtol=1e-5, atol=1e-5)
    dy0 = dy.reshape(-1)[: rows * K].view(rows, K)
    torch.testing.assert_close(_read(str(tmp_path / "dx.bin"), (rows, K)).double(),
                               _l2norm_grad_f64(x, dy0, eps), rtol=1e-5, atol=1e-5)
