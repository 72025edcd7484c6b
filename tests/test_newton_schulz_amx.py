"""rlx::newton_schulz_amx (csrc/cpu/newton_schulz_amx.cpp): Muon's whole bf16 Newton–Schulz
iteration in one op, on AMX tiles where the CPU has them, a float32 bmm fallback elsewhere.

Both paths are held to a float64 reference written from the math with the op's roundings
(each product rounded to bf16 once); the fallback runs in a child process with RLX_NO_AMX=1.
"""

import importlib
import os
import platform
import subprocess
import sys

import pytest
import torch

import rlx_torch  # noqa: F401  (registers torch.ops.rlx)
from rlx_torch.ops.newton_schulz_amx import newton_schulz_amx

ns_module = importlib.import_module("rlx_torch.optim.newton_schulz")
KELLER = (3.4445, -4.7750, 2.0315)


def reference(X: torch.Tensor, steps) -> torch.Tensor:
    """The iteration in float64, each product rounded to bf16 as the op rounds it."""
    x = X.double()
    eye = torch.eye(X.shape[-2], dtype=torch.float64)
    for a, b, c in steps:
        A = (x @ x.mT).bfloat16().double()
        P = (c * (A @ A) + b * A + a * eye).bfloat16().double()
        x = (P @ x).bfloat16().double()
    return x


def normalized(N, m, n, seed=0):
    G = torch.randn(N, m, n, generator=torch.Generator().manual_seed(seed))
    return (G / G.norm(dim=(-2, -1), keepdim=True)).bfloat16()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(1, 32, 32), (3, 32, 96), (2, 64, 64), (2, 96, 160),
                                   (1, 256, 256), (1, 64, 1024)])
def test_one_step_matches_the_reference(shape):
    # One step: only the summation order differs from the reference (float32 sums against
    # float64 ones), which moves a few values across a bf16 rounding boundary.
    X = normalized(*shape)
    out = torch.ops.rlx.newton_schulz_amx(X, list(KELLER))
    assert out.dtype == torch.bfloat16 and out.shape == X.shape and out.is_contiguous()
    assert rel(out, reference(X, [KELLER])) < 2e-3


@pytest.mark.parametrize("preset", ["keller", "polar_express"])
def test_five_steps_match_the_reference_and_orthogonalize(preset):
    schedule = ns_module.resolve_schedule(preset, 5)
    X = normalized(4, 64, 160, seed=1) / schedule.safety
    out = newton_schulz_amx(X, schedule.coefficients)
    assert rel(out, reference(X, schedule.coefficients)) < 3e-2
    S = torch.linalg.svdvals(out.float())
    assert bool((S > 0.5).all() and (S < 1.5).all()), S


def test_matrices_of_a_batch_are_independent_and_the_input_is_kept():
    X = normalized(5, 32, 64, seed=2)
    X[2] = float("nan")
    before = X.clone()
    out = torch.ops.rlx.newton_schulz_amx(X, list(KELLER) * 2)
    assert torch.equal(X.view(torch.int16), before.view(torch.int16))  # NaN-safe equality
    assert torch.isnan(out[2]).all()
    assert torch.isfinite(out[[0, 1, 3, 4]]).all()
    for i in (0, 4):
        alone = torch.ops.rlx.newton_schulz_amx(X[i:i + 1].contiguous(), list(KELLER) * 2)
        assert torch.equal(out[i:i + 1], alone)


def test_non_contiguous_input_and_empty_batch():
    X = normalized(2, 64, 32, seed=3).mT  # [2, 32, 64], not contiguous
    out = torch.ops.rlx.newton_schulz_amx(X, list(KELLER))
    assert torch.equal(out, torch.ops.rlx.newton_schulz_amx(X.contiguous(), list(KELLER)))
    empty = torch.ops.rlx.newton_schulz_amx(torch.empty(0, 32, 64, dtype=torch.bfloat16),
                                            list(KELLER))
    assert empty.shape == (0, 32, 64)
    same = torch.ops.rlx.newton_schulz_amx(X, [])  # no steps: X itself, in a new tensor
    assert torch.equal(same, X.contiguous()) and same.data_ptr() != X.data_ptr()


