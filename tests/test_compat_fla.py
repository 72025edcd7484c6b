"""rlx_torch.compat.fla against fla itself: fla-core 0.6.0's naive references and gate functions
and its public signatures, read at test time from the fla-core wheel (never imported as a
package: its __init__ needs triton). Everything else fla accepts must raise, naming the
argument."""

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rlx_torch.compat.fla as cfla
from rlx_torch.compat.fla import (
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)

FLA_VERSION = "0.6.0"
WHEEL_DIR = Path(os.environ.get("RLX_FLA_WHEEL_DIR",
                                Path(__file__).resolve().parents[1] / ".cache" / "fla-core"))


def _wheel() -> Path | None:
    found = sorted(WHEEL_DIR.glob(f"fla_core-{FLA_VERSION}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--disable-pip-version-check", f"fla-core=={FLA_VERSION}", "-d",
                        str(WHEEL_DIR)], capture_output=True, timeout=300, check=False)
        found = sorted(WHEEL_DIR.glob(f"fla_core-{FLA_VERSION}-*.whl"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def fla(tmp_path_factory):
    """fla's naive references, gate references and function signatures, from its wheel."""
    pytest.importorskip("einops")  # imported by fla's naive.py files
    wheel = _wheel()
    if wheel is None:
        pytest.skip(f"fla-core=={FLA_VERSION} wheel cannot be downloaded")
    root = tmp_path_factory.mktemp("fla")
    ns = types.SimpleNamespace(signatures={})
    with zipfile.ZipFile(wheel) as zf:
        for name in ("gated_delta_rule", "kda"):
            path = root / f"{name}_naive.py"
            path.write_text(zf.read(f"fla/ops/{name}/naive.py").decode())
            spec = importlib.util.spec_from_file_location(f"fla_naive_{name}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            setattr(ns, f"{name}_naive", module)
            # gate.py imports triton: take only its plain-PyTorch naive_* functions.
            tree = ast.parse(zf.read(f"fla/ops/{name}/gate.py").decode())
            defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                    and n.name.startswith("naive_")]
            scope = {"torch": torch, "F": F}
            exec(compile(ast.Module(body=defs, type_ignores=[]), f"fla/ops/{name}/gate.py",
                         "exec"), scope)
            for d in defs:
                setattr(ns, d.name, scope[d.name])
            for file in ("chunk", "fused_recurrent"):
                tree = ast.parse(zf.read(f"fla/ops/{name}/{file}.py").decode())
                for n in tree.body:
                    if isinstance(n, ast.FunctionDef) and not n.name.endswith(("_fwd", "_bwd")):
                        ns.signatures[n.name] = [a.arg for a in n.args.args]
    return ns


def l2n(x):  # fla's l2norm
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def fla_kda(fla, q, k, v, g, beta, scale=None, h0=None, cu=None, l2norm=False):
    """fla's naive_recurrent_kda, per sequence for cu_seqlens; g [B, T, HV, K]."""
    if l2norm:
        q, k = l2n(q.float()), l2n(k.float())
    run = fla.kda_naive.naive_recurrent_kda
    if cu is None:
        return run(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        o, s = run(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale=scale,
                   initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def fla_gdn(fla, q, k, v, g, beta, scale=None, h0=None, cu=None, l2norm=False):
    """fla's naive_recurrent_gated_delta_rule (H = HV, so GVA repeats q/k), per sequence."""
    G = v.shape[2] // q.shape[2]
    if l2norm:
        q, k = l2n(q.float()), l2n(k.float())
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    run = fla.gated_delta_rule_naive.naive_recurrent_gated_delta_rule
    if cu is None:
        return run(q, k, v, beta, g, scale=scale, initial_state=h0, output_final_state=True)
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        o, s = run(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], g[:, a:b], scale=scale,
                   initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True)
        outs.append(o)
        states.append(s)
    return torch.cat(outs, 1), torch.cat(states)


def close(a, b, tol=2e-5):
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def inputs(B=2, T=37, H=2, HV=4, K=6, V=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2)
    gk = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 2)
    beta = torch.rand(B, T, HV, generator=gen)
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return q, k, v, g, gk, beta, h0


CU = torch.tensor([0, 5, 5, 21, 37])


def test_signatures_and_module_paths_match_fla(fla):
    from rlx_torch.compat.fla.ops import gated_delta_rule as gdr
    from rlx_torch.compat.fla.ops import kda
    ours = {"chunk_gated_delta_rule": gdr.chunk_gated_delta_rule,
            "fused_recurrent_gated_delta_rule": gdr.fused_recurrent_gated_delta_rule,
            "chunk_kda": kda.chunk_kda, "fused_recurrent_kda": kda.fused_recurrent_kda}
    for name, fn in ours.items():
        positional = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == fla.signatures[name], name
    kw_only = {"chunk_gated_delta_rule": {"use_gate_in_kernel", "A_log", "dt_bias", "chunk_size"},
               "chunk_kda": {"A_log", "dt_bias", "chunk_size"}}
    for name, names in kw_only.items():  # read from **kwargs by fla
        params = inspect.signature(ours[name]).parameters
        assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names), name
    assert gdr.chunk_gdn is gdr.chunk_gated_delta_rule is cfla.chunk_gated_delta_rule
    assert gdr.fused_recurrent_gdn is gdr.fused_recurrent_gated_delta_rule
    assert cfla.ops.kda.fused_recurrent_kda is fused_recurrent_kda


@pytest.mark.parametrize("case", ["plain", "gva_state_scale", "l2norm_varlen_int32",
                                  "state_v_first", "transpose_state_layout", "gate_in_kernel",
                                  "beta_sigmoid_neg"])
def test_chunk_gated_delta_rule_matches_fla(fla, case):
    q, k, v, g, _, beta, h0 = inputs(B=1 if "varlen" in case else 2)
    kw, ref_kw = {}, {}
    cu = None
    if case == "gva_state_scale":
        kw, ref_kw = dict(scale=0.3, h0=h0), dict(scale=0.3, h0=h0)
    if case == "l2norm_varlen_int32":
        cu, h0 = CU, torch.randn(4, *h0.shape[1:])
        q = q * 3
        kw = dict(cu_seqlens=CU.to(torch.int32), use_qk_l2norm_in_kernel=True, h0=h0)
        ref_kw = dict(cu=cu, l2norm=True, h0=h0)
    if case in ("state_v_first", "transpose_state_layout"):
        kw = {case: True, "h0": h0.transpose(-1, -2)}
        ref_kw = dict(h0=h0)
    a_log = dt_bias = None
    if case == "gate_in_kernel":
        a_log, dt_bias = torch.rand(4) * 2, torch.randn(4)
        kw = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
        ref_g = fla.naive_gdn_gate(g, a_log, dt_bias)
    if case == "beta_sigmoid_neg":
        kw = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    h0_kw = kw.pop("h0", None)
    ctx = pytest.warns(DeprecationWarning) if case == "transpose_state_layout" else _null()
    with ctx:
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0_kw,
                                       output_final_state=True, **kw)
    ref_g = ref_g if case == "gate_in_kernel" else g
    ref_beta = 2 * beta.sigmoid() if case == "beta_sigmoid_neg" else beta
    ref_kw.setdefault("h0", None)
    ro, rht = fla_gdn(fla, q, k, v, ref_g, ref_beta, scale=ref_kw.get("scale"),
                      h0=ref_kw["h0"], cu=cu, l2norm=ref_kw.get("l2norm", False))
    close(o, ro)
    close(ht.transpose(-1, -2) if case in ("state_v_first", "transpose_state_layout") else ht,
          rht)


