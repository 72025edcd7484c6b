// Codebook (vector-quantized) matmul on Apple GPUs, forward and backward.
//   out[b, j] = s_j * sum_{m, g, t} x[b, g*D + t] * C[m, I[j, g, m], t] + bias_j
// x [B, K], I [N, G, M] (G = K / D) uint8 or 16-bit (int16 read as ushort: its value modulo
// 2^16), C [M, E, D], s / bias [N], out [B, N]. The forward and grad_x kernels are templates
// over the index type I (uchar or ushort); grad_codebook for 16-bit indices, where per-block
// partials of E = 65536 entries do not fit, is codebook_sorted.metal.
// Launch plans (grids, threadgroup sizes, params, threadgroup memory): rlx/mps_codebook_plan.h.
// Accumulation is float32 for every input type. An index >= E (not checked on the GPU: that
// would need a host sync) makes the affected outputs NaN instead of reading out of bounds.
#include <metal_stdlib>
using namespace metal;

#include "rlx/mps_codebook_params.h"  // CodebookParams, shared with the host code
using rlx::mps::CodebookParams;

constant constexpr uint kSimd = 32;
constant constexpr uint kRowsPerSimd = 4;  // output rows per simdgroup (matrix-vector)
constant constexpr uint kTChunk = 8;       // entry components held in registers at once
constant constexpr uint kTile = 32;        // tiled kernels: 32 x 32 outputs, 32-wide K steps
constant constexpr uint kTilePad = 33;     // padded row stride of the tiles in threadgroup memory
constant constexpr uint kMaxEntryChunks = 8;  // E <= 256 = 8 codes per lane
constant constexpr uint kLutRows = 4;         // dcodebook code scans: batch rows per scan

// x . C[m, e, t0 : t0 + n] with the entry read from threadgroup or device memory.
inline float dot_entry(threadgroup const float* c, thread const float* xr, uint n) {
  float s = 0.0f;
  for (uint i = 0; i < n; ++i) s += xr[i] * c[i];
  return s;
}
template <typename T>
inline float dot_entry(device const T* c, thread const float* xr, uint n) {
  float s = 0.0f;
  for (uint i = 0; i < n; ++i) s += xr[i] * float(c[i]);
  return s;
}

// All threads copy the codebook into threadgroup memory as float; the caller then barriers.
template <typename T>
inline void stage_codebook(device const T* codebook, threadgroup float* cb, uint count, uint tid,
                           uint nthreads) {
  for (uint i = tid; i < count; i += nthreads) cb[i] = float(codebook[i]);
}

// Dequantized weight W[j, k] = sum_m C[m, I[j, k / D, m], k % D] (NaN for an index >= E).
template <typename T, typename I>
inline float weight_at(device const I* indices, device const T* codebook,
                       threadgroup const float* cb, constant CodebookParams& p, uint j, uint k) {
  const uint g = k / p.entry_dim, t = k % p.entry_dim;
  device const I* idx = indices + (j * p.groups + g) * p.num_codebooks;
  float w = 0.0f;
  for (uint m = 0; m < p.num_codebooks; ++m) {
    const uint e = idx[m];
    if (e >= p.num_entries) return numeric_limits<float>::quiet_NaN();
    const uint at = (m * p.num_entries + e) * p.entry_dim + t;
    w += p.codebook_in_tg ? cb[at] : float(codebook[at]);
  }
  return w;
}

