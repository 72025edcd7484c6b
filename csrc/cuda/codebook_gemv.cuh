// One-row codebook forward ("gather-dot"): float16 / bfloat16 x of one row, D = 8, M <= 2.
// out[j] = s_j * sum_{g,m} x_g . C[m, I[j,g,m]] + bias_j in one launch, float32 products and
// sums, no dense weight, no lookup table and no second reduction kernel.
//
// K is cut into parts of kGemvPartGroups groups. In a part, lane l owns the kGemvLaneGroups
// consecutive groups from l * kGemvLaneGroups: its x values stay in registers (float32) for as
// long as the warp works on that part, and its codes for one output row are one 4-byte (M = 1)
// or 8-byte (M = 2) load, 128 or 256 contiguous bytes for the warp. A warp takes passes of
// kGemvPassRows output rows of its block (their codes loaded one pass ahead), looks up each
// code's entry with one 16-byte shared-memory read and adds its 8 products into the row's
// float32 sum; the pass's 8 sums are then added across the lanes by a transposing butterfly (9
// shuffles for 8 rows instead of 40). Each (part, row) sum is written once to shared memory,
// and the block adds a row's parts in part order and applies scales and bias. Every sum has a
// fixed order and there are no atomics, so results are bitwise reproducible.
//
// Shared-memory banks: the codebook is stored kGemvCopies = 8 times, entry e's copy c at
// 16-byte slot e * 8 + c, and lane l reads copy l % 8. A 16-byte read is served a quarter warp
// (8 consecutive lanes) at a time; those 8 lanes read 8 different 16-byte bank groups whatever
// their codes, so the random entries never conflict. With a single copy the kernel measured
// 16-38% slower on an H100 (N = K = 4096 to 8192, docs/benchmarks.md).
//
// Compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION) as codebook_mma.cuh is.
#pragma once

#include "codebook_mma.cuh"

