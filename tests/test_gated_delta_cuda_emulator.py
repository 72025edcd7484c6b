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
    env = dict(os.environ, **({"RLX_EMU_DOUBLE": "1"} if real == "float64" else {}))
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
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_emulated_chunked_forward_matches_cpu(case, chunk_emulator, tmp_path):
    """The chunked kernels (bf16 products, as on the GPU for bf16 inputs) against the CPU op on
    the same bf16-rounded q, k, v in float32: o, final state, the checkpoints and vw."""
    c = dict(state=False, cu=None, chunk=64, narrow=False, g_scale=None)
    c.update(CHUNK_CASES[case])
    B, T, H, HV, K, V = (c[n] for n in ("B", "T", "H", "HV", "K", "V"))
    gen = torch.Generator().manual_seed(1)
    bf = lambda t: t.bfloat16().float()  # noqa: E731
    q = bf(torch.randn(B, T, H, K, generator=gen))
    k = bf(F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1))
    v = bf(torch.randn(B, T, HV, V, generator=gen))
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0)
    if c["g_scale"] is not None:  # down to -g_scale per step: exp of cumsums would overflow
        g = -c["g_scale"] * torch.rand(B, T, HV, generator=gen)
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
    env = dict(os.environ, **({"RLX_EMU_NARROW": "1"} if c["narrow"] else {}))
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    o, ht, ckpt, vw = torch.ops.rlx.gated_delta_fwd(q, k, v, g, beta, scale, h0, cu, chunk, None)
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
