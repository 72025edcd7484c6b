"""Bridges to other libraries' models and checkpoints (``aqlm``: AQLM checkpoints)."""
