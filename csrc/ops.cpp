// Every rlx op schema, in one place. Backends register kernels with
// TORCH_LIBRARY_IMPL(rlx, <CPU|MPS|CUDA>, m) in csrc/<backend>/; Python registers the
// fake (meta) kernels and the autograd wrappers in rlx_torch/ops/.
#include <Python.h>
#include <torch/library.h>

// `import rlx_torch._C` only needs to load this shared object so that the static
// TORCH_LIBRARY initializers run; the module itself is empty (no pybind11).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(rlx, m) {
  // ---- codebook matmul (csrc/cpu/codebook.cpp) ----

  // ---- gated delta rule (csrc/cpu/gated_delta.cpp) ----
}
