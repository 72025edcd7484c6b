// Launch plans of the codebook matmul Metal kernels (csrc/mps/kernels/codebook.metal), shared
// by the host code (csrc/mps/codebook.mm) and the emulator tests. Plain C++17.
//
// Buffer slots:
//   codebook_mv / codebook_mm:   0 x, 1 indices, 2 codebook, 3 scales, 4 bias, 5 out, 6 params
//   codebook_dx_mv / _dx_mm:     0 grad_out, 1 indices, 2 codebook, 3 scales, 4 grad_x, 5 params
//   codebook_dcodebook_partial:  0 grad_out, 1 x, 2 indices, 3 scales, 4 partials, 5 params
//   codebook_dcodebook_reduce:   0 partials, 1 grad_codebook, 2 params
//   codebook_dscale_dbias:       0 grad_out, 1 y (float32 [B, N]), 2 grad_scales, 3 grad_bias,
//                                4 params
//   codebook_dcodebook_sorted:   0 grad_out, 1 x, 2 sorted keys (uint32), 3 their positions
//   (codebook_sorted.metal)      (uint32), 4 scales, 5 grad_codebook, 6 params
// 16-bit indices (index_bytes 2) take the "_u16" variants of the forward and grad_x kernels
// and codebook_dcodebook_sorted for grad_codebook.
// Absent optional tensors are bound to any valid buffer (the flags keep them unread).
//
// max_threads: the smallest maxTotalThreadsPerThreadgroup of the pipelines a plan may pick
// (codebook_*_kernels() name them). A pipeline may allow fewer than the 128/256 threads the
// kernels prefer; the plans then take fewer simdgroups, or the matrix-vector kernels in place
// of the 256-thread tiled ones (which any batch size can use).
#pragma once

#include <cstdint>

#include "rlx/mps_codebook_params.h"
#include "rlx/mps_launch.h"

