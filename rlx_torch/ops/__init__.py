"""Public op entry points (each module registers its fake kernels and autograd wrappers)."""
