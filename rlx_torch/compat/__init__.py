"""Drop-in replacements for other libraries' functional APIs (``rlx_torch.compat.fla``)."""