def test_chunk_gated_delta_rule_matches_fla_chunked_reference(fla):
    q, k, v, g, _, beta, h0 = inputs(HV=2, T=70)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    ro, rht = fla.gated_delta_rule_naive.naive_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True)
    close(o, ro)
    close(ht, rht)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("gates", ["g", "gk", "g_gk", "gv", "g_gk_gv", "beta_v", "none",
                                   "gate_in_kernel_gk"])
def test_fused_recurrent_gated_delta_rule_matches_fla(fla, gates):
    q, k, v, g, gk, beta, h0 = inputs(HV=2 if gates == "none" else 4)
    B, T, HV, V = v.shape
    gv = F.logsigmoid(torch.randn(B, T, HV, V) + 2)
    beta_v = torch.rand(B, T, HV, V)
    kw = {"g": g} if "g" in gates.split("_") else {}
    if "gk" in gates:
        kw["gk"] = gk
    if "gv" in gates:
        kw["gv"] = gv
    ref_g = g if "g" in gates.split("_") else None
    if gates == "gate_in_kernel_gk":
        a_log, dt_bias = torch.rand(HV), torch.randn(HV)
        kw.update(g=g, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
        ref_g = fla.naive_gdn_gate(g, a_log, dt_bias)
    b = beta_v if gates == "beta_v" else (None if gates == "none" else beta)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, beta=b, initial_state=h0,
                                             output_final_state=True, **kw)
    key_gate = torch.zeros(B, T, HV, q.shape[-1])
    if ref_g is not None:
        key_gate = key_gate + ref_g[..., None]
    if "gk" in gates:
        key_gate = key_gate + gk
    if "gv" not in gates and gates != "beta_v":
        rb = torch.ones(B, T, HV) if b is None else b
        ro, rht = fla_kda(fla, q, k, v, key_gate, rb, h0=h0)
    else:  # fla's kernel decays column j by exp(gk + gv_j) with step beta_j: one column at a time
        cols = [fla_kda(fla, q, k, v[..., j:j + 1],
                        key_gate + (gv[..., j:j + 1] if "gv" in gates else 0),
                        b[..., j] if b.dim() == 4 else b, h0=h0[..., j:j + 1])
                for j in range(V)]
        ro, rht = torch.cat([c[0] for c in cols], -1), torch.cat([c[1] for c in cols], -1)
    close(o, ro)
    close(ht, rht)


