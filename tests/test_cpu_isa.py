"""CPU features at run time (csrc/cpu/cpu_isa.h): the extension's baseline is plain x86-64 (or
arm64), and the CPU kernels' AVX2+FMA copies (AVX-512 ones for the codebook forward and the
gated delta rule) are picked once per process.

* rlx::_cpu_isa reports the copy, RLX_CPU_ISA=baseline or =avx2 caps it;
* each lower copy gives the default copy's results (the copies differ only in vector width,
  FMA contraction and the order of independent sums, so float32 results agree to rounding
  and float64 ones more tightly) for every CPU kernel, run in a child process against the
  results of another; on an AVX-512 CPU this compares the AVX-512 copy with the AVX2 and the
  baseline ones, on an AVX2 CPU the AVX2 copy with the baseline one;
* in the built library, every function with AVX instructions belongs to an AVX2 or AVX-512
  copy (namespaces isa_avx2, isa_avx512), to symmetric_matmul's AVX512 path
  (isa_avx512bf16) or to newton_schulz_amx's AMX path (isa_amx): no inline function of torch
  or the standard library, nothing run before the dispatch, was compiled for AVX2 (objdump),
  and 512-bit registers appear only in isa_avx512, isa_avx512bf16 and isa_amx functions.
"""

import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import rlx_torch  # noqa: F401  (registers torch.ops.rlx)

X86 = platform.machine() in ("x86_64", "AMD64")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _run_child(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=900)


AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def _best_isa() -> str:
    """The copy this CPU should get by default (Linux: from /proc/cpuinfo)."""
    if not X86:
        return "baseline"  # no AVX2 copy off x86-64
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        return "baseline"
    return "avx512" if AVX512 <= flags else "avx2"


# The copies below the default one (each a value of RLX_CPU_ISA), best first.
ORDER = ("avx512", "avx2", "baseline")


def _lower_isas() -> list[str]:
    return list(ORDER[ORDER.index(_best_isa()) + 1:])


def test_cpu_isa_reports_and_forces_the_copy():
    isa = torch.ops.rlx._cpu_isa()
    assert isa in ORDER
    forced = os.environ.get("RLX_CPU_ISA")
    if forced in ORDER:
        assert ORDER.index(isa) >= ORDER.index(forced)
    elif sys.platform.startswith("linux") or not X86:
        assert isa == _best_isa()
    for cap in ("baseline", "avx2"):
        child = _run_child("import torch, rlx_torch; print(torch.ops.rlx._cpu_isa())",
                           {"RLX_CPU_ISA": cap})
        assert child.returncode == 0, child.stderr
        # a cap never raises the choice above what the CPU has
        expected = cap if ORDER.index(cap) >= ORDER.index(_best_isa()) else _best_isa()
        assert child.stdout.strip() == expected


