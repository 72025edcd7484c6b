// Lookup-table codebook forward for 1 to 4 batch rows: float16 / bfloat16 / float32 x, D = 8,
// M <= 2. out[b, j] = s_j * sum_{g,m} L[b, m, g, I[j,g,m]] + bias_j with the table
// L[b, m, g, e] = sum_t x[b, g*8 + t] C[m, e, t] (float32), so each code costs one 4-byte
// (one batch row) to 16-byte (four rows) shared-memory read and one add, instead of a 16-byte
// entry and 8 multiply-adds per row.
//
// The table of a whole layer does not fit in shared memory (K = 4096, one codebook: 512 KiB
// per batch row), so K is split into slices of GS groups (SB code bytes per output row): block
// (slice, chunk) builds its slice's table (E x GS x M x BT floats) from the codebook and the
// slice of x, then each thread streams the slice's codes of one output row of the chunk with
// 16-byte loads and adds the table values in group order. The blocks write per-slice partial
// sums [S][rows][N]; a second kernel adds them in slice order and applies scales and bias.
// Every sum has a fixed order and there are no atomics, so results are bitwise reproducible.
//
// Compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION) as codebook_mma.cuh is.
#pragma once

#include "codebook_mma.cuh"

namespace rlx::codebook::cuda {

constexpr int kLutThreads = 256;  // threads per block: one output row each per pass
constexpr int kLutMaxRows = 4;    // batch rows of the table (one float4 per entry)

enum class LutIn { kHalf, kBFloat16, kFloat };

// How the kernels see x, the codebook, scales, bias and out: 16-bit bit patterns or float.
template <LutIn kind>
using lut_elem_t = std::conditional_t<kind == LutIn::kFloat, float, uint16_t>;

template <LutIn kind>
__device__ __forceinline__ float lut_to_float(lut_elem_t<kind> v) {
  if constexpr (kind == LutIn::kFloat) {
    return v;
  } else {
    return bits_to_float<kind == LutIn::kHalf ? Bits16::kHalf : Bits16::kBFloat16>(v);
  }
}
template <LutIn kind>
__device__ __forceinline__ lut_elem_t<kind> lut_from_float(float v) {
  if constexpr (kind == LutIn::kFloat) {
    return v;
  } else {
    return float_to_bits<kind == LutIn::kHalf ? Bits16::kHalf : Bits16::kBFloat16>(v);
  }
}

// Groups per slice: SB code bytes of each output row, M bytes per group.
__host__ __device__ constexpr int lut_slice_groups(int SB, int M) { return SB / M; }

// Shared memory of lut_partial_kernel: the table [M][GS][E][BT] and x's slice [GS*8][BT].
inline size_t lut_partial_smem(int M, int E, int BT, int SB) {
  const int GS = lut_slice_groups(SB, M);
  return static_cast<size_t>(M * GS * E * BT + GS * 8 * BT) * sizeof(float);
}

// Float bit patterns: loads of BT floats go through uint2 / uint4 (one 8- or 16-byte access).
#ifndef RLX_CUDA_EMULATION
__device__ __forceinline__ float lut_as_float(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint32_t lut_as_bits(float f) { return __float_as_uint(f); }
#else
inline float lut_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t lut_as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
#endif

// BT consecutive floats of shared memory (aligned to 4 BT bytes) in one load / store.
template <int BT>
__device__ __forceinline__ void lut_load(const float* p, float (&v)[BT]) {
  if constexpr (BT == 4) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    v[0] = lut_as_float(u.x), v[1] = lut_as_float(u.y);
    v[2] = lut_as_float(u.z), v[3] = lut_as_float(u.w);
  } else if constexpr (BT == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    v[0] = lut_as_float(u.x), v[1] = lut_as_float(u.y);
  } else {
    v[0] = p[0];
  }
}
template <int BT>
__device__ __forceinline__ void lut_store(float* p, const float (&v)[BT]) {
  if constexpr (BT == 4) {
    *reinterpret_cast<uint4*>(p) =
        uint4{lut_as_bits(v[0]), lut_as_bits(v[1]), lut_as_bits(v[2]), lut_as_bits(v[3])};
  } else if constexpr (BT == 2) {
    *reinterpret_cast<uint2*>(p) = uint2{lut_as_bits(v[0]), lut_as_bits(v[1])};
  } else {
    p[0] = v[0];
  }
}

// Block b: slice b / chunks (groups g0 = slice * GS ..), chunk b % chunks (output rows
// j0 = chunk * 256 rpt ..). Writes partial[slice][row][j] for the nb = min(B, BT) batch rows.
// `wide_codes`: every row's G*M code bytes start 16-byte aligned and are whole 16-byte vectors.
template <LutIn kind, int M, int BT, int SB>
__global__ void __launch_bounds__(kLutThreads)
    lut_partial_kernel(const lut_elem_t<kind>* __restrict__ x, const uint8_t* __restrict__ idx,
                       const lut_elem_t<kind>* __restrict__ cb, float* __restrict__ partial,
                       int64_t B, int64_t N, int64_t G, int E, int rpt, int64_t chunks,
                       bool wide_codes) {
  static_assert(SB % 16 == 0 && SB % M == 0, "whole 16-byte code vectors per slice");
  constexpr int GS = lut_slice_groups(SB, M);
  RLX_MMA_SMEM(smem_raw);
  float* L = reinterpret_cast<float*>(smem_raw);  // [M][GS][E][BT]
  float* xs = L + M * GS * E * BT;                 // [GS*8][BT]
  const int tid = threadIdx.x;
  const int64_t slice = static_cast<int64_t>(blockIdx.x) / chunks;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) % chunks;
  const int64_t g0 = slice * GS, K = G * 8;
  const int gn = static_cast<int>(G - g0 < GS ? G - g0 : GS);  // groups in this slice
  const int nb = static_cast<int>(B < BT ? B : BT);

