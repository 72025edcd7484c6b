"""Loads the compiled extension, explaining what to do when it is missing or stale."""

import torch

_FIX = (
    "Rebuild it against the torch you have: `pip install --no-build-isolation .` "
    "from the rlx_torch source tree (or `bash scripts/test.sh`, which sets everything up)."
)


def load_extension():
    try:
        from . import _build_info
    except ImportError:
        _build_info = None
    if _build_info is not None and _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"rlx_torch._C was built against torch {_build_info.TORCH_VERSION}, "
            f"but torch {torch.__version__} is installed. {_FIX}"
        )
    try:
        from . import _C  # noqa: F401  (loading it registers the torch.ops.rlx.* kernels)
    except ImportError as e:
        raise ImportError(f"rlx_torch._C could not be loaded ({e}). {_FIX}") from e