# Every CPU kernel of the extension on seeded inputs (odd sizes), in both dtypes that take
# different code (float32 and float64 accumulation) where the op has both; the results are
# saved with torch.save to the path in sys.argv[1].
KERNELS = textwrap.dedent("""
    import sys
    import torch
    import rlx_torch  # noqa: F401
    ops = torch.ops.rlx
    torch.manual_seed(0)
    out = {"isa": ops._cpu_isa()}
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        acc = torch.float64 if dt == torch.float64 else torch.float32
        B, T, H, K, V = 2, 67, 2, 40, 24
        # unit q, k rows: with beta <= 1 the recurrence is then stable (raw rows of norm ~6
        # make it grow without bound, and any rounding difference with it)
        q = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dt)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1).to(dt)
        v = torch.randn(B, T, H, V).to(dt)
        beta = torch.rand(B, T, H, dtype=acc)
        for name, g in (("head", -torch.rand(B, T, H, dtype=acc)),
                        ("channel", -torch.rand(B, T, H, K, dtype=acc))):
            for eps in (None, 1e-6):
                h0 = torch.randn(B, H, K, V, dtype=acc)
                o, ht, ck, vw = ops.gated_delta_fwd(q, k, v, g, beta, K ** -0.5, h0, None, 16,
                                                    eps)
                do = torch.randn_like(o)
                dht = torch.randn_like(ht)
                key = f"gdn_{dt}_{name}_{eps}"
                out[key + "_fwd"] = (o, ht, ck, vw)
                out[key + "_bwd"] = ops.gated_delta_bwd(q, k, v, g, beta, K ** -0.5, h0, None,
                                                        ck, do, dht, 16, eps, vw)
                import os
                os.environ["RLX_GDN_RECURRENT_BACKWARD"] = "1"
                out[key + "_bwd_rec"] = ops.gated_delta_bwd(q, k, v, g, beta, K ** -0.5, h0,
                                                            None, ck, do, dht, 16, eps, vw)
                del os.environ["RLX_GDN_RECURRENT_BACKWARD"]
        x = torch.randn(37, 48).to(dt)
        y, rstd = ops.gated_delta_l2norm_fwd(x, 1e-6)
        out[f"l2norm_{dt}"] = (y, rstd, ops.gated_delta_l2norm_bwd(torch.randn_like(x), x, rstd))
        for rows in (1, 5, 300):
            for index_dtype, entries in ((torch.uint8, 256), (torch.int16, 300)):
                N, Kin, M, D = 24, 32, 2, 8
                x = torch.randn(rows, Kin).to(dt)
                idx = torch.randint(0, entries, (N, Kin // D, M), dtype=torch.int64)
                idx = idx.to(index_dtype)
                cb = torch.randn(M, entries, D).to(dt)
                s, b = torch.rand(N).to(dt), torch.randn(N).to(dt)
                o = ops.codebook_matmul(x, idx, cb, s, b)
                grads = ops.codebook_matmul_backward(torch.randn_like(o), x, idx, cb, s,
                                                     [True, True, True, True])
                out[f"codebook_{dt}_{rows}_{index_dtype}"] = (o, grads)
        # the float16/bfloat16 codebook gather (1x16 layout, 16-bit codes): its one-row
        # kernel, the batch tiles (the AVX-512 copy's pair kernel), an odd group count
        if dt == torch.float32:
            for rows in (1, 2, 7, 16):
                N, Kin, D = 70, 9 * 8, 8
                x = torch.randn(rows, Kin)
                idx = torch.randint(-32768, 32768, (N, Kin // D), dtype=torch.int16)
                cb = torch.randn(65536, D)
                for cdt in (torch.float16, torch.bfloat16):
                    out[f"codebook_half_gather_{rows}_{cdt}"] = ops.codebook_matmul(
                        x, idx, cb.to(cdt), torch.rand(N), torch.randn(N))
        # the lookup-table forward's tile shapes (1, 8, 16, 32 rows a tile), full and short
        # tables, output rows past the 16-row tiles, table blocks with a short last one
        for rows in (1, 2, 16, 40):
            for entries in (256, 100):
                N, Kin, M, D = 53, 296, 2, 8
                x = torch.randn(rows, Kin).to(dt)
                idx = torch.randint(0, entries, (N, Kin // D, M), dtype=torch.uint8)
                cb = torch.randn(M, entries, D).to(dt)
                out[f"codebook_lut_{dt}_{rows}_{entries}"] = ops.codebook_matmul(
                    x, idx, cb, torch.rand(N).to(dt), None)
        # the one-row forward (codebook_one_row.h) past its 512-row chunks, with several
        # 64-step work items, 8-step blocks and their < 8-step tails: the AVX2 copy's asm
        # gather, the AVX-512 copy's permutes and the baseline's scalar loop
        for rows in (1, 2):
            for entries, M in ((256, 1), (100, 3)):
                N, Kin, D = 1030, 133 * 4, 4
                x = torch.randn(rows, Kin).to(dt)
                idx = torch.randint(0, entries, (N, Kin // D, M), dtype=torch.uint8)
                cb = torch.randn(M, entries, D).to(dt)
                out[f"codebook_one_row_{dt}_{rows}_{entries}"] = ops.codebook_matmul(
                    x, idx, cb, torch.rand(N).to(dt), torch.randn(N).to(dt))
    grads = [torch.randn(6, 10), torch.randn(6, 10)]
    bufs = [torch.randn(6, 10), torch.randn(6, 10)]
    x = ops.muon_ns_input(grads, bufs, 6, 10, 0.95, True, 1e-7, 1.0, torch.float32)
    params = [torch.randn(6, 10), torch.randn(6, 10)]
    ops.muon_apply_(params, torch.randn(2, 6, 10).bfloat16(), 0.02, 0.1, 1.3)
    out["muon"] = (x, bufs, params)
    torch.save(out, sys.argv[1])
""")


def _flatten(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flatten(item)]
    return []


