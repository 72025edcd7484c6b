// One-row codebook forward ("gather-dot"): float16 / bfloat16 x of one row, D = 8, M <= 2.
// out[j] = s_j * sum_{g,m} x_g . C[m, I[j,g,m]] + bias_j in one launch, float32 products and
// sums, no dense weight, no lookup table and no second reduction kernel.
//
// K is cut into parts of kGemvPartGroups groups. In a part, lane l owns the kGemvLaneGroups
// consecutive groups from l * kGemvLaneGroups: its x values stay in registers (float32) for as
// long as the warp works on that part, and its codes for one output row are one 4-byte (M = 1)
// or 8-byte (M = 2) copy, 128 or 256 contiguous bytes for the warp. A warp takes passes of
// kGemvPassRows output rows of its block (their codes copied into shared memory up to
// kGemvStages passes ahead, see the kernel), looks up each code's entry with one 16-byte
// shared-memory read and adds its 8 products into the row's float32 sum; the pass's 8 sums
// are then added across the lanes by a transposing butterfly (9 shuffles for 8 rows instead
// of 40). Each (part, row) sum is written once to shared memory,
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
constexpr int kGemvStages = 4;                            // items' codes in flight per warp

// Launch shape: `rows` output rows per block (a multiple of kGemvPassRows), `part_warps`
// warps across the parts (the block's warps are part_warps x warps / part_warps).
struct GemvShape {
  int rows, part_warps, parts;
  int64_t blocks;
};