namespace rlx::codebook::cuda {

constexpr int kGemvLaneGroups = 4;                        // groups of a lane in one part
constexpr int kGemvPartGroups = 32 * kGemvLaneGroups;     // groups of a part (K = 1024)
constexpr int kGemvPassRows = 8;                          // output rows of a warp's pass
constexpr int kGemvCopies = 8;                            // copies of the codebook
constexpr int kGemvWarps = 16;                            // warps of a block (8: 7-40% slower)

// Launch shape: `rows` output rows per block (a multiple of kGemvPassRows), `part_warps`
// warps across the parts (the block's warps are part_warps x warps / part_warps).
struct GemvShape {
  int rows, part_warps, parts;
  int64_t blocks;
};

// Shared memory of gemv_forward_kernel: the codebook copies [M][E][copies][8 values] and the
// partial sums [parts][rows].
inline size_t gemv_smem(int M, int E, int parts, int rows, int copies = kGemvCopies) {
  return static_cast<size_t>(M) * E * copies * 16 +
         static_cast<size_t>(parts) * rows * sizeof(float);
}

// About one block per SM (each block stores the codebook copies once, so fewer, larger blocks
// spend less on that; half the rows per block measured 7-23% slower); `rows` > 0 forces the
// rows per block (tests). 0 rows: does not fit in `max_smem` bytes of shared memory.
inline GemvShape gemv_shape(int64_t N, int64_t G, int M, int E, int sms, size_t max_smem,
                            int rows = 0, int warps = kGemvWarps) {
  GemvShape s{};
  s.parts = static_cast<int>((G + kGemvPartGroups - 1) / kGemvPartGroups);
  s.part_warps = 1;
  while (s.part_warps * 2 <= warps && s.part_warps * 2 <= s.parts) s.part_warps *= 2;
  if (rows <= 0) {
    const int64_t per_sm = (N + sms - 1) / (sms > 0 ? sms : 1);
    rows = static_cast<int>((per_sm + kGemvPassRows - 1) / kGemvPassRows * kGemvPassRows);
    if (rows > 256) rows = 256;
  }
  while (rows > kGemvPassRows && gemv_smem(M, E, s.parts, rows) > max_smem) rows -= kGemvPassRows;
  s.rows = gemv_smem(M, E, s.parts, rows) <= max_smem ? rows : 0;
  s.blocks = s.rows > 0 ? (N + s.rows - 1) / s.rows : 0;
  return s;
}

// Two 16-bit values (low half first) as floats.
template <Bits16 kind>
__device__ __forceinline__ void gemv_unpack(uint32_t w, float& lo, float& hi) {
#ifndef RLX_CUDA_EMULATION
  if constexpr (kind == Bits16::kHalf) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
    lo = f.x, hi = f.y;
  } else {  // a bfloat16 is the top half of its float
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
#else
  lo = bits_to_float<kind>(static_cast<uint16_t>(w));
  hi = bits_to_float<kind>(static_cast<uint16_t>(w >> 16));
#endif
}

// A lane's code bytes of one output row in a part: kGemvLaneGroups groups of M bytes.
template <int M>
struct GemvCodes {
  uint32_t w[M];
};

// Block b: output rows j0 = b * rows ... Warp (wp = warp % part_warps, wr = warp / part_warps)
// takes parts wp, wp + part_warps, ... and in each the passes wr, wr + warps / part_warps, ...
// of the block's rows. `wide_codes`: every row's code bytes start at a multiple of 4 M bytes
// (G % 4 == 0 and idx aligned), so a lane's bytes are one load. x must be 16-byte aligned.
template <Bits16 kind, int M, int WARPS = kGemvWarps, int COPIES = kGemvCopies>
__global__ void __launch_bounds__(WARPS * 32)
    gemv_forward_kernel(const uint16_t* __restrict__ x, const uint8_t* __restrict__ idx,
                        const uint16_t* __restrict__ cb, const uint16_t* __restrict__ scales,
                        const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int64_t N,
                        int64_t G, int E, int rows, int parts, int part_warps, bool wide_codes) {
  constexpr int THREADS = WARPS * 32, LG = kGemvLaneGroups, PR = kGemvPassRows;
  RLX_MMA_SMEM(smem_raw);
  uint4* C = reinterpret_cast<uint4*>(smem_raw);  // [M][E][copies]
  float* partial =
      reinterpret_cast<float*>(smem_raw + static_cast<size_t>(M) * E * COPIES * 16);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wp = warp % part_warps, wr = warp / part_warps, row_warps = WARPS / part_warps;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * rows;
  const int nrows = static_cast<int>(N - j0 < rows ? N - j0 : rows);
  const int passes = (nrows + PR - 1) / PR;
  const int64_t row_bytes = G * M;

  // The lane's codes of pass ps of part p (rows past the block's end: code 0, never stored).
  auto fetch = [&](GemvCodes<M> (&c)[PR], int p, int ps) {
    const int64_t g0 = static_cast<int64_t>(p) * kGemvPartGroups + lane * LG;
    const bool whole = wide_codes && g0 + LG <= G;
#pragma unroll
    for (int i = 0; i < PR; ++i) {
      const int r = ps * PR + i;
#pragma unroll
      for (int m = 0; m < M; ++m) c[i].w[m] = 0u;
      if (r >= nrows) continue;
      const uint8_t* src = idx + (j0 + r) * row_bytes + g0 * M;
      if (whole) {
        if constexpr (M == 1) {
          c[i].w[0] = RLX_LDG(reinterpret_cast<const uint32_t*>(src));
        } else {
          const uint2 v = RLX_LDG(reinterpret_cast<const uint2*>(src));
          c[i].w[0] = v.x, c[i].w[1] = v.y;
        }
      } else {
#pragma unroll
        for (int b = 0; b < LG * M; ++b) {
          if (g0 + b / M < G) c[i].w[b / 4] |= uint32_t(RLX_LDG(src + b)) << (8 * (b % 4));
        }
      }
    }
  };
  // The lane's x values of part p, float32 (zero past K).
  float xv[LG][8];
  auto load_x = [&](int p) {
#pragma unroll
    for (int q = 0; q < LG; ++q) {
      const int64_t g = static_cast<int64_t>(p) * kGemvPartGroups + lane * LG + q;
      uint4 v{0u, 0u, 0u, 0u};
      if (g < G) v = RLX_LDG(reinterpret_cast<const uint4*>(x + g * 8));
      gemv_unpack<kind>(v.x, xv[q][0], xv[q][1]);
      gemv_unpack<kind>(v.y, xv[q][2], xv[q][3]);
      gemv_unpack<kind>(v.z, xv[q][4], xv[q][5]);
      gemv_unpack<kind>(v.w, xv[q][6], xv[q][7]);
    }
  };

  // The warp's first pass: its codes and x are requested before the codebook is stored, so
  // their latency overlaps the copies.
  int p = wp, ps = wr;
  bool have = p < parts && ps < passes;
  GemvCodes<M> cur[PR]{}, nxt[PR]{};
  if (have) {
    fetch(cur, p, ps);
    load_x(p);
  }
  // Thread i stores entry i's copies, copy (c + i) % 8 at step c: the 8 threads of a quarter
  // warp store to 8 different bank groups.
  for (int i = tid; i < M * E; i += THREADS) {
    uint32_t h[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) h[t] = RLX_LDG(cb + static_cast<size_t>(i) * 8 + t);
    const uint4 v{h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16};
#pragma unroll
    for (int c = 0; c < COPIES; ++c) C[i * COPIES + (c + i) % COPIES] = v;
  }
  __syncthreads();

  const uint4* Cl = C + lane % COPIES;  // the lane's copy of entry 0 of codebook 0
  while (have) {
    // the warp's next item: the next pass of this part, else the first of its next part
    int np = p, nps = ps + row_warps;
    if (nps >= passes) np = p + part_warps, nps = wr;
    const bool next = np < parts;
    if (next) fetch(nxt, np, nps);

    float acc[PR];
#pragma unroll
    for (int i = 0; i < PR; ++i) acc[i] = 0.f;
    auto products = [&](auto ragged_tag) {
      constexpr bool kRagged = decltype(ragged_tag)::value;
#pragma unroll
      for (int q = 0; q < LG; ++q) {
        // past K (ragged last part): no read, no product (0 * an infinite entry is NaN)
        if (kRagged && static_cast<int64_t>(p) * kGemvPartGroups + lane * LG + q >= G) continue;
#pragma unroll
        for (int i = 0; i < PR; ++i) {
          // the weight W[j, g*8 + t] = sum_m C[m, I[j,g,m], t] in float32 (two 16-bit values
          // add exactly unless their exponents are over 13 apart), never rounded to 16 bits
          float w[8];
#pragma unroll
          for (int m = 0; m < M; ++m) {
            const int byte = q * M + m;
            const uint32_t code = (cur[i].w[byte / 4] >> (8 * (byte % 4))) & 0xffu;
            const uint4 e = Cl[(m * E + static_cast<int>(code)) * COPIES];
            float c[8];
            gemv_unpack<kind>(e.x, c[0], c[1]);
            gemv_unpack<kind>(e.y, c[2], c[3]);
            gemv_unpack<kind>(e.z, c[4], c[5]);
            gemv_unpack<kind>(e.w, c[6], c[7]);
#pragma unroll
            for (int t = 0; t < 8; ++t) w[t] = m == 0 ? c[t] : w[t] + c[t];
          }
#pragma unroll
          for (int t = 0; t < 8; ++t) acc[i] = fmaf(xv[q][t], w[t], acc[i]);
        }
      }
    };
    if ((static_cast<int64_t>(p) + 1) * kGemvPartGroups <= G) {
      products(std::false_type{});
    } else {
      products(std::true_type{});
    }
    // Transposing butterfly: after the xor-16, -8 and -4 steps lane l holds one row's sum over
    // its 4-lane column, row (l >> 2) & 7; the xor-2 and -1 steps finish it.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool up = lane & 16;
      const float send = up ? acc[i] : acc[i + 4], keep = up ? acc[i + 4] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const bool up = lane & 8;
      const float send = up ? acc[i] : acc[i + 2], keep = up ? acc[i + 2] : acc[i];
      acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    {
      const bool up = lane & 4;
      const float send = up ? acc[0] : acc[1], keep = up ? acc[1] : acc[0];
      acc[0] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    }
    acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], 2);
    acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], 1);
    const int r = ps * PR + ((lane >> 2) & 7);
    if ((lane & 3) == 0 && r < nrows) partial[p * rows + r] = acc[0];

    if (next && np != p) load_x(np);
    p = np, ps = nps, have = next;
#pragma unroll
    for (int i = 0; i < PR; ++i) cur[i] = nxt[i];
  }
  __syncthreads();
  for (int r = tid; r < nrows; r += THREADS) {
    float v = 0.f;
    for (int q = 0; q < parts; ++q) v += partial[q * rows + r];
    const int64_t j = j0 + r;
    if (scales) v *= bits_to_float<kind>(scales[j]);
    if (bias) v += bits_to_float<kind>(bias[j]);
    out[j] = float_to_bits<kind>(v);
  }
}

}  // namespace rlx::codebook::cuda
