"""Plain-PyTorch references for every rlx op: the test oracle, the docs' definition, and a
fallback that runs anywhere autograd does. Written for clarity, not speed."""

import torch  # noqa: F401

# ---- codebook matmul ----

# ---- gated delta rule ----