// Shared memory of gemv_forward_kernel: the codebook copies [M][E][copies][8 values], the
// warps' code slots [warps][stages][8 rows][32 lanes][4 M bytes] and the partial sums
// [parts][rows].
inline size_t gemv_smem(int M, int E, int parts, int rows, int copies = kGemvCopies,
                        int warps = kGemvWarps, int stages = kGemvStages) {
  return static_cast<size_t>(M) * E * copies * 16 +
         static_cast<size_t>(warps) * stages * kGemvPassRows * 32 * 4 * M +
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
// of the block's rows: its items, in that order. `wide_codes`: every row's code bytes start at
// a multiple of 4 M bytes (G % 4 == 0 and idx aligned), so a lane's bytes are one copy. x must
// be 16-byte aligned.
//
// Code pipeline: each warp has STAGES slots in shared memory, one item's codes each (8 rows x
// 32 lanes x 4 M bytes). A lane copies only the bytes it reads itself (cp.async of 4 M bytes
// per row, one commit group per item), so no barrier orders the slots: item k is read after
// the lane's wait leaves at most STAGES - 1 younger groups in flight, and its slot is refilled
// with item k + STAGES once its products are done. The first STAGES items are requested before
// the codebook is stored, so a warp with at most STAGES items has all its codes in flight from
// the start and the DRAM latency is paid once, not once per item.
template <Bits16 kind, int M, int WARPS = kGemvWarps, int COPIES = kGemvCopies,
          int STAGES = kGemvStages>
__global__ void __launch_bounds__(WARPS * 32)
    gemv_forward_kernel(const uint16_t* __restrict__ x, const uint8_t* __restrict__ idx,
                        const uint16_t* __restrict__ cb, const uint16_t* __restrict__ scales,
                        const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int64_t N,
                        int64_t G, int E, int rows, int parts, int part_warps, bool wide_codes) {
  constexpr int THREADS = WARPS * 32, LG = kGemvLaneGroups, PR = kGemvPassRows;
  RLX_MMA_SMEM(smem_raw);
  uint4* C = reinterpret_cast<uint4*>(smem_raw);  // [M][E][copies]
  GemvCodes<M>* slots = reinterpret_cast<GemvCodes<M>*>(
      smem_raw + static_cast<size_t>(M) * E * COPIES * 16);  // [warps][stages][rows][lanes]
  float* partial = reinterpret_cast<float*>(
      smem_raw + static_cast<size_t>(M) * E * COPIES * 16 +
      static_cast<size_t>(WARPS) * STAGES * PR * 32 * sizeof(GemvCodes<M>));
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wp = warp % part_warps, wr = warp / part_warps, row_warps = WARPS / part_warps;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * rows;
  const int nrows = static_cast<int>(N - j0 < rows ? N - j0 : rows);
  const int passes = (nrows + PR - 1) / PR;
  const int64_t row_bytes = G * M;
  // the warp's items: its parts times its passes of each part
  const int my_passes = wr < passes ? (passes - wr + row_warps - 1) / row_warps : 0;
  const int my_parts = wp < parts ? (parts - wp + part_warps - 1) / part_warps : 0;
  const int items = my_passes * my_parts;
  GemvCodes<M>* my_slots = slots + static_cast<size_t>(warp) * STAGES * PR * 32 + lane;
  auto part_of = [&](int k) { return wp + part_warps * (k / my_passes); };
  auto pass_of = [&](int k) { return wr + row_warps * (k % my_passes); };

  // Requests item k's codes into slot k % STAGES and commits a group (empty past the items).
  // Rows past the block's end and groups past K get code 0 (read, never used).
  auto request = [&](int k) {
    if (k < items) {
      const int p = part_of(k), ps = pass_of(k);
      const int64_t g0 = static_cast<int64_t>(p) * kGemvPartGroups + lane * LG;
      const bool whole = wide_codes && g0 + LG <= G;
      GemvCodes<M>* slot = my_slots + (k % STAGES) * PR * 32;
#pragma unroll
      for (int i = 0; i < PR; ++i) {
        const int r = ps * PR + i;
        const uint8_t* src = idx + (j0 + r) * row_bytes + g0 * M;
        if (whole && r < nrows) {
          copy_async<4 * M>(slot + i * 32, src);
        } else {
          GemvCodes<M> c;
#pragma unroll
          for (int m = 0; m < M; ++m) c.w[m] = 0u;
          if (r < nrows) {
#pragma unroll
            for (int b = 0; b < LG * M; ++b) {
              if (g0 + b / M < G) c.w[b / 4] |= uint32_t(RLX_LDG(src + b)) << (8 * (b % 4));
            }
          }
          slot[i * 32] = c;
        }
      }
    }
    async_commit();
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

  // The first STAGES items' codes and the first part's x are requested before the codebook is
  // stored, so their latency overlaps the copies.
#pragma unroll
  for (int k = 0; k < STAGES; ++k) request(k);
  if (items > 0) load_x(part_of(0));
  // Thread i stores entry i's copies, copy (c + i) % 8 at step c: the 8 threads of a quarter
  // warp store to 8 different bank groups. An entry is one 16-byte load where cb allows it.
  const bool cb16 = reinterpret_cast<uintptr_t>(cb) % 16 == 0;
  for (int i = tid; i < M * E; i += THREADS) {
    uint4 v;
    if (cb16) {
      v = RLX_LDG(reinterpret_cast<const uint4*>(cb) + i);
    } else {
      uint32_t h[8];
#pragma unroll
      for (int t = 0; t < 8; ++t) h[t] = RLX_LDG(cb + static_cast<size_t>(i) * 8 + t);
      v = uint4{h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16};
    }
#pragma unroll
    for (int c = 0; c < COPIES; ++c) C[i * COPIES + (c + i) % COPIES] = v;
  }
  __syncthreads();

  const uint4* Cl = C + lane % COPIES;  // the lane's copy of entry 0 of codebook 0
  for (int k = 0; k < items; ++k) {
    const int p = part_of(k), ps = pass_of(k);
    async_wait<STAGES - 1>();  // item k's group (and every older one) has landed
    GemvCodes<M> cur[PR];
    const GemvCodes<M>* slot = my_slots + (k % STAGES) * PR * 32;
#pragma unroll
    for (int i = 0; i < PR; ++i) cur[i] = slot[i * 32];

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
    // the slot's codes are in registers and used: refill it
    request(k + STAGES);
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

    if (k + 1 < items && part_of(k + 1) != p) load_x(part_of(k + 1));
  }
  async_wait<0>();  // no copy outlives the block
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