// ---- forward, small batch: matrix-vector --------------------------------------------------
// threadgroups (ceil(N / (simdgroups * 4)), B); each simdgroup computes 4 output rows of one
// batch row. Lanes split the groups g; each lane keeps its x slice in registers and reuses it
// for the 4 rows and M codebooks; simd_sum reduces the lanes.
template <typename T, typename TOut, typename I>
kernel void codebook_mv(device const T* x [[buffer(0)]],
                        device const I* indices [[buffer(1)]],
                        device const T* codebook [[buffer(2)]],
                        device const T* scales [[buffer(3)]],
                        device const T* bias [[buffer(4)]],
                        device TOut* out [[buffer(5)]],
                        constant CodebookParams& p [[buffer(6)]],
                        threadgroup float* cb [[threadgroup(0)]],
                        uint3 tgpos [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint nthreads [[threads_per_threadgroup]]) {
  if (p.codebook_in_tg)
    stage_codebook(codebook, cb, p.num_codebooks * p.num_entries * p.entry_dim, tid, nthreads);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint b = tgpos.y;
  const uint row0 = (tgpos.x * (nthreads / kSimd) + sg) * kRowsPerSimd;
  const uint D = p.entry_dim, G = p.groups, M = p.num_codebooks, E = p.num_entries;
  device const T* xb = x + b * p.in_features;
  float acc[kRowsPerSimd] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint g = lane; g < G; g += kSimd) {
    for (uint t0 = 0; t0 < D; t0 += kTChunk) {
      const uint nt = min(kTChunk, D - t0);
      float xr[kTChunk];
      for (uint i = 0; i < nt; ++i) xr[i] = float(xb[g * D + t0 + i]);
      for (uint r = 0; r < kRowsPerSimd; ++r) {
        const uint j = row0 + r;
        if (j >= p.out_features) break;
        device const I* idx = indices + (j * G + g) * M;
        for (uint m = 0; m < M; ++m) {
          const uint e = idx[m];
          if (e >= E) {
            acc[r] = numeric_limits<float>::quiet_NaN();
            continue;
          }
          const uint at = (m * E + e) * D + t0;
          acc[r] += p.codebook_in_tg ? dot_entry(cb + at, xr, nt)
                                     : dot_entry(codebook + at, xr, nt);
        }
      }
    }
  }
  for (uint r = 0; r < kRowsPerSimd; ++r) {
    const float total = simd_sum(acc[r]);
    const uint j = row0 + r;
    if (lane == 0 && j < p.out_features) {
      float v = total;
      if (p.has_scales) v *= float(scales[j]);
      if (p.has_bias) v += float(bias[j]);
      out[b * p.out_features + j] = TOut(v);
    }
  }
}

// ---- forward, large batch: tiled GEMM on dequantized weight tiles -------------------------
// threadgroups (ceil(N / 32), ceil(B / 32)), 256 threads; each thread computes 2 x 2 outputs.
// Per 32-wide K step the threadgroup stages an x tile and a dequantized weight tile.
template <typename T, typename TOut, typename I>
kernel void codebook_mm(device const T* x [[buffer(0)]],
                        device const I* indices [[buffer(1)]],
                        device const T* codebook [[buffer(2)]],
                        device const T* scales [[buffer(3)]],
                        device const T* bias [[buffer(4)]],
                        device TOut* out [[buffer(5)]],
                        constant CodebookParams& p [[buffer(6)]],
                        threadgroup float* xs [[threadgroup(0)]],
                        threadgroup float* ws [[threadgroup(1)]],
                        threadgroup float* cb [[threadgroup(2)]],
                        uint3 tgpos [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint nthreads [[threads_per_threadgroup]]) {
  if (p.codebook_in_tg)
    stage_codebook(codebook, cb, p.num_codebooks * p.num_entries * p.entry_dim, tid, nthreads);
  const uint j0 = tgpos.x * kTile, b0 = tgpos.y * kTile;
  const uint tx = tid % 16, ty = tid / 16;
  const uint K = p.in_features, N = p.out_features, B = p.rows;
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (uint k0 = 0; k0 < K; k0 += kTile) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // codebook staged / previous tile used
    for (uint i = tid; i < kTile * kTile; i += nthreads) {
      const uint r = i / kTile, c = i % kTile, k = k0 + c;
      const uint b = b0 + r, j = j0 + r;
      xs[r * kTilePad + c] = (b < B && k < K) ? float(x[b * K + k]) : 0.0f;
      ws[r * kTilePad + c] = (j < N && k < K) ? weight_at(indices, codebook, cb, p, j, k) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint c = 0; c < kTile; ++c) {
      const float x0 = xs[(2 * ty) * kTilePad + c], x1 = xs[(2 * ty + 1) * kTilePad + c];
      const float w0 = ws[(2 * tx) * kTilePad + c], w1 = ws[(2 * tx + 1) * kTilePad + c];
      acc[0][0] += x0 * w0;
      acc[0][1] += x0 * w1;
      acc[1][0] += x1 * w0;
      acc[1][1] += x1 * w1;
    }
  }
  for (uint i = 0; i < 2; ++i) {
    for (uint jj = 0; jj < 2; ++jj) {
      const uint b = b0 + 2 * ty + i, j = j0 + 2 * tx + jj;
      if (b >= B || j >= N) continue;
      float v = acc[i][jj];
      if (p.has_scales) v *= float(scales[j]);
      if (p.has_bias) v += float(bias[j]);
      out[b * N + j] = TOut(v);
    }
  }
}