@pytest.mark.parametrize("gate", ["log", "softplus", "lower_bound", "lower_bound_no_a_log",
                                  "safe_gate"])
def test_chunk_kda_matches_fla(fla, gate):
    q, k, v, _, gk, beta, h0 = inputs()
    HV, K = v.shape[2], q.shape[-1]
    raw = torch.randn_like(gk)
    a_log, dt_bias = torch.rand(HV), torch.randn(HV * K)
    kw, ref_g = {}, gk
    if gate == "log":
        g_in = gk
    else:
        g_in = raw
        kw = dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
    if gate == "softplus":
        ref_g = fla.naive_kda_gate(raw, a_log, dt_bias)
    if gate in ("lower_bound", "safe_gate"):
        kw.update(lower_bound=-3.0, safe_gate=gate == "safe_gate")
        ref_g = fla.naive_kda_lowerbound_gate(raw, a_log, dt_bias, lower_bound=-3.0)
    if gate == "lower_bound_no_a_log":
        kw.update(lower_bound=-3.0, A_log=None)
        ref_g = fla.naive_kda_lowerbound_gate(raw, None, dt_bias, lower_bound=-3.0)
    o, ht = chunk_kda(q, k, v, g_in, beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, **kw)
    ro, rht = fla_kda(fla, q, k, v, ref_g, beta, h0=h0, l2norm=True)
    close(o, ro)
    close(ht, rht)


def test_chunk_kda_varlen_state_layout_and_naive_chunk(fla):
    q, k, v, _, gk, beta, _ = inputs(B=1)
    h0 = torch.randn(4, v.shape[2], v.shape[3], q.shape[3])  # [N, HV, V, K]
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o, ht = chunk_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=CU.to(torch.int32), transpose_state_layout=True,
                          use_graph=True, max_num_seqs=4, disable_recompute=True)
    ro, rht = fla_kda(fla, q, k, v, gk, beta, h0=h0.transpose(-1, -2).contiguous(), cu=CU)
    close(o, ro)
    close(ht.transpose(-1, -2), rht)
    q, k, v, _, gk, beta, h0 = inputs(T=64)
    o, ht = chunk_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True)
    ro, rht = fla.kda_naive.naive_chunk_kda(q, k, v, gk, beta, initial_state=h0,
                                            output_final_state=True, chunk_size=32)
    close(o, ro)
    close(ht, rht)