  for (int i = tid; i < GS * 8 * BT; i += kLutThreads) {
    const int k = i / BT, b = i % BT;
    xs[i] = b < nb && k < gn * 8 ? lut_to_float<kind>(RLX_LDG(x + b * K + g0 * 8 + k)) : 0.f;
  }
  __syncthreads();
  // The table: thread (m, e) keeps its entry in registers and walks the slice's groups; the
  // BT values of (m, g, e) are one store, consecutive entries consecutive words.
  for (int i = tid; i < M * E; i += kLutThreads) {
    const int m = i / E, e = i % E;
    float c[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) c[t] = lut_to_float<kind>(RLX_LDG(cb + (m * E + e) * 8 + t));
    for (int g = 0; g < gn; ++g) {
      float v[BT];
#pragma unroll
      for (int b = 0; b < BT; ++b) v[b] = 0.f;
#pragma unroll
      for (int q = 0; q < 2 * BT; ++q) {  // x's 8 BT values of group g, 16 bytes at a time
        const uint4 u = *reinterpret_cast<const uint4*>(xs + g * 8 * BT + 4 * q);
        const float xv[4] = {lut_as_float(u.x), lut_as_float(u.y), lut_as_float(u.z),
                             lut_as_float(u.w)};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const int k = 4 * q + w;  // = t * BT + b
          v[k % BT] = fmaf(c[k / BT], xv[w], v[k % BT]);
        }
      }
      lut_store<BT>(L + ((m * GS + g) * E + e) * BT, v);
    }
  }
  __syncthreads();

  const int64_t row_bytes = G * M;
  const bool full = gn == GS;
  for (int r = 0; r < rpt; ++r) {
    const int64_t j = (chunk * rpt + r) * kLutThreads + tid;
    if (j >= N) break;
    uint32_t cw[SB / 4];
    const uint8_t* src = idx + j * row_bytes + g0 * M;
    if (wide_codes && full) {
#pragma unroll
      for (int v = 0; v < SB / 16; ++v) {
        const Bytes16 q = load16(src + 16 * v);
#pragma unroll
        for (int w = 0; w < 4; ++w) cw[4 * v + w] = q.w[w];
      }
    } else {
      // Compile-time bounds with a run-time condition: a run-time-bounded loop would index cw
      // dynamically and move it to local memory.
      const int nbytes = gn * M;
#pragma unroll
      for (int w = 0; w < SB / 4; ++w) {
        uint32_t word = 0u;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          if (4 * w + t < nbytes) word |= uint32_t(RLX_LDG(src + 4 * w + t)) << (8 * t);
        }
        cw[w] = word;
      }
    }
    // two chains (even and odd groups) for the adds' latency, joined in a fixed order
    float acc[2][BT];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int b = 0; b < BT; ++b) acc[h][b] = 0.f;
    auto add_groups = [&](auto ragged_tag) {
      constexpr bool kRagged = decltype(ragged_tag)::value;
#pragma unroll
      for (int g = 0; g < GS; ++g) {
        if (kRagged && g >= gn) break;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const int byte = g * M + m;
          const uint32_t code = (cw[byte / 4] >> (8 * (byte % 4))) & 0xffu;
          float v[BT];
          lut_load<BT>(L + ((m * GS + g) * E + static_cast<int>(code)) * BT, v);
#pragma unroll
          for (int b = 0; b < BT; ++b) acc[g & 1][b] += v[b];
        }
      }
    };
    if (full) {
      add_groups(std::false_type{});
    } else {
      add_groups(std::true_type{});
    }