@pytest.mark.parametrize("make, message", [
    (lambda: (torch.randn(2, 32, 64), list(KELLER)), "bfloat16"),
    (lambda: (torch.randn(32, 64).bfloat16(), list(KELLER)), r"\[N, m, n\]"),
    (lambda: (torch.randn(1, 64, 32).bfloat16(), list(KELLER)), "wide"),
    (lambda: (torch.randn(1, 32, 48).bfloat16(), list(KELLER)), "multiples of 32"),
    (lambda: (torch.randn(1, 32, 64).bfloat16(), [1.0, 2.0]), "coefficients"),
])
def test_bad_input_raises_naming_the_argument(make, message):
    X, coefficients = make()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.rlx.newton_schulz_amx(X, coefficients)


def test_opcheck():
    X = normalized(2, 32, 64, seed=4)
    torch.library.opcheck(torch.ops.rlx.newton_schulz_amx.default, (X, list(KELLER) * 2))


def test_is_native_matches_the_cpu_flags():
    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("needs /proc/cpuinfo to know the CPU's flags")
    flags = open("/proc/cpuinfo").read().split()
    # Under user-mode emulation (the arm64 tests) /proc/cpuinfo is the x86-64 host's.
    expected = (platform.machine() == "x86_64" and sys.platform.startswith("linux")
                and all(f in flags for f in ("amx_tile", "amx_bf16", "avx512_bf16")))
    assert torch.ops.rlx.newton_schulz_amx_is_native() == expected


def test_fallback_gives_the_same_contract():
    # RLX_NO_AMX=1 (read once per process) forces the bmm fallback.
    code = (
        "import torch, rlx_torch\n"
        "from tests.test_newton_schulz_amx import KELLER, normalized, reference, rel\n"
        "assert not torch.ops.rlx.newton_schulz_amx_is_native()\n"
        "X = normalized(3, 64, 96, seed=5)\n"
        "out = torch.ops.rlx.newton_schulz_amx(X, list(KELLER))\n"
        "assert out.dtype == torch.bfloat16 and out.shape == X.shape\n"
        "assert rel(out, reference(X, [KELLER])) < 2e-3\n"
        "torch.save(out, __import__('sys').argv[1])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_file = os.path.join(root, "build", "newton_schulz_amx_fallback.pt")
    os.makedirs(os.path.dirname(out_file), exist_ok=True)
    env = dict(os.environ, RLX_NO_AMX="1", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code, out_file], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fallback = torch.load(out_file)
    here = torch.ops.rlx.newton_schulz_amx(normalized(3, 64, 96, seed=5), list(KELLER))
    assert rel(here, fallback) < 2e-3


def test_newton_schulz_takes_the_op_where_amx_pays():
    schedule = ns_module.resolve_schedule("keller", 5)
    cpu = torch.device("cpu")
    assert ns_module.uses_amx((256, 1024), cpu, torch.bfloat16) == \
        torch.ops.rlx.newton_schulz_amx_is_native()
    # sides not multiples of 32, tall, or too large for one core's caches
    for shape in [(256, 48), (48, 64), (64, 32), (512, 1024)]:
        assert not ns_module.uses_amx(shape, cpu, torch.bfloat16)
    assert not ns_module.uses_amx((256, 1024), cpu, torch.float32)
    X = normalized(2, 64, 128, seed=6)
    out = ns_module.newton_schulz(X, schedule, 1e-7, torch.bfloat16, normalized=True)
    if ns_module.uses_amx(X.shape, cpu, torch.bfloat16):
        expected = newton_schulz_amx(X, schedule.coefficients)
        assert torch.equal(out, expected)
        assert rel(out, reference(X, schedule.coefficients)) < 3e-2
    else:
        # The other routes round to bf16 at other points than the op (torch's bf16 bmm and
        # baddbmm: A @ A and b A + c A^2 separately); over 5 steps that alone moves the
        # result by 2-4% (two float64 references rounding at those two sets of points differ
        # by 2.3%). A wrong step count is off by over 30%.
        assert rel(out, reference(X, schedule.coefficients)) < 6e-2