@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_kda_intermediate_states(fla, varlen):
    q, k, v, _, gk, beta, h0 = inputs(B=1 if varlen else 2, T=37)
    cu = CU if varlen else None
    h0 = torch.randn(4, *h0.shape[1:]) if varlen else h0
    with torch.inference_mode():
        o, ht, h = chunk_kda(q, k, v, gk, beta, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu, return_intermediate_states=True, chunk_size=32)
    bounds = (list(zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)) if varlen else
              [(0, 37)])
    expected = []
    for b in range(q.shape[0]):
        for n, (a, e) in enumerate(bounds):
            seq = n if varlen else b
            for start in range(a, e, 32):  # the state before each chunk of 32 tokens
                if start == a:
                    expected.append(h0[seq])
                    continue
                _, s = fla_kda(fla, *(t[b:b + 1, a:start] for t in (q, k, v, gk, beta)),
                               h0=h0[seq:seq + 1])
                expected.append(s[0])
    assert h.shape == (1 if varlen else 2, len(expected) // (1 if varlen else 2), 4, 6, 5)
    close(h.reshape(-1, 4, 6, 5), torch.stack(expected))


@pytest.mark.parametrize("gate", ["log", "softplus", "lower_bound_no_a_log", "beta_v"])
def test_fused_recurrent_kda_matches_fla(fla, gate):
    q, k, v, _, gk, beta, h0 = inputs()
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    raw = torch.randn_like(gk)
    a_log, dt_bias = torch.rand(HV), torch.randn(HV * K)
    if gate == "log" or gate == "beta_v":
        g_in, kw, ref_g = gk, {}, gk
    elif gate == "softplus":
        g_in, kw = raw, dict(use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
        ref_g = fla.naive_kda_gate(raw, a_log, dt_bias)
    else:
        g_in, kw = raw, dict(use_gate_in_kernel=True, dt_bias=dt_bias, lower_bound=-2.0)
        ref_g = fla.naive_kda_lowerbound_gate(raw, None, dt_bias, lower_bound=-2.0)
    b = torch.rand(*v.shape) if gate == "beta_v" else beta
    o, ht = fused_recurrent_kda(q, k, v, g_in, b, initial_state=h0.transpose(-1, -2),
                                output_final_state=True, state_v_first=True, **kw)
    if gate == "beta_v":
        cols = [fla_kda(fla, q, k, v[..., j:j + 1], gk, b[..., j], h0=h0[..., j:j + 1])
                for j in range(V)]
        ro, rht = torch.cat([c[0] for c in cols], -1), torch.cat([c[1] for c in cols], -1)
    else:
        ro, rht = fla_kda(fla, q, k, v, ref_g, b, h0=h0)
    close(o, ro)
    close(ht.transpose(-1, -2), rht)


def test_gradients_match_autograd_through_fla(fla):
    """fla's naive code is plain PyTorch: its autograd gradients are the reference."""
    q, k, v, _, gk, beta, h0 = inputs(B=1, T=23)
    HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
    raw = torch.randn_like(gk)
    gv = F.logsigmoid(torch.randn(*v.shape) + 2)
    a_log, dt_bias = torch.rand(HV), torch.randn(HV * K)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, raw, gv, beta, h0, a_log, dt_bias)]

    def ours(q, k, v, raw, gv, beta, h0, a_log, dt_bias):
        o1, s1 = chunk_kda(q, k, v, raw, beta, initial_state=h0, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
                           dt_bias=dt_bias, lower_bound=-4.0)
        o2, s2 = fused_recurrent_gated_delta_rule(q, k, v, gk=o1.new_zeros(gk.shape) - 0.1,
                                                  gv=gv, beta=beta, initial_state=h0,
                                                  output_final_state=True)
        return (o1 * o2).sum() + (s1 * s2).sum()

    def ref(q, k, v, raw, gv, beta, h0, a_log, dt_bias):
        g = fla.naive_kda_lowerbound_gate(raw, a_log, dt_bias, lower_bound=-4.0)
        o1, s1 = fla_kda(fla, q, k, v, g, beta, h0=h0, l2norm=True)
        cols = [fla_kda(fla, q, k, v[..., j:j + 1], torch.zeros_like(g) - 0.1 + gv[..., j:j + 1],
                        beta, h0=h0[..., j:j + 1]) for j in range(V)]
        o2, s2 = torch.cat([c[0] for c in cols], -1), torch.cat([c[1] for c in cols], -1)
        return (o1 * o2).sum() + (s1 * s2).sum()

    mine = torch.autograd.grad(ours(*leaves), leaves)
    theirs = torch.autograd.grad(ref(*leaves), leaves)
    for name, a, b in zip("q k v g gv beta h0 A_log dt_bias".split(), mine, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=name)


