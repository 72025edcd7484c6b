import pytest
import torch

import rlx_torch  # noqa: F401  (fails loudly if the extension is not built)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
