"""`import rlx_torch` explains a missing or stale extension instead of failing obscurely."""

import subprocess
import sys
import textwrap

import pytest


def _import_with(setup: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(setup) + "\nimport rlx_torch\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_import_ok():
    r = _import_with("")
    assert r.returncode == 0, r.stderr


def test_torch_version_mismatch_names_the_fix():
    r = _import_with(
        """
        import sys, types
        sys.modules["rlx_torch._build_info"] = types.SimpleNamespace(TORCH_VERSION="1.0.0")
        """
    )
    assert r.returncode != 0
    assert "built against torch 1.0.0" in r.stderr
    assert "--no-build-isolation" in r.stderr


def test_missing_extension_names_the_fix():
    # A meta-path finder that hides rlx_torch._C, as if it had never been built.
    r = _import_with(
        """
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "rlx_torch._C":
                    raise ImportError("No module named 'rlx_torch._C'")
        sys.meta_path.insert(0, Hide())
        """
    )
    assert r.returncode != 0
    assert "rlx_torch._C could not be loaded" in r.stderr
    assert "--no-build-isolation" in r.stderr


@pytest.mark.parametrize("name", ["ops", "nn", "optim"])
def test_subpackages_exported(name):
    import rlx_torch

    assert hasattr(rlx_torch, name)
