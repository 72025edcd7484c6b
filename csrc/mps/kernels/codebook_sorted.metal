// grad_codebook of the codebook matmul for 16-bit indices (E up to 65536), where per-block
// partial codebooks in threadgroup memory (codebook.metal) do not fit. Deterministic without
// atomics: the host sorts the flattened codes stably (key m*E + code at position
// (j*G + g)*M + m; key M*E for a code >= E, never summed), so each key's occurrences come in
// increasing position order. One thread per (key, 8-wide entry chunk) finds its run by
// binary search and sums
//   dC[m, c, t] = sum_{(j, g) in run(m*E + c)} s_j * sum_b dout[b, j] * x[b, g*D + t].
// Launch plan: rlx/mps_codebook_plan.h (plan_codebook_dcodebook_sorted).
#include <metal_stdlib>
using namespace metal;

#include "rlx/mps_codebook_params.h"  // CodebookParams, shared with the host code
using rlx::mps::CodebookParams;

constant constexpr uint kChunk = 8;  // entry components per thread

// First i in [0, count) with keys[i] >= key (count if none).
inline uint lower_bound(device const uint* keys, uint count, uint key) {
  uint lo = 0, hi = count;
  while (lo < hi) {
    const uint mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// threadgroups (ceil(M * E * ceil(D / 8) / 256)), 256 threads; buffers: 0 grad_out [B, N],
// 1 x [B, K], 2 sorted keys, 3 their positions, 4 scales, 5 grad_codebook [M, E, D], 6 params.
template <typename T>
kernel void codebook_dcodebook_sorted(device const T* grad_out [[buffer(0)]],
                                      device const T* x [[buffer(1)]],
                                      device const uint* keys [[buffer(2)]],
                                      device const uint* order [[buffer(3)]],
                                      device const T* scales [[buffer(4)]],
                                      device T* grad_codebook [[buffer(5)]],
                                      constant CodebookParams& p [[buffer(6)]],
                                      uint gid [[thread_position_in_grid]]) {
  const uint D = p.entry_dim, chunks = (D + kChunk - 1) / kChunk;
  if (gid >= p.num_codebooks * p.num_entries * chunks) return;
  const uint key = gid / chunks, t0 = (gid % chunks) * kChunk, nt = min(kChunk, D - t0);
  const uint M = p.num_codebooks, GM = p.groups * M, N = p.out_features, K = p.in_features;
  float acc[kChunk] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const uint end = lower_bound(keys, p.sorted_count, key + 1);
  for (uint i = lower_bound(keys, p.sorted_count, key); i < end; ++i) {
    const uint pos = order[i];
    const uint j = pos / GM, g = (pos % GM) / M;
    const float s = p.has_scales ? float(scales[j]) : 1.0f;
    for (uint b = 0; b < p.rows; ++b) {
      const float gv = float(grad_out[b * N + j]) * s;
      device const T* xr = x + b * K + g * D + t0;
      for (uint t = 0; t < nt; ++t) acc[t] += gv * float(xr[t]);
    }
  }
  device T* dst = grad_codebook + key * D + t0;
  for (uint t = 0; t < nt; ++t) dst[t] = T(acc[t]);
}

template [[host_name("codebook_dcodebook_sorted_f32")]] [[kernel]] decltype(codebook_dcodebook_sorted<float>) codebook_dcodebook_sorted<float>;
template [[host_name("codebook_dcodebook_sorted_f16")]] [[kernel]] decltype(codebook_dcodebook_sorted<half>) codebook_dcodebook_sorted<half>;

// bfloat needs the Metal 3.1 language (macOS 14).
#if __METAL_VERSION__ >= 310
template [[host_name("codebook_dcodebook_sorted_bf16")]] [[kernel]] decltype(codebook_dcodebook_sorted<bfloat>) codebook_dcodebook_sorted<bfloat>;
#endif