def _kernel_results(tmp_path, isa: str | None) -> dict:
    path = tmp_path / f"{isa or 'default'}.pt"
    env = dict(os.environ)
    env.pop("RLX_CPU_ISA", None)
    if isa is not None:
        env["RLX_CPU_ISA"] = isa
    child = subprocess.run([sys.executable, "-c", KERNELS, str(path)], env=env,
                           capture_output=True, text=True, timeout=900)
    assert child.returncode == 0, child.stderr
    return torch.load(path)


@pytest.mark.parametrize("lower", ["avx2", "baseline"])
def test_lower_copy_matches_the_default_one(tmp_path, lower):
    if lower not in _lower_isas():
        pytest.skip(f"the default copy here is {_best_isa()}: no {lower} copy below it")
    default, base = _kernel_results(tmp_path, None), _kernel_results(tmp_path, lower)
    assert default["isa"] == _best_isa() and base["isa"] == lower
    assert default.keys() == base.keys() and len(default) > 40
    for key in default:
        if key == "isa":
            continue
        a, b = _flatten(default[key]), _flatten(base[key])
        assert len(a) == len(b) and a, key
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x.dtype == y.dtype and x.shape == y.shape, (key, i)
            if x.dtype == torch.float64:
                tol = dict(rtol=1e-10, atol=1e-10)
            elif x.dtype == torch.bfloat16:  # one rounding to bf16 may flip the last bit
                tol = dict(rtol=1e-2, atol=1e-2)
            else:
                tol = dict(rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(x.double(), y.double(), **tol, msg=f"{key}[{i}]")


def _library() -> str:
    return importlib.import_module("rlx_torch._C").__file__


# AT&T syntax: a VEX/EVEX instruction is a "v..." mnemonic on xmm/ymm/zmm registers, or
# vzeroupper; a plain SSE instruction never names ymm or zmm.
_FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")
_VEX = re.compile(r"^\s*[0-9a-f]+:\s+(vzeroupper|v[a-z0-9]+\s.*%[xyz]mm|.*%[yz]mm)")
_ZMM = re.compile(r"%zmm|%k[0-7]")
_ALLOWED = ("isa_avx2::", "isa_avx512::", "isa_avx512bf16::", "isa_amx::")
_ALLOWED_512 = ("isa_avx512::", "isa_avx512bf16::", "isa_amx::")


def _functions_with_avx(lib: str) -> tuple[dict[str, int], set[str]]:
    """Functions with VEX/EVEX code (instruction counts), and those with 512-bit or mask
    registers."""
    proc = subprocess.Popen(["objdump", "-d", "--no-show-raw-insn", "-C", lib],
                            stdout=subprocess.PIPE, text=True, errors="replace")
    found: dict[str, int] = {}
    wide: set[str] = set()
    function = None
    for line in proc.stdout:
        m = _FUNCTION.match(line)
        if m:
            function = m.group(1)
        elif function is not None and _VEX.match(line):
            found[function] = found.get(function, 0) + 1
            if _ZMM.search(line):
                wide.add(function)
    assert proc.wait() == 0
    return found, wide


@pytest.mark.skipif(not (X86 and sys.platform.startswith("linux")),
                    reason="checks x86-64 machine code of an ELF library")
def test_only_the_avx2_copies_have_avx_code():
    if shutil.which("objdump") is None:
        pytest.fail("objdump (binutils) is needed: apt-get install binutils")
    found, wide = _functions_with_avx(_library())
    # the test sees the copies' code at all: the AVX2 gated delta and codebook kernels, and
    # the AVX-512 codebook forward's permute lookups and gated delta kernels
    assert any("isa_avx2::gdn_" in f for f in found), sorted(found)[:20]
    assert any("isa_avx2::" in f and "codebook" in f for f in found), sorted(found)[:20]
    if X86:
        assert any("isa_avx512::" in f and "codebook" in f for f in wide), sorted(wide)[:20]
        assert any("isa_avx512::gdn_" in f for f in wide), sorted(wide)[:20]
    outside = sorted(f for f in found if not any(a in f for a in _ALLOWED))
    assert not outside, f"AVX code outside the AVX2 copies: {outside[:20]}"
    outside = sorted(f for f in wide if not any(a in f for a in _ALLOWED_512))
    assert not outside, f"AVX-512 code outside the AVX-512 copies: {outside[:20]}"