// ---- grad_x, small batch: dx[b, g*D + t] = sum_j dout[b, j] s_j W[j, g*D + t] ----------------
// threadgroups (ceil(G * ceil(D / 8) / simdgroups), B); a simdgroup owns one (g, t-chunk);
// lanes split the output rows j, simd_sum reduces them.
template <typename T, typename I>
kernel void codebook_dx_mv(device const T* grad_out [[buffer(0)]],
                           device const I* indices [[buffer(1)]],
                           device const T* codebook [[buffer(2)]],
                           device const T* scales [[buffer(3)]],
                           device T* grad_x [[buffer(4)]],
                           constant CodebookParams& p [[buffer(5)]],
                           threadgroup float* cb [[threadgroup(0)]],
                           uint3 tgpos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint nthreads [[threads_per_threadgroup]]) {
  if (p.codebook_in_tg)
    stage_codebook(codebook, cb, p.num_codebooks * p.num_entries * p.entry_dim, tid, nthreads);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint D = p.entry_dim, G = p.groups, M = p.num_codebooks, E = p.num_entries;
  const uint chunks = (D + kTChunk - 1) / kTChunk;
  const uint item = tgpos.x * (nthreads / kSimd) + sg;  // (g, t-chunk) of this simdgroup
  if (item >= G * chunks) return;  // whole simdgroups only: no barrier or collective follows
  const uint g = item / chunks, t0 = (item % chunks) * kTChunk, nt = min(kTChunk, D - t0);
  const uint b = tgpos.y;
  float acc[kTChunk] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (uint j = lane; j < p.out_features; j += kSimd) {
    float gj = float(grad_out[b * p.out_features + j]);
    if (p.has_scales) gj *= float(scales[j]);
    device const I* idx = indices + (j * G + g) * M;
    for (uint m = 0; m < M; ++m) {
      const uint e = idx[m];
      if (e >= E) {
        acc[0] = numeric_limits<float>::quiet_NaN();
        continue;
      }
      const uint at = (m * E + e) * D + t0;
      for (uint i = 0; i < nt; ++i)
        acc[i] += gj * (p.codebook_in_tg ? cb[at + i] : float(codebook[at + i]));
    }
  }
  for (uint i = 0; i < kTChunk; ++i) {
    const float total = simd_sum(acc[i]);
    if (lane == 0 && i < nt) grad_x[b * p.in_features + g * D + t0 + i] = T(total);
  }
}

