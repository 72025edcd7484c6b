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
  // Contract (shapes, dtypes, masked outputs): rlx_torch/ops/codebook.py.
  m.def(
      "codebook_matmul(Tensor x, Tensor indices, Tensor codebook, Tensor? scales, Tensor? bias)"
      " -> Tensor");
  m.def(
      "codebook_matmul_backward(Tensor grad_out, Tensor x, Tensor indices, Tensor codebook,"
      " Tensor? scales, bool[4] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // 16-bit codes, one codebook, reordered once per weight for the CPU forward (layout:
  // csrc/cpu/codebook_packed.h); codebook_matmul_packed(x, packed, indices, ...) equals
  // codebook_matmul(x, indices, ...) for packed = codebook_pack_indices(indices, E).
  m.def(
      "codebook_pack_indices(Tensor indices, int num_entries, int slice_entries=0,"
      " int block_rows=0) -> Tensor");
  m.def(
      "codebook_matmul_packed(Tensor x, Tensor packed, Tensor indices, Tensor codebook,"
      " Tensor? scales, Tensor? bias) -> Tensor");

  // ---- gated delta rule (csrc/cpu/gated_delta_{forward,backward}.cpp, gated_delta.cpp) ----
  // Contract (shapes, dtypes, checkpoints): rlx_torch/ops/gated_delta.py; packed layouts:
  // csrc/include/rlx/gdn_backward_layout.h. Returns (o, final_state, checkpoints, vw), vw the
  // per-token v - S^T k that the CPU backward would otherwise recompute (empty when not kept).
  // l2norm_eps: q and k are L2-normalized over K inside the op (fla's use_qk_l2norm_in_kernel);
  // the backward then returns the gradients of the raw q and k.
  m.def(
      "gated_delta_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale,"
      " Tensor? initial_state, Tensor? cu_seqlens, int chunk_size=64, float? l2norm_eps=None)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
  // Returns the packed gradient buffer (GdnBackwardLayout): dq, dk, dv, dg, dbeta, dstate.
  // vw: the forward's fourth output (None or empty: recomputed).
  m.def(
      "gated_delta_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale,"
      " Tensor? initial_state, Tensor? cu_seqlens, Tensor checkpoints, Tensor grad_o,"
      " Tensor? grad_final_state, int chunk_size=64, float? l2norm_eps=None,"
      " Tensor? vw=None) -> Tensor");
  m.def(
      "gated_delta_bwd_layout(int batch, int seq_len, int num_qk_heads, int num_v_heads,"
      " int head_k_dim, int head_v_dim, int num_states, bool gate_per_channel,"
      " bool has_initial_state) -> int[]");
  m.def("gated_delta_checkpoint_slots(int num_seqs, int total_tokens, int chunk_size) -> int");
  // fla's l2norm over the last dim, y = x / sqrt(sum(x^2) + eps); returns (y, rstd) with rstd
  // [x.shape[:-1]] in the accumulation dtype. The backward takes x and rstd, returns dx.
  m.def("gated_delta_l2norm_fwd(Tensor x, float eps) -> (Tensor, Tensor)");
  m.def("gated_delta_l2norm_bwd(Tensor grad_y, Tensor x, Tensor rstd) -> Tensor");

  // ---- Newton–Schulz products of Muon (csrc/cpu/symmetric_matmul.cpp) ----
  // bf16 [N, m, k] a, b; out = upper triangle of (beta * c + alpha * a @ b^T + diag * I),
  // mirrored. transposed: a, b are [N, k, m] and the product is a^T @ b.
  m.def(
      "symmetric_matmul(Tensor a, Tensor b, Tensor? c, float alpha, float beta,"
      " bool transposed=False, float diag=0.0) -> Tensor");
  // The same written into out (contiguous bf16 [N, m, m], sharing no memory with a, b or c);
  // returns nothing, so that torch.compile can functionalize it.
  m.def(
      "symmetric_matmul_out(Tensor a, Tensor b, Tensor? c, float alpha, float beta,"
      " bool transposed, float diag, Tensor(a!) out) -> ()");
  // Whether this CPU runs symmetric_matmul natively (AVX512-BF16); else it is a fallback.
  m.def("symmetric_matmul_is_native() -> bool");
  // The whole bf16 Newton–Schulz iteration of Muon for wide X [N, m, n] (m <= n, multiples
  // of 32), one (a, b, c) per step (csrc/cpu/newton_schulz_amx.cpp); returns the new X.
  m.def("newton_schulz_amx(Tensor X, float[] coefficients) -> Tensor");
  // Whether this CPU runs newton_schulz_amx on AMX tiles; else it is a bmm fallback.
  m.def("newton_schulz_amx_is_native() -> bool");
  // ---- fused elementwise parts of a Muon step (csrc/cpu/muon_update.cpp) ----
  // Updates bufs (momentum), returns the normalized NS input [matrices, rows, cols] in dtype;
  // transposed: each matrix written as its transpose, [matrices, cols, rows].
  m.def(
      "muon_ns_input(Tensor[] grads, Tensor(a!)[] bufs, int rows, int cols, float momentum,"
      " bool nesterov, float eps, float safety, ScalarType dtype, bool transposed=False)"
      " -> Tensor");
  // params <- (1 - lr * weight_decay) * params - lr * scale * ortho (matrix by matrix); ortho
  // [matrices, rows, cols] contiguous, or the transposed view of a contiguous
  // [matrices, cols, rows].
  m.def(
      "muon_apply_(Tensor(a!)[] params, Tensor ortho, float lr, float weight_decay,"
      " float scale) -> ()");
  // ---- CPU features (csrc/cpu/cpu_isa.cpp) ----
  // The CPU kernels' copy this process runs: "avx2" or "baseline" (RLX_CPU_ISA=baseline).
  m.def("_cpu_isa() -> str");
}
