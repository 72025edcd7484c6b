import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import rlx_torch  # noqa: F401  (fails loudly if the extension is not built)

# scripts/ci_arm64.sh runs the CPU tests under qemu, where generating examples takes longer
# than hypothesis' health check allows; every example is still checked the same way.
settings.register_profile("emulated", suppress_health_check=[HealthCheck.too_slow], deadline=None)
if os.environ.get("RLX_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["RLX_HYPOTHESIS_PROFILE"])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