namespace rlx::mps {

enum class CodebookDtype { Float32 = 0, Float16 = 1, BFloat16 = 2 };

struct CodebookShape {
  int64_t rows = 0, in_features = 0, out_features = 0, groups = 0;
  int64_t num_codebooks = 1, num_entries = 1, entry_dim = 1;
  bool has_scales = false, has_bias = false;
  CodebookDtype dtype = CodebookDtype::Float32;
  int64_t index_bytes = 1;  // 1: uint8 indices, 2: int16/uint16 (read as ushort)
};

struct CodebookPlan {
  Launch launch;
  CodebookParams params{};
};

constexpr uint32_t kCodebookRowsPerSimd = 4;     // codebook.metal kRowsPerSimd
constexpr uint32_t kCodebookMvSimdgroups = 4;    // simdgroups per matrix-vector threadgroup
constexpr uint32_t kCodebookTile = 32;           // codebook.metal kTile
constexpr uint32_t kCodebookTileThreads = 256;   // 16 x 16 threads, 2 x 2 outputs each
constexpr uint32_t kCodebookTChunk = 8;          // codebook.metal kTChunk
constexpr uint32_t kCodebookStageBytes = 16384;  // stage the codebook when it fits in this
constexpr int64_t kCodebookMvMaxRows = 16;       // batch rows up to which the mat-vec paths run
constexpr int64_t kCodebookLutScanMaxRows = 32;  // dcodebook: per-row code scans below this
constexpr uint32_t kCodebookMaxGroupBlocks = 128;  // dcodebook partials

// Every index the kernels compute fits in 32 bits.
inline bool codebook_shape_fits(const CodebookShape& s) {
  const int64_t lim = int64_t(UINT32_MAX);
  return s.rows * s.in_features < lim && s.rows * s.out_features < lim &&
         s.out_features * s.groups * s.num_codebooks < lim &&
         s.num_codebooks * s.num_entries * s.entry_dim < lim && s.in_features < lim;
}

inline const char* codebook_kernel(const char* const names[3], CodebookDtype t) {
  return names[int(t)];
}

// names[0..2] for uint8 indices, names[3..5] for 16-bit ones.
inline const char* codebook_kernel(const char* const names[6], const CodebookShape& s) {
  return names[(s.index_bytes == 2 ? 3 : 0) + int(s.dtype)];
}

inline CodebookParams codebook_params(const CodebookShape& s) {
  CodebookParams p{};
  p.rows = uint32_t(s.rows);
  p.in_features = uint32_t(s.in_features);
  p.out_features = uint32_t(s.out_features);
  p.groups = uint32_t(s.groups);
  p.num_codebooks = uint32_t(s.num_codebooks);
  p.num_entries = uint32_t(s.num_entries);
  p.entry_dim = uint32_t(s.entry_dim);
  p.has_scales = s.has_scales;
  p.has_bias = s.has_bias;
  const uint64_t cb_bytes = uint64_t(s.num_codebooks * s.num_entries * s.entry_dim) * 4;
  p.codebook_in_tg = cb_bytes <= kCodebookStageBytes;
  return p;
}

inline uint32_t codebook_stage_bytes(const CodebookParams& p) {
  // A kernel's [[threadgroup(i)]] must get some memory even when the codebook is not staged.
  return p.codebook_in_tg
             ? threadgroup_bytes(uint64_t(p.num_codebooks) * p.num_entries * p.entry_dim * 4)
             : 16;
}

inline bool codebook_use_matvec(const CodebookShape& s, uint32_t max_threads) {
  return s.rows <= kCodebookMvMaxRows || max_threads < kCodebookTileThreads;
}

// Threads per threadgroup: `want`, or the most whole simdgroups max_threads allows.
inline uint32_t codebook_threads(uint32_t want, uint32_t max_threads) {
  const uint32_t fit = max_threads / kSimdWidth * kSimdWidth;
  return fit < kSimdWidth ? kSimdWidth : (want < fit ? want : fit);
}

struct CodebookKernels {
  const char* matvec;
  const char* tiled;
};

inline CodebookKernels codebook_forward_kernels(const CodebookShape& s, bool float_out) {
  static const char* const mv_names[6] = {"codebook_mv_f32",     "codebook_mv_f16",
                                          "codebook_mv_bf16",    "codebook_mv_u16_f32",
                                          "codebook_mv_u16_f16", "codebook_mv_u16_bf16"};
  static const char* const mv_y[6] = {"codebook_mv_f32",          "codebook_mv_f16_yf32",
                                      "codebook_mv_bf16_yf32",    "codebook_mv_u16_f32",
                                      "codebook_mv_u16_f16_yf32", "codebook_mv_u16_bf16_yf32"};
  static const char* const mm_names[6] = {"codebook_mm_f32",     "codebook_mm_f16",
                                          "codebook_mm_bf16",    "codebook_mm_u16_f32",
                                          "codebook_mm_u16_f16", "codebook_mm_u16_bf16"};
  static const char* const mm_y[6] = {"codebook_mm_f32",          "codebook_mm_f16_yf32",
                                      "codebook_mm_bf16_yf32",    "codebook_mm_u16_f32",
                                      "codebook_mm_u16_f16_yf32", "codebook_mm_u16_bf16_yf32"};
  return {codebook_kernel(float_out ? mv_y : mv_names, s),
          codebook_kernel(float_out ? mm_y : mm_names, s)};
}

inline CodebookKernels codebook_dx_kernels(const CodebookShape& s) {
  static const char* const mv_names[6] = {"codebook_dx_mv_f32",     "codebook_dx_mv_f16",
                                          "codebook_dx_mv_bf16",    "codebook_dx_mv_u16_f32",
                                          "codebook_dx_mv_u16_f16", "codebook_dx_mv_u16_bf16"};
  static const char* const mm_names[6] = {"codebook_dx_mm_f32",     "codebook_dx_mm_f16",
                                          "codebook_dx_mm_bf16",    "codebook_dx_mm_u16_f32",
                                          "codebook_dx_mm_u16_f16", "codebook_dx_mm_u16_bf16"};
  return {codebook_kernel(mv_names, s), codebook_kernel(mm_names, s)};
}

// The tiled (large-batch) kernels: one threadgroup per kCodebookTile x kCodebookTile output
// tile of [rows, cols], two padded tiles of staging memory plus the staged codebook.
inline void set_tiled_launch(Launch& l, int64_t cols, int64_t rows, const CodebookParams& p) {
  l.threadgroups = {ceil_div(uint64_t(cols), kCodebookTile), ceil_div(uint64_t(rows), kCodebookTile),
                    1};
  l.threads = {kCodebookTileThreads, 1, 1};
  const uint32_t tile = threadgroup_bytes(kCodebookTile * (kCodebookTile + 1) * 4);
  l.threadgroup_memory[0] = tile;
  l.threadgroup_memory[1] = tile;
  l.threadgroup_memory[2] = codebook_stage_bytes(p);
  l.n_threadgroup_memory = 3;
}

// Forward: out = scales * (x @ W^T) + bias. float_out: float32 output (the grad_scales
// recomputation of the unscaled product; then has_scales/has_bias are cleared).
inline CodebookPlan plan_codebook_forward(const CodebookShape& s, bool float_out = false,
                                          uint32_t max_threads = kMaxThreadsPerThreadgroup) {
  CodebookPlan plan;
  plan.params = codebook_params(s);
  if (float_out) plan.params.has_scales = plan.params.has_bias = 0;
  const CodebookKernels k = codebook_forward_kernels(s, float_out);
  Launch& l = plan.launch;
  if (codebook_use_matvec(s, max_threads)) {
    l.kernel = k.matvec;
    const uint32_t threads = codebook_threads(kCodebookMvSimdgroups * kSimdWidth, max_threads);
    const uint32_t rows_per_tg = threads / kSimdWidth * kCodebookRowsPerSimd;
    l.threadgroups = {ceil_div(uint64_t(s.out_features), rows_per_tg), uint32_t(s.rows), 1};
    l.threads = {threads, 1, 1};
    l.threadgroup_memory[0] = codebook_stage_bytes(plan.params);
    l.n_threadgroup_memory = 1;
  } else {
    l.kernel = k.tiled;
    set_tiled_launch(l, s.out_features, s.rows, plan.params);
  }
  l.params_index = 6;
  return plan;
}

// grad_x = (grad_out * scales) @ W.
inline CodebookPlan plan_codebook_dx(const CodebookShape& s,
                                     uint32_t max_threads = kMaxThreadsPerThreadgroup) {
  CodebookPlan plan;
  plan.params = codebook_params(s);
  const CodebookKernels k = codebook_dx_kernels(s);
  Launch& l = plan.launch;
  if (codebook_use_matvec(s, max_threads)) {
    l.kernel = k.matvec;
    const uint32_t threads = codebook_threads(kCodebookMvSimdgroups * kSimdWidth, max_threads);
    const uint64_t items = uint64_t(s.groups) * ceil_div(uint64_t(s.entry_dim), kCodebookTChunk);
    l.threadgroups = {ceil_div(items, threads / kSimdWidth), uint32_t(s.rows), 1};
    l.threads = {threads, 1, 1};
    l.threadgroup_memory[0] = codebook_stage_bytes(plan.params);
    l.n_threadgroup_memory = 1;
  } else {
    l.kernel = k.tiled;
    set_tiled_launch(l, s.in_features, s.rows, plan.params);
  }
  l.params_index = 5;
  return plan;
}

// grad_codebook pass 1; the partials buffer holds codebook_partials_count(plan) floats.
inline CodebookPlan plan_codebook_dcodebook_partial(const CodebookShape& s) {
  CodebookPlan plan;
  CodebookParams& p = plan.params;
  p = codebook_params(s);
  p.codebook_in_tg = 0;
  p.t_block = uint32_t(s.entry_dim < kCodebookTChunk ? s.entry_dim : kCodebookTChunk);
  const uint64_t groups = uint64_t(s.groups > 0 ? s.groups : 1);
  p.groups_per_block = ceil_div(groups, kCodebookMaxGroupBlocks);
  p.num_gblocks = ceil_div(groups, p.groups_per_block);
  p.lut_scan = s.rows < kCodebookLutScanMaxRows;
  static const char* const names[3] = {"codebook_dcodebook_partial_f32",
                                       "codebook_dcodebook_partial_f16",
                                       "codebook_dcodebook_partial_bf16"};
  Launch& l = plan.launch;
  l.kernel = codebook_kernel(names, s.dtype);
  l.threadgroups = {p.num_gblocks, uint32_t(s.num_codebooks),
                    ceil_div(uint64_t(s.entry_dim), p.t_block)};
  l.threads = {kSimdWidth, 1, 1};
  l.threadgroup_memory[0] = threadgroup_bytes(uint64_t(s.num_entries) * p.t_block * 4);
  l.n_threadgroup_memory = 1;
  l.params_index = 5;
  return plan;
}

inline uint64_t codebook_partials_count(const CodebookPlan& partial_plan) {
  const CodebookParams& p = partial_plan.params;
  return uint64_t(p.num_gblocks) * p.num_codebooks * p.num_entries * p.entry_dim;
}

// grad_codebook pass 2, with the params of pass 1.
inline CodebookPlan plan_codebook_dcodebook_reduce(const CodebookPlan& partial_plan,
                                                   CodebookDtype dtype,
                                                   uint32_t max_threads = kMaxThreadsPerThreadgroup) {
  CodebookPlan plan;
  plan.params = partial_plan.params;
  static const char* const names[3] = {"codebook_dcodebook_reduce_f32",
                                       "codebook_dcodebook_reduce_f16",
                                       "codebook_dcodebook_reduce_bf16"};
  const CodebookParams& p = plan.params;
  Launch& l = plan.launch;
  l.kernel = codebook_kernel(names, dtype);
  const uint32_t threads = codebook_threads(256, max_threads);
  l.threadgroups = {ceil_div(uint64_t(p.num_codebooks) * p.num_entries * p.entry_dim, threads), 1,
                    1};
  l.threads = {threads, 1, 1};
  l.params_index = 2;
  return plan;
}

// grad_scales / grad_bias; want_scales/want_bias select which are written.
inline CodebookPlan plan_codebook_dscale_dbias(const CodebookShape& s, bool want_scales,
                                               bool want_bias,
                                               uint32_t max_threads = kMaxThreadsPerThreadgroup) {
  CodebookPlan plan;
  plan.params = codebook_params(s);
  plan.params.has_scales = want_scales;
  plan.params.has_bias = want_bias;
  static const char* const names[3] = {"codebook_dscale_dbias_f32", "codebook_dscale_dbias_f16",
                                       "codebook_dscale_dbias_bf16"};
  Launch& l = plan.launch;
  l.kernel = codebook_kernel(names, s.dtype);
  const uint32_t threads = codebook_threads(256, max_threads);
  l.threadgroups = {ceil_div(uint64_t(s.out_features), threads), 1, 1};
  l.threads = {threads, 1, 1};
  l.params_index = 4;
  return plan;
}

// ---- grad_codebook for 16-bit indices (codebook_sorted.metal) ----

struct CodebookSortedPlan {
  Launch launch;
  CodebookParams params{};
};

constexpr uint32_t kCodebookSortedChunk = 8;  // codebook_sorted.metal kChunk

// The host first sorts the N*G*M keys m*E + code (M*E for a code >= E) stably and passes
// them with their positions (j*G + g)*M + m, both as uint32.
inline CodebookSortedPlan plan_codebook_dcodebook_sorted(
    const CodebookShape& s, uint32_t max_threads = kMaxThreadsPerThreadgroup) {
  CodebookSortedPlan plan;
  CodebookParams& p = plan.params;
  p = codebook_params(s);
  p.sorted_count = uint32_t(s.out_features * s.groups * s.num_codebooks);
  static const char* const names[3] = {"codebook_dcodebook_sorted_f32",
                                       "codebook_dcodebook_sorted_f16",
                                       "codebook_dcodebook_sorted_bf16"};
  Launch& l = plan.launch;
  l.kernel = codebook_kernel(names, s.dtype);
  const uint64_t items = uint64_t(s.num_codebooks) * s.num_entries *
                         ceil_div(uint64_t(s.entry_dim), kCodebookSortedChunk);
  const uint32_t threads = codebook_threads(256, max_threads);
  l.threadgroups = {ceil_div(items, threads), 1, 1};
  l.threads = {threads, 1, 1};
  l.params_index = 6;
  return plan;
}

}  // namespace rlx::mps