// ---- grad_x, large batch: tiled dx = (dout * s) @ W -------------------------------------
// threadgroups (ceil(K / 32), ceil(B / 32)), 256 threads, 2 x 2 outputs per thread; the
// contraction runs over 32-row blocks of the weight.
template <typename T, typename I>
kernel void codebook_dx_mm(device const T* grad_out [[buffer(0)]],
                           device const I* indices [[buffer(1)]],
                           device const T* codebook [[buffer(2)]],
                           device const T* scales [[buffer(3)]],
                           device T* grad_x [[buffer(4)]],
                           constant CodebookParams& p [[buffer(5)]],
                           threadgroup float* gs [[threadgroup(0)]],
                           threadgroup float* wt [[threadgroup(1)]],
                           threadgroup float* cb [[threadgroup(2)]],
                           uint3 tgpos [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint nthreads [[threads_per_threadgroup]]) {
  if (p.codebook_in_tg)
    stage_codebook(codebook, cb, p.num_codebooks * p.num_entries * p.entry_dim, tid, nthreads);
  const uint k0 = tgpos.x * kTile, b0 = tgpos.y * kTile;
  const uint tx = tid % 16, ty = tid / 16;
  const uint K = p.in_features, N = p.out_features, B = p.rows;
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  for (uint j0 = 0; j0 < N; j0 += kTile) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = tid; i < kTile * kTile; i += nthreads) {
      const uint r = i / kTile, c = i % kTile;
      const uint b = b0 + r, j = j0 + c;  // gs[b][j]
      float gv = 0.0f;
      if (b < B && j < N) {
        gv = float(grad_out[b * N + j]);
        if (p.has_scales) gv *= float(scales[j]);
      }
      gs[r * kTilePad + c] = gv;
      const uint jw = j0 + r, k = k0 + c;  // wt[j][k]
      wt[r * kTilePad + c] =
          (jw < N && k < K) ? weight_at(indices, codebook, cb, p, jw, k) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint c = 0; c < kTile; ++c) {
      const float g0 = gs[(2 * ty) * kTilePad + c], g1 = gs[(2 * ty + 1) * kTilePad + c];
      const float w0 = wt[c * kTilePad + 2 * tx], w1 = wt[c * kTilePad + 2 * tx + 1];
      acc[0][0] += g0 * w0;
      acc[0][1] += g0 * w1;
      acc[1][0] += g1 * w0;
      acc[1][1] += g1 * w1;
    }
  }
  for (uint i = 0; i < 2; ++i) {
    for (uint kk = 0; kk < 2; ++kk) {
      const uint b = b0 + 2 * ty + i, k = k0 + 2 * tx + kk;
      if (b < B && k < K) grad_x[b * K + k] = T(acc[i][kk]);
    }
  }
}

