"""The CPU Newton–Schulz layouts and kernel choices: tall batches iterated in their wide form,
and the product paths a Xeon with AMX or a CPU with the symmetric kernel switched off takes,
against float64 math."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlx_torch.optim import Muon, newton_schulz, resolve_schedule
from tests.ns_reference import KELLER, reference_ns

ns_module = importlib.import_module("rlx_torch.optim.newton_schulz")
features_module = importlib.import_module("rlx_torch.optim.cpu_features")
muon_module = importlib.import_module("rlx_torch.optim.muon")

# Relative Frobenius error of the result against the float64 iteration per dtype: bf16
# products round each step's iterate to 8 bits (the error measured is about 1e-2).
BOUND = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 5e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def references(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    return torch.stack([reference_ns(m.double(), [KELLER] * steps) for m in G])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 40, 8), (2, 17, 16), (1, 64, 12)])
@pytest.mark.parametrize("wide", [True, False])
def test_tall_batches_match_float64_in_either_layout(monkeypatch, dtype, shape, wide):
    monkeypatch.setattr(ns_module, "WIDE_ON_CPU", wide)
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)),
                    dtype=torch.float64)
    G = G if dtype == torch.float64 else G.float()  # float64 math needs a float64 norm
    schedule = resolve_schedule("keller", 5)
    ref = references(G)
    for method in ("standard", "gram") if dtype != torch.bfloat16 else ("standard",):
        out = newton_schulz(G, schedule, 1e-7, dtype, method=method)
        assert out.shape == G.shape and out.dtype == dtype
        assert rel_err(out, ref) < BOUND[dtype], (method, rel_err(out, ref))
        # Callers take .contiguous() (the fused apply needs it): same values.
        torch.testing.assert_close(out.contiguous(), out, rtol=0, atol=0)


def test_wide_form_of_a_tall_batch_is_the_transposed_iteration(monkeypatch):
    # bf16 on CPU through bmm iterates tall batches as Xᵀ: the result is exactly
    # newton_schulz(Xᵀ)ᵀ, bit for bit (normalized inputs: no norm summed in another order).
    if ns_module.symmetric_kernel_pays():
        pytest.skip("the symmetric kernel reads tall batches in place")
    X = torch.randn(4, 48, 16, dtype=torch.float32)
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    schedule = resolve_schedule("polar_express", 5)
    assert ns_module.iterates_wide(X.shape, X.device, torch.bfloat16)
    assert not ns_module.iterates_wide(X.shape, X.device, torch.float32)
    tall = newton_schulz(X, schedule, 1e-7, torch.bfloat16, normalized=True)
    wide = newton_schulz(X.mT.contiguous(), schedule, 1e-7, torch.bfloat16, normalized=True)
    torch.testing.assert_close(tall, wide.mT, rtol=0, atol=0)
    seen = []  # what the iteration ran on: the contiguous wide form
    iterate = ns_module._iterate
    monkeypatch.setattr(ns_module, "_iterate", lambda X, *a: seen.append(
        (tuple(X.shape), X.is_contiguous(), a[1])) or iterate(X, *a))
    newton_schulz(X, schedule, 1e-7, torch.bfloat16, normalized=True)
    assert seen == [((4, 16, 48), True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
# (40, 18): whole 16 x 16 tiles of the transposing loops and tails in both directions
@pytest.mark.parametrize("rows, cols", [(24, 8), (40, 18)])
def test_fused_ops_transposed_layouts(dtype, nesterov, rows, cols):
    # muon_ns_input(transposed=True) writes each matrix as its transpose, and muon_apply_
    # reads a transposed view in place: both bit for bit the contiguous ops.
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(2, rows, cols, generator=gen), torch.randn(rows, cols, generator=gen)]
    bufs = [torch.randn(g.shape, generator=gen) for g in grads]
    out = {}
    for transposed in (False, True):
        b = [x.clone() for x in bufs]
        out[transposed] = torch.ops.rlx.muon_ns_input(grads, b, rows, cols, 0.9, nesterov, 1e-7,
                                                      1.02, dtype, transposed)
        out[transposed, "bufs"] = b
    assert out[True].shape == (3, cols, rows)
    torch.library.opcheck(torch.ops.rlx.muon_ns_input.default,
                          ([g.clone() for g in grads], [b.clone() for b in bufs], rows, cols, 0.9,
                           nesterov, 1e-7, 1.02, dtype, True))
    assert torch.equal(out[True], out[False].mT.contiguous())
    for b0, b1 in zip(out[False, "bufs"], out[True, "bufs"], strict=True):
        assert torch.equal(b0, b1)
    ortho = out[True]  # [3, cols, rows]: the update of [rows, cols] matrices, stored transposed
    params = {}
    for view in ("transposed", "contiguous"):
        params[view] = [x.clone() for x in grads]
        o = ortho.mT if view == "transposed" else ortho.mT.contiguous()
        torch.ops.rlx.muon_apply_(params[view], o, 0.1, 0.01, 1.5)
    torch.library.opcheck(torch.ops.rlx.muon_apply_.default,
                          ([x.clone() for x in grads], ortho.mT, 0.1, 0.01, 1.5))
    for a, b in zip(params["transposed"], params["contiguous"], strict=True):
        assert torch.equal(a, b)
    expected = grads[1] * (1 - 0.1 * 0.01) - 0.1 * 1.5 * ortho[2].mT.float()
    torch.testing.assert_close(params["transposed"][1], expected)
    with pytest.raises(RuntimeError, match="transpose of a contiguous"):
        strided = torch.randn(3, 48, 8)[:, ::2]  # [3, 24, 8], every other row
        torch.ops.rlx.muon_apply_([x.clone() for x in grads], strided, 0.1, 0.0, 1.0)


def test_normalized_input_is_not_written_in_the_wide_form():
    X = torch.randn(2, 32, 8)
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    before = X.clone()
    out = newton_schulz(X, resolve_schedule("keller", 5), 1e-7, torch.bfloat16, normalized=True)
    assert torch.equal(X, before) and out.data_ptr() != X.data_ptr()
    assert rel_err(out, references(X.double())) < BOUND[torch.bfloat16]


def gpt_like_params(d: int = 16, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(d, d), (d, d), (4 * d, d), (d, 4 * d), (4 * d, d)]:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02)
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    return params


def step_error(ns_dtype) -> float:
    """Relative error of one default-settings Muon step against the float64 step."""
    moved = {}
    for dtype in (ns_dtype, torch.float64):
        params = gpt_like_params()
        start = [p.detach().clone() for p in params]
        Muon(params, lr=0.1, weight_decay=0.1, ns_dtype=dtype).step()
        moved[dtype] = torch.cat([(p.detach() - s).double().flatten()
                                  for p, s in zip(params, start, strict=True)])
    return ((moved[ns_dtype] - moved[torch.float64]).norm() / moved[torch.float64].norm()).item()


def test_xeon_like_path_default_step_is_accurate(monkeypatch):
    # A Xeon with AMX: bf16 is the default NS dtype, and its products are plain bmm calls
    # (never the symmetric kernel) on the wide form of the tall matrices.
    amx = features_module.CpuFeatures(model="x", arch="x86_64", avx2=True, avx512=True,
                                      avx512_bf16=True, amx=True, neon=False, arm_bf16=False)
    monkeypatch.setattr(features_module, "cpu_features", lambda: amx)
    monkeypatch.setattr(muon_module, "native_bf16", features_module.native_bf16)
    features_module.symmetric_kernel_pays.cache_clear()
    try:
        assert muon_module.default_ns_dtype(torch.device("cpu"), torch.float32) == torch.bfloat16
        assert not ns_module._Products.for_batch(torch.empty(1, 8, 2), torch.bfloat16).native
        assert step_error(None) < BOUND[torch.bfloat16]
    finally:
        features_module.symmetric_kernel_pays.cache_clear()


def test_symmetric_kernel_switched_off_by_environment():
    # RLX_NO_AVX512_BF16=1 (read once per process): the bmm path on any CPU, as on a Xeon
    # with AMX, with bf16 and float32 NS both within their error of float64.
    code = textwrap.dedent("""
        import torch
        from rlx_torch.optim.cpu_features import cpu_features, symmetric_kernel_pays
        from tests.test_newton_schulz_layout import BOUND, step_error
        assert not symmetric_kernel_pays() and not cpu_features().avx512_bf16
        assert not torch.ops.rlx.symmetric_matmul_is_native()
        for dtype in (torch.bfloat16, torch.float32):
            err = step_error(dtype)
            assert err < BOUND[dtype] if dtype == torch.bfloat16 else err < 1e-4, (dtype, err)
        print("ok")
    """)
    env = dict(os.environ, RLX_NO_AVX512_BF16="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