def test_every_rejected_argument_names_itself():
    q, k, v, g, gk, beta, h0 = inputs()
    cases = [
        (ValueError, "chunk_size", lambda: chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)),
        (ValueError, "chunk_size", lambda: chunk_kda(q, k, v, gk, beta, chunk_size=16)),
        (ValueError, "lower_bound", lambda: chunk_kda(q, k, v, gk, beta, use_gate_in_kernel=True,
                                                      A_log=torch.zeros(4), safe_gate=True)),
        (ValueError, "lower_bound", lambda: chunk_kda(q, k, v, gk, beta, use_gate_in_kernel=True,
                                                      safe_gate=True, lower_bound=-6.0)),
        (ValueError, "A_log", lambda: chunk_kda(q, k, v, gk, beta, use_gate_in_kernel=True)),
        (ValueError, "A_log", lambda: chunk_gated_delta_rule(q, k, v, g, beta,
                                                             use_gate_in_kernel=True)),
        (ValueError, "A_log", lambda: fused_recurrent_kda(q, k, v, gk, beta,
                                                          use_gate_in_kernel=True)),
        (ValueError, "`g`", lambda: fused_recurrent_gated_delta_rule(
            q, k, v, beta=beta, use_gate_in_kernel=True, A_log=torch.zeros(4))),
        (ValueError, "allow_neg_eigval", lambda: chunk_kda(q, k, v, gk, beta,
                                                           allow_neg_eigval=True)),
        (NotImplementedError, "cp_context", lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, cp_context=object())),
        (TypeError, "not_an_option", lambda: chunk_kda(q, k, v, gk, beta, not_an_option=1)),
        (DeprecationWarning, "head_first", lambda: fused_recurrent_kda(q, k, v, gk, beta,
                                                                       head_first=False)),
        (ValueError, "transpose_state_layout", lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)),
        (ValueError, "beta=None", lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g)),
        (ValueError, "g must have shape", lambda: chunk_gated_delta_rule(q, k, v, gk, beta)),
        (ValueError, "g must have shape", lambda: chunk_kda(q, k, v, g, beta)),
        (ValueError, "beta must have shape", lambda: chunk_kda(q, k, v, gk, beta[..., :2])),
        (ValueError, "gv must have shape", lambda: fused_recurrent_gated_delta_rule(
            q, k, v, beta=beta, gv=gk)),
        (ValueError, "same shape", lambda: chunk_gated_delta_rule(q, k[:, :, :1], v, g, beta)),
        (ValueError, "evenly divisible", lambda: chunk_kda(q, k, v[:, :, :3], gk[:, :, :3],
                                                           beta[:, :, :3])),
        (ValueError, "batch size is expected to be 1", lambda: chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=CU)),
        (ValueError, "number of initial states", lambda: chunk_kda(
            q[:1], k[:1], v[:1], gk[:1], beta[:1], initial_state=h0, cu_seqlens=CU)),
        (ValueError, "cu_seqlens must be an int32 or int64", lambda: chunk_kda(
            q[:1], k[:1], v[:1], gk[:1], beta[:1], cu_seqlens=CU.float())),
        (ValueError, "inference mode", lambda: chunk_kda(q, k, v, gk, beta,
                                                         return_intermediate_states=True)),
        (ValueError, "max_num_seqs", lambda: chunk_kda(q[:1], k[:1], v[:1], gk[:1], beta[:1],
                                                       cu_seqlens=CU, use_graph=True,
                                                       max_num_seqs=6)),
    ]
    for error, text, call in cases:
        with pytest.raises(error, match=text):
            call()


def test_fla_knobs_that_change_nothing_are_accepted():
    q, k, v, g, gk, beta, _ = inputs(B=1)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    for kw in (dict(chunk_size=16), dict(cu_seqlens_cpu=CU), dict(chunk_indices=torch.zeros(1))):
        torch.testing.assert_close(chunk_gated_delta_rule(q, k, v, g, beta, **kw)[0], o)
    o, _ = chunk_kda(q, k, v, gk, beta)
    for kw in (dict(disable_recompute=True), dict(chunk_size=32), dict(use_graph=True),
               dict(safe_gate=True)):
        torch.testing.assert_close(chunk_kda(q, k, v, gk, beta, **kw)[0], o)
