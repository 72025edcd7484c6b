"""The public API's conventions, checked by walking it: every public module has a docstring
and ``__all__``; every public callable has type hints and a docstring with an example;
docs/index.md names every public symbol; the signatures that follow a convention (nn.Linear,
fla) keep following it (Muon's: tests/test_muon_reliability.py); production code never
imports the test oracle.

The examples are run as doctests. Public: ``rlx_torch`` and every submodule whose dotted path
has no part starting with "_"; its symbols are the names in ``__all__`` defined by rlx_torch;
a public class's methods are those it defines without a leading underscore, plus
``__init__``. A method overriding one of a base class from outside rlx_torch (``forward``,
``step``, ``extra_repr``, ...) keeps that base's documented contract: it needs type hints, not
its own example.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest
import torch

import rlx_torch

ROOT = pathlib.Path(rlx_torch.__file__).resolve().parent
INDEX = ROOT.parent / "docs" / "index.md"


def public_modules():
    names = ["rlx_torch"]
    for info in pkgutil.walk_packages(rlx_torch.__path__, "rlx_torch."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:  # an optional dependency (transformers): the module says so
            if "rlx_torch" in str(e):
                raise
    return sorted(modules, key=lambda m: (m.__name__.count("."), m.__name__))


MODULES = public_modules()


def public_symbols():
    """``{object id: (dotted path, object)}``, each object under its shortest public path."""
    found = {}
    for module in MODULES:
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or id(obj) in found:
                continue
            if not getattr(obj, "__module__", "").startswith("rlx_torch"):
                continue  # a constant or a re-exported torch object
            found[id(obj)] = (f"{module.__name__}.{name}", obj)
    return list(found.values())


SYMBOLS = public_symbols()
CALLABLES = [(path, obj) for path, obj in SYMBOLS if callable(obj)]


def _overrides_foreign_base(cls, name):
    return any(name in vars(base) for base in cls.__mro__[1:]
               if not base.__module__.startswith("rlx_torch") and base is not object)


def _generated_init(cls):
    return dataclasses.is_dataclass(cls) or issubclass(cls, tuple)


def functions_to_check():
    """``(dotted path, function, needs its own example)`` for every public callable."""
    out = []
    for path, obj in CALLABLES:
        if not inspect.isclass(obj):
            out.append((path, obj, True))
            continue
        if not _generated_init(obj) and "__init__" in vars(obj):
            out.append((f"{path}.__init__", obj.__init__, False))  # the class shows the call
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                out.append((f"{path}.{name}", member, not _overrides_foreign_base(obj, name)))
    return out


FUNCTIONS = functions_to_check()


def test_the_walk_finds_the_api():
    paths = {path for path, _ in SYMBOLS}
    for expected in ("rlx_torch.codebook_matmul", "rlx_torch.gated_delta_rule",
                     "rlx_torch.nn.CodebookLinear", "rlx_torch.nn.GatedDeltaNet",
                     "rlx_torch.optim.Muon", "rlx_torch.quant.dequantize",
                     "rlx_torch.compat.fla.chunk_gated_delta_rule"):
        assert expected in paths
    assert len(FUNCTIONS) > 60


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_module_has_docstring_and_all(module):
    assert (module.__doc__ or "").strip(), f"{module.__name__} has no docstring"
    assert hasattr(module, "__all__"), f"{module.__name__} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{module.__name__}.__all__ names missing attributes {missing}"


@pytest.mark.parametrize("path,fn,own_example", FUNCTIONS, ids=[f[0] for f in FUNCTIONS])
def test_callable_has_type_hints(path, fn, own_example):
    sig = inspect.signature(fn)
    unannotated = [p.name for p in sig.parameters.values()
                   if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    assert not unannotated, f"{path}: parameters without a type hint: {unannotated}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{path}: no return type hint"


@pytest.mark.parametrize("path,obj", CALLABLES, ids=[c[0] for c in CALLABLES])
def test_public_symbol_has_docstring_with_example(path, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{path} has no docstring"
    assert ">>>" in doc, f"{path}'s docstring has no example (>>>)"


@pytest.mark.parametrize("path,fn", [(p, f) for p, f, own in FUNCTIONS
                                     if own and not p.endswith(".__init__")],
                         ids=[p for p, _, own in FUNCTIONS if own and not p.endswith(".__init__")])
def test_method_has_docstring_with_example(path, fn):
    doc = inspect.getdoc(fn) or ""
    assert ">>>" in doc, f"{path} has no docstring with an example (>>>)"


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    """The examples run and print what they say (those needing a checkpoint, a download or a
    process group are marked ``doctest: +SKIP``)."""
    globs = {"torch": torch, "rlx_torch": rlx_torch, "nn": torch.nn}
    result = doctest.testmod(module, extraglobs=globs, report=False,
                             optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {module.__name__}'s examples failed"


def test_docs_index_names_every_public_symbol():
    text = INDEX.read_text()
    missing = [path for path, _ in SYMBOLS if f"`{path}`" not in text]
    assert not missing, f"docs/index.md does not list {missing}"


def test_tests_readme_maps_every_source_module_to_existing_tests():
    """tests/README.md: every module of the package (and the benchmark harness) has a row, and
    every test module a row names exists."""
    tests = pathlib.Path(__file__).resolve().parent
    table = dict(re.findall(r"^\| `([^`]+\.py)` \| (.+) \|$", (tests / "README.md").read_text(),
                            re.M))
    sources = {str(f.relative_to(ROOT.parent)) for f in ROOT.rglob("*.py")}
    sources = (sources - {"rlx_torch/_build_info.py"}) | {"benchmarks/_timing.py"}
    assert sorted(sources - table.keys()) == [], "modules without a row in tests/README.md"
    named = {m for row in table.values() for m in re.findall(r"`(test_\w+\.py)`", row)}
    assert named and sorted(m for m in named if not (tests / m).exists()) == []


def test_production_code_never_imports_the_reference():
    """ops/reference.py is the tests' oracle: no module of the package imports it."""
    offenders = []
    for file in ROOT.rglob("*.py"):
        if file.name == "reference.py":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module or ''}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(re.search(r"(^|\.)reference($|\.)", n) for n in names):
                offenders.append(str(file.relative_to(ROOT)))
    assert not offenders, f"these modules import ops/reference.py: {offenders}"


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def test_codebook_linear_signature_is_nn_linear_s():
    params = _params(rlx_torch.nn.CodebookLinear.__init__)[1:]
    assert [(p.name, p.kind) for p in params[:3]] == [
        ("in_features", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("out_features", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("bias", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    assert params[2].default is True
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    # (the calls themselves: tests/test_codebook_linear.py::test_constructor_is_like_nn_linear)


def test_gated_delta_rule_options_are_keyword_only():
    params = _params(rlx_torch.gated_delta_rule)
    assert [p.name for p in params[:5]] == ["q", "k", "v", "g", "beta"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:5])
    assert params[5:] and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[5:])
    q = k = torch.randn(1, 3, 1, 4)
    v, g, beta = torch.randn(1, 3, 1, 2), torch.zeros(1, 3, 1), torch.rand(1, 3, 1)
    with pytest.raises(TypeError):
        rlx_torch.gated_delta_rule(q, k, v, g, beta, 0.5)


# fla-org/flash-linear-attention, fla/layers/gated_deltanet.py: GatedDeltaNet's arguments.
FLA_GATED_DELTANET = {"hidden_size": 2048, "expand_v": 2, "head_dim": 256, "num_heads": 6,
                      "num_v_heads": None, "mode": "chunk", "use_gate": True,
                      "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4,
                      "conv_bias": False, "layer_idx": None, "norm_eps": 1e-5}
FLA_GATED_DELTANET_FORWARD = ["hidden_states", "attention_mask", "past_key_values", "use_cache",
                              "output_attentions"]


def test_gated_deltanet_takes_fla_s_arguments():
    params = {p.name: p for p in _params(rlx_torch.nn.GatedDeltaNet.__init__)[1:]}
    for name, default in FLA_GATED_DELTANET.items():
        assert name in params, f"GatedDeltaNet has no argument {name}"
        assert params[name].default == default, name
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY
               for name, p in params.items() if name != "hidden_size")
    forward = [p.name for p in _params(rlx_torch.nn.GatedDeltaNet.forward)[1:]]
    assert forward[:len(FLA_GATED_DELTANET_FORWARD)] == FLA_GATED_DELTANET_FORWARD

