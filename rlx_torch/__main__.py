"""``python -m rlx_torch`` runs the demo (same flags as ``python -m rlx_torch.demo``)."""

from .demo import main

main()