// ---- grad_codebook, pass 1: per group-block partials, deterministic -----------------------
// dC[m, c, t] = sum_{b, j, g : I[j,g,m] = c} dout[b, j] s_j x[b, g*D + t]
// threadgroups (num_gblocks, M, ceil(D / t_block)), one simdgroup each. Lane l owns the codes
// c = l (mod 32) and is the only thread that adds into their rows of the threadgroup partial,
// so every sum runs in a fixed order (no atomics). Small batch: for each block of 4 batch rows,
// lanes scan the codes of column g in lockstep and each adds dout * s to its own codes'
// histograms (one per row), then multiplies them by x. Large batch: for each row j, lanes split the batch for
// sum_b dout[b, j] x[b, g*D + t], simd_sum, and the owner of the code adds it.
template <typename T>
kernel void codebook_dcodebook_partial(device const T* grad_out [[buffer(0)]],
                                       device const T* x [[buffer(1)]],
                                       device const uchar* indices [[buffer(2)]],
                                       device const T* scales [[buffer(3)]],
                                       device float* partials [[buffer(4)]],
                                       constant CodebookParams& p [[buffer(5)]],
                                       threadgroup float* part [[threadgroup(0)]],
                                       uint3 tgpos [[threadgroup_position_in_grid]],
                                       uint lane [[thread_index_in_simdgroup]]) {
  const uint D = p.entry_dim, G = p.groups, M = p.num_codebooks, E = p.num_entries;
  const uint N = p.out_features, B = p.rows, K = p.in_features;
  const uint m = tgpos.y, t0 = tgpos.z * p.t_block, nt = min(p.t_block, D - t0);
  const uint g_begin = tgpos.x * p.groups_per_block;
  const uint g_end = min(G, g_begin + p.groups_per_block);
  for (uint c = lane; c < E; c += kSimd)
    for (uint t = 0; t < nt; ++t) part[c * p.t_block + t] = 0.0f;

  for (uint g = g_begin; g < g_end; ++g) {
    if (p.lut_scan) {
      for (uint b0 = 0; b0 < B; b0 += kLutRows) {
        const uint nb = min(kLutRows, B - b0);
        float hist[kMaxEntryChunks][kLutRows];
        uint seen = 0;  // bit s: some row selects code lane + 32 s (others get no x term)
        for (uint s = 0; s < kMaxEntryChunks; ++s)
          for (uint bb = 0; bb < kLutRows; ++bb) hist[s][bb] = 0.0f;
        for (uint j = 0; j < N; ++j) {
          const uint c = indices[(j * G + g) * M + m];
          if (c < E && (c % kSimd) == lane) {
            seen |= 1u << (c / kSimd);
            const float s = p.has_scales ? float(scales[j]) : 1.0f;
            for (uint bb = 0; bb < nb; ++bb)
              hist[c / kSimd][bb] += float(grad_out[(b0 + bb) * N + j]) * s;
          }
        }
        for (uint s = 0; s < kMaxEntryChunks; ++s) {
          const uint c = lane + s * kSimd;
          if (c >= E) break;
          if ((seen >> s & 1u) == 0) continue;  // 0 * x would be NaN for a non-finite x
          for (uint bb = 0; bb < nb; ++bb)
            for (uint t = 0; t < nt; ++t)
              part[c * p.t_block + t] += hist[s][bb] * float(x[(b0 + bb) * K + g * D + t0 + t]);
        }
      }
    } else {
      for (uint j = 0; j < N; ++j) {
        float pt[kTChunk] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (uint b = lane; b < B; b += kSimd) {
          float gj = float(grad_out[b * N + j]);
          for (uint t = 0; t < nt; ++t) pt[t] += gj * float(x[b * K + g * D + t0 + t]);
        }
        const uint c = indices[(j * G + g) * M + m];
        const float s = p.has_scales ? float(scales[j]) : 1.0f;
        for (uint t = 0; t < kTChunk; ++t) {
          const float total = simd_sum(pt[t]);
          if (c < E && (c % kSimd) == lane && t < nt) part[c * p.t_block + t] += total * s;
        }
      }
    }
  }
  // partials[gblock][m][c][t]
  device float* dst = partials + ((tgpos.x * M + m) * E) * D;
  for (uint c = lane; c < E; c += kSimd)
    for (uint t = 0; t < nt; ++t) dst[c * D + t0 + t] = part[c * p.t_block + t];
}

// ---- grad_codebook, pass 2: sum the partials over group blocks in order --------------------
// threadgroups (ceil(M * E * D / 256)), 256 threads, one element each (coalesced reads).
template <typename T>
kernel void codebook_dcodebook_reduce(device const float* partials [[buffer(0)]],
                                      device T* grad_codebook [[buffer(1)]],
                                      constant CodebookParams& p [[buffer(2)]],
                                      uint gid [[thread_position_in_grid]]) {
  const uint count = p.num_codebooks * p.num_entries * p.entry_dim;
  if (gid >= count) return;
  float s = 0.0f;
  for (uint blk = 0; blk < p.num_gblocks; ++blk) s += partials[blk * count + gid];
  grad_codebook[gid] = T(s);
}

// ---- grad_scales and grad_bias --------------------------------------------------------------
// grad_scales[j] = sum_b dout[b, j] y[b, j] with y the unscaled output (recomputed in float32
// by codebook_mv / codebook_mm); grad_bias[j] = sum_b dout[b, j]. threadgroups (ceil(N / 256)),
// 256 threads: consecutive threads read consecutive j, each sums its column in batch order.
template <typename T>
kernel void codebook_dscale_dbias(device const T* grad_out [[buffer(0)]],
                                  device const float* y [[buffer(1)]],
                                  device T* grad_scales [[buffer(2)]],
                                  device T* grad_bias [[buffer(3)]],
                                  constant CodebookParams& p [[buffer(4)]],
                                  uint j [[thread_position_in_grid]]) {
  const uint N = p.out_features;
  if (j >= N) return;
  float ds = 0.0f, db = 0.0f;
  for (uint b = 0; b < p.rows; ++b) {
    const float g = float(grad_out[b * N + j]);
    if (p.has_scales) ds += g * y[b * N + j];
    db += g;
  }
  if (p.has_scales) grad_scales[j] = T(ds);
  if (p.has_bias) grad_bias[j] = T(db);
}