#pragma unroll
    for (int b = 0; b < BT; ++b) {
      if (b < nb) partial[(slice * nb + b) * N + j] = acc[0][b] + acc[1][b];
    }
  }
}

// out[b, j] = s_j * sum_{slice} partial[slice][b][j] + bias_j, slices in order.
template <LutIn kind>
__global__ void __launch_bounds__(kLutThreads)
    lut_reduce_kernel(const float* __restrict__ partial, const lut_elem_t<kind>* __restrict__ scales,
                      const lut_elem_t<kind>* __restrict__ bias, lut_elem_t<kind>* __restrict__ out,
                      int64_t nb, int64_t N, int64_t slices) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kLutThreads + threadIdx.x;
  if (i >= nb * N) return;
  const int64_t j = i % N;
  float v = 0.f;
  for (int64_t s = 0; s < slices; ++s) v += partial[s * nb * N + i];
  if (scales) v *= lut_to_float<kind>(scales[j]);
  if (bias) v += lut_to_float<kind>(bias[j]);
  out[i] = lut_from_float<kind>(v);
}

// Launch shape: SB code bytes per row and slice (16 for four batch rows, keeping the table at
// 64 KiB with E = 256), rpt output rows per thread (2 where that still leaves two blocks per
// SM, amortizing each table over more rows).
struct LutShape {
  int bt, sb, rpt;
  int64_t slices, chunks;
};

inline LutShape lut_shape(int64_t rows, int64_t N, int64_t G, int M, int sms, int rpt = 0) {
  LutShape s{};
  s.bt = rows <= 1 ? 1 : rows <= 2 ? 2 : 4;
  s.sb = s.bt == 4 ? 16 : 32;
  const int64_t gs = lut_slice_groups(s.sb, M);
  s.slices = (G + gs - 1) / gs;
  const int64_t chunks2 = (N + 2 * kLutThreads - 1) / (2 * kLutThreads);
  s.rpt = rpt > 0 ? rpt : chunks2 * s.slices >= 2 * int64_t(sms) ? 2 : 1;
  s.chunks = (N + int64_t(kLutThreads) * s.rpt - 1) / (int64_t(kLutThreads) * s.rpt);
  return s;
}

}  // namespace rlx::codebook::cuda
