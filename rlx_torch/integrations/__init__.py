"""Bridges to other libraries' models: ``rlx_torch.integrations.transformers`` runs Hugging Face
transformers' gated-delta / KDA model families on rlx_torch's kernels.

The submodules import their library only when they are imported themselves, so
``import rlx_torch`` never needs transformers.
"""

__all__: list[str] = []