// ---- instantiations ---------------------------------------------------------------------------
// Index types: uchar (E <= 256) and ushort ("_u16": int16/uint16 indices, E <= 65536).
template [[host_name("codebook_mv_f32")]] [[kernel]] decltype(codebook_mv<float, float, uchar>) codebook_mv<float, float, uchar>;
template [[host_name("codebook_mm_f32")]] [[kernel]] decltype(codebook_mm<float, float, uchar>) codebook_mm<float, float, uchar>;
template [[host_name("codebook_dx_mv_f32")]] [[kernel]] decltype(codebook_dx_mv<float, uchar>) codebook_dx_mv<float, uchar>;
template [[host_name("codebook_dx_mm_f32")]] [[kernel]] decltype(codebook_dx_mm<float, uchar>) codebook_dx_mm<float, uchar>;
template [[host_name("codebook_mv_u16_f32")]] [[kernel]] decltype(codebook_mv<float, float, ushort>) codebook_mv<float, float, ushort>;
template [[host_name("codebook_mm_u16_f32")]] [[kernel]] decltype(codebook_mm<float, float, ushort>) codebook_mm<float, float, ushort>;
template [[host_name("codebook_dx_mv_u16_f32")]] [[kernel]] decltype(codebook_dx_mv<float, ushort>) codebook_dx_mv<float, ushort>;
template [[host_name("codebook_dx_mm_u16_f32")]] [[kernel]] decltype(codebook_dx_mm<float, ushort>) codebook_dx_mm<float, ushort>;
template [[host_name("codebook_dcodebook_partial_f32")]] [[kernel]] decltype(codebook_dcodebook_partial<float>) codebook_dcodebook_partial<float>;
template [[host_name("codebook_dcodebook_reduce_f32")]] [[kernel]] decltype(codebook_dcodebook_reduce<float>) codebook_dcodebook_reduce<float>;
template [[host_name("codebook_dscale_dbias_f32")]] [[kernel]] decltype(codebook_dscale_dbias<float>) codebook_dscale_dbias<float>;
template [[host_name("codebook_mv_f16")]] [[kernel]] decltype(codebook_mv<half, half, uchar>) codebook_mv<half, half, uchar>;
template [[host_name("codebook_mv_f16_yf32")]] [[kernel]] decltype(codebook_mv<half, float, uchar>) codebook_mv<half, float, uchar>;
template [[host_name("codebook_mm_f16")]] [[kernel]] decltype(codebook_mm<half, half, uchar>) codebook_mm<half, half, uchar>;
template [[host_name("codebook_mm_f16_yf32")]] [[kernel]] decltype(codebook_mm<half, float, uchar>) codebook_mm<half, float, uchar>;
template [[host_name("codebook_dx_mv_f16")]] [[kernel]] decltype(codebook_dx_mv<half, uchar>) codebook_dx_mv<half, uchar>;
template [[host_name("codebook_dx_mm_f16")]] [[kernel]] decltype(codebook_dx_mm<half, uchar>) codebook_dx_mm<half, uchar>;
template [[host_name("codebook_mv_u16_f16")]] [[kernel]] decltype(codebook_mv<half, half, ushort>) codebook_mv<half, half, ushort>;
template [[host_name("codebook_mv_u16_f16_yf32")]] [[kernel]] decltype(codebook_mv<half, float, ushort>) codebook_mv<half, float, ushort>;
template [[host_name("codebook_mm_u16_f16")]] [[kernel]] decltype(codebook_mm<half, half, ushort>) codebook_mm<half, half, ushort>;
template [[host_name("codebook_mm_u16_f16_yf32")]] [[kernel]] decltype(codebook_mm<half, float, ushort>) codebook_mm<half, float, ushort>;
template [[host_name("codebook_dx_mv_u16_f16")]] [[kernel]] decltype(codebook_dx_mv<half, ushort>) codebook_dx_mv<half, ushort>;
template [[host_name("codebook_dx_mm_u16_f16")]] [[kernel]] decltype(codebook_dx_mm<half, ushort>) codebook_dx_mm<half, ushort>;
template [[host_name("codebook_dcodebook_partial_f16")]] [[kernel]] decltype(codebook_dcodebook_partial<half>) codebook_dcodebook_partial<half>;
template [[host_name("codebook_dcodebook_reduce_f16")]] [[kernel]] decltype(codebook_dcodebook_reduce<half>) codebook_dcodebook_reduce<half>;
template [[host_name("codebook_dscale_dbias_f16")]] [[kernel]] decltype(codebook_dscale_dbias<half>) codebook_dscale_dbias<half>;

// bfloat needs the Metal 3.1 language (macOS 14); older systems compile everything above.
#if __METAL_VERSION__ >= 310
template [[host_name("codebook_mv_bf16")]] [[kernel]] decltype(codebook_mv<bfloat, bfloat, uchar>) codebook_mv<bfloat, bfloat, uchar>;
template [[host_name("codebook_mv_bf16_yf32")]] [[kernel]] decltype(codebook_mv<bfloat, float, uchar>) codebook_mv<bfloat, float, uchar>;
template [[host_name("codebook_mm_bf16")]] [[kernel]] decltype(codebook_mm<bfloat, bfloat, uchar>) codebook_mm<bfloat, bfloat, uchar>;
template [[host_name("codebook_mm_bf16_yf32")]] [[kernel]] decltype(codebook_mm<bfloat, float, uchar>) codebook_mm<bfloat, float, uchar>;
template [[host_name("codebook_dx_mv_bf16")]] [[kernel]] decltype(codebook_dx_mv<bfloat, uchar>) codebook_dx_mv<bfloat, uchar>;
template [[host_name("codebook_dx_mm_bf16")]] [[kernel]] decltype(codebook_dx_mm<bfloat, uchar>) codebook_dx_mm<bfloat, uchar>;
template [[host_name("codebook_mv_u16_bf16")]] [[kernel]] decltype(codebook_mv<bfloat, bfloat, ushort>) codebook_mv<bfloat, bfloat, ushort>;
template [[host_name("codebook_mv_u16_bf16_yf32")]] [[kernel]] decltype(codebook_mv<bfloat, float, ushort>) codebook_mv<bfloat, float, ushort>;
template [[host_name("codebook_mm_u16_bf16")]] [[kernel]] decltype(codebook_mm<bfloat, bfloat, ushort>) codebook_mm<bfloat, bfloat, ushort>;
template [[host_name("codebook_mm_u16_bf16_yf32")]] [[kernel]] decltype(codebook_mm<bfloat, float, ushort>) codebook_mm<bfloat, float, ushort>;
template [[host_name("codebook_dx_mv_u16_bf16")]] [[kernel]] decltype(codebook_dx_mv<bfloat, ushort>) codebook_dx_mv<bfloat, ushort>;
template [[host_name("codebook_dx_mm_u16_bf16")]] [[kernel]] decltype(codebook_dx_mm<bfloat, ushort>) codebook_dx_mm<bfloat, ushort>;
template [[host_name("codebook_dcodebook_partial_bf16")]] [[kernel]] decltype(codebook_dcodebook_partial<bfloat>) codebook_dcodebook_partial<bfloat>;
template [[host_name("codebook_dcodebook_reduce_bf16")]] [[kernel]] decltype(codebook_dcodebook_reduce<bfloat>) codebook_dcodebook_reduce<bfloat>;
template [[host_name("codebook_dscale_dbias_bf16")]] [[kernel]] decltype(codebook_dscale_dbias<bfloat>) codebook_dscale_dbias<bfloat>;
#endif
