// Small-batch codebook forward on tensor cores: float16 / bfloat16 x, D = 8, M <= 2, at most 16
// rows. out[b, j] = s_j * sum_k x[b, k] W[j, k] + bias_j, W[j, g*8 + t] = sum_m C[m, I[j,g,m], t],
// computed as mma.sync m16n8k16 products (16-bit inputs, float32 accumulation) with A = 16 rows
// of W, looked up in the codebook (shared memory) from the codes, and B = x^T.
//
// One block per 16 output rows; its kMmaWarps warps split K into windows of 16 groups (8
// k-steps), warp w taking windows w, w + kMmaWarps, ... Each code byte and each x value is
// read by one warp of the block, straight from global memory into registers (8- or 16-byte
// loads; the next window's loads are issued before the current window is multiplied). The
// warps' partial sums are added in warp order through shared memory: no atomics, so results
// are bitwise reproducible.
//
// Fragment mapping. Lane (gid = lane / 4, tig = lane % 4) holds the A elements of rows gid and
// gid + 8 at the mma's logical columns 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9 and the B
// elements of batch row gid at the same four logical k (PTX ISA, mma.m16n8k16 .f16). A sum
// over k does not depend on which real k each logical column stands for, as long as A and B
// agree, so k-step s of a window at group g0 gives lane (gid, tig) the four real k
// t = 4 (tig & 1) .. 4 (tig & 1) + 3 of group g0 + s + 8 (tig >> 1): one 8-byte load of a
// codebook entry (A) and one of x (B), and the lane's codes for the window are the 8 bytes
// (8 M for M = 2) of groups g0 + 8 (tig >> 1) .. + 7 of its two rows.
//
// The weights are the input dtype's: with M = 2 the two entries are added in it (one rounding,
// as the dense path's dequantized weight); with M = 1 they are the codebook's values. Products
// and sums are float32.
//
// This header is also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION): there the
// 16-bit types are bit patterns converted in software and the mma is emulated per warp.
#pragma once

#include <cstdint>

namespace rlx::codebook::cuda {

constexpr int kMmaWarps = 8;       // warps per block, splitting K
constexpr int kMmaTileRows = 16;   // output rows per block (the mma's M)
constexpr int kWindowGroups = 16;  // groups per window: 8 k-steps of 2 groups
constexpr int kMmaMaxRows = 16;    // batch rows: two n8 tiles

enum class Bits16 { kHalf, kBFloat16 };

#ifndef RLX_CUDA_EMULATION
template <Bits16 kind>
__device__ __forceinline__ float bits_to_float(uint16_t u) {
  if constexpr (kind == Bits16::kHalf) {
    return __half2float(__ushort_as_half(u));
  } else {
    return __bfloat162float(__ushort_as_bfloat16(u));
  }
}
template <Bits16 kind>
__device__ __forceinline__ uint16_t float_to_bits(float f) {
  if constexpr (kind == Bits16::kHalf) {
    return __half_as_ushort(__float2half_rn(f));
  } else {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}
// Two packed 16-bit sums, rounded once to nearest (bf16: a * 1 + b, sm_80's fma.bf16x2).
template <Bits16 kind>
__device__ __forceinline__ uint32_t add2(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (kind == Bits16::kHalf) {
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(0x3f803f80u), "r"(b));
  }
  return r;
}
// c += A B, A 16 x 16 (4 registers), B 16 x 8 (2 registers), c float32 16 x 8 (4 per lane).
template <Bits16 kind>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
  if constexpr (kind == Bits16::kHalf) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}
#define RLX_MMA_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define RLX_LDG(p) __ldg(p)
#else
template <Bits16 kind>
inline float bits_to_float(uint16_t u) {
  return kind == Bits16::kHalf ? emu::half_to_float(u) : emu::bf16_to_float(u);
}
template <Bits16 kind>
inline uint16_t float_to_bits(float f) {
  return kind == Bits16::kHalf ? emu::float_to_half(f) : emu::float_to_bf16(f);
}
template <Bits16 kind>
inline uint32_t add2(uint32_t a, uint32_t b) {
  auto one = [](uint32_t x, uint32_t y, int sh) {
    const float s = bits_to_float<kind>(uint16_t(x >> sh)) + bits_to_float<kind>(uint16_t(y >> sh));
    return uint32_t(float_to_bits<kind>(s)) << sh;
  };
  return one(a, b, 0) | one(a, b, 16);
}
template <Bits16 kind>
inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::mma_m16n8k16(c, a, b, [](uint16_t u) { return bits_to_float<kind>(u); });
}
#define RLX_MMA_SMEM(name) unsigned char* name = dynamic_smem<unsigned char>()
#define RLX_LDG(p) (*(p))
#endif

// Loads of 8 and 16 bytes (their addresses aligned to that size).
struct Bytes8 {
  uint32_t w[2];
};
struct Bytes16 {
  uint32_t w[4];
};
__device__ __forceinline__ Bytes8 load8(const void* p) {
  const uint2 v = RLX_LDG(reinterpret_cast<const uint2*>(p));
  return Bytes8{{v.x, v.y}};
}
__device__ __forceinline__ Bytes16 load16(const void* p) {
  const uint4 v = RLX_LDG(reinterpret_cast<const uint4*>(p));
  return Bytes16{{v.x, v.y, v.z, v.w}};
}

// One window's operands of one lane: B (x) for NT n8 tiles and 8 k-steps, and the codes of
// rows gid and gid + 8 (8 groups, M bytes each).
template <int NT, int M>
struct WindowOperands {
  uint32_t b[NT][8][2];
  uint32_t codes[2][2 * M];  // [row][word]: code (s, m) is byte s * M + m
};

template <int NT, int M>
__device__ __forceinline__ void load_window(WindowOperands<NT, M>& w, const uint16_t* __restrict__ x,
                                            const uint8_t* __restrict__ idx, int64_t g0,
                                            int64_t G, int64_t N, int64_t j0, int nb,
                                            bool fast_codes, int lane) {
  const int gid = lane / 4, tig = lane % 4, half = tig >> 1, quarter = tig & 1;
  const int64_t K = G * 8;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int n = nt * 8 + gid;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int64_t g = g0 + s + 8 * half;
      if (n < nb && g < G) {
        const Bytes8 v = load8(x + n * K + g * 8 + 4 * quarter);
        w.b[nt][s][0] = v.w[0];
        w.b[nt][s][1] = v.w[1];
      } else {
        w.b[nt][s][0] = 0u;
        w.b[nt][s][1] = 0u;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j0 + gid + 8 * r;
    const int64_t gs = g0 + 8 * half;  // the lane's 8 groups start here
    if (j < N && fast_codes && gs + 8 <= G) {
      const uint8_t* src = idx + (j * G + gs) * M;
      if constexpr (M == 1) {
        const Bytes8 v = load8(src);
        w.codes[r][0] = v.w[0];
        w.codes[r][1] = v.w[1];
      } else {
        const Bytes16 v = load16(src);
#pragma unroll
        for (int q = 0; q < 4; ++q) w.codes[r][q] = v.w[q];
      }
    } else {  // ragged tail, unaligned codes or rows past N: byte by byte, code 0 outside
#pragma unroll
      for (int q = 0; q < 2 * M; ++q) w.codes[r][q] = 0u;
      if (j < N) {  // (unrolled: register arrays take compile-time indices only)
#pragma unroll
        for (int s = 0; s < 8; ++s)
#pragma unroll
          for (int m = 0; m < M; ++m)
            if (gs + s < G)
              w.codes[r][(s * M + m) / 4] |= uint32_t(idx[(j * G + gs + s) * M + m])
                                             << (8 * ((s * M + m) % 4));
      }
    }
  }
}

template <Bits16 kind, int NT, int M>
__global__ void __launch_bounds__(kMmaWarps * 32)
    mma_forward_kernel(const uint16_t* __restrict__ x, const uint8_t* __restrict__ idx,
                       const uint16_t* __restrict__ cb, const uint16_t* __restrict__ scales,
                       const uint16_t* __restrict__ bias, uint16_t* __restrict__ out,
                       int64_t B, int64_t N, int64_t G, int E, bool fast_codes) {
  RLX_MMA_SMEM(smem_raw);
  constexpr int BT = 8 * NT;
  uint16_t* C = reinterpret_cast<uint16_t*>(smem_raw);  // [M][E][8]
  float* red = reinterpret_cast<float*>(smem_raw + static_cast<size_t>(M) * E * 16);
  for (int i = threadIdx.x; i < M * E * 8; i += blockDim.x) C[i] = cb[i];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, tig = lane % 4, half = tig >> 1, quarter = tig & 1;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kMmaTileRows;
  const int nb = static_cast<int>(B < BT ? B : BT);
  const int64_t windows = (G + kWindowGroups - 1) / kWindowGroups;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
  WindowOperands<NT, M> next{};
  if (warp < windows)
    load_window<NT, M>(next, x, idx, warp * int64_t(kWindowGroups), G, N, j0, nb, fast_codes,
                       lane);
  __syncthreads();  // C is staged
  for (int64_t wi = warp; wi < windows; wi += kMmaWarps) {
    const WindowOperands<NT, M> cur = next;
    const int64_t g0 = wi * kWindowGroups;
    if (wi + kMmaWarps < windows)
      load_window<NT, M>(next, x, idx, g0 + int64_t(kMmaWarps) * kWindowGroups, G, N, j0, nb,
                         fast_codes, lane);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const bool valid = g0 + s + 8 * half < G;  // A is zero past K (B is too)
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        uint32_t lo = 0u, hi = 0u;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const int byte = s * M + m;
          const uint32_t code = (cur.codes[r][byte / 4] >> (8 * (byte % 4))) & 0xffu;
          const uint2 e = *reinterpret_cast<const uint2*>(C + (m * E + code) * 8 + 4 * quarter);
          lo = m == 0 ? e.x : add2<kind>(lo, e.x);
          hi = m == 0 ? e.y : add2<kind>(hi, e.y);
        }
        a[r] = valid ? lo : 0u;      // rows gid (+ 8 r), logical k 2 tig, 2 tig + 1
        a[2 + r] = valid ? hi : 0u;  // logical k 2 tig + 8, 2 tig + 9
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma_16816<kind>(acc[nt], a, cur.b[nt][s]);
    }
  }
  // red[warp][row][col], row = output row in the tile, col = batch row
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = gid + 8 * (i / 2), col = nt * 8 + 2 * tig + (i % 2);
      red[(warp * kMmaTileRows + row) * BT + col] = acc[nt][i];
    }
  __syncthreads();
  for (int t = threadIdx.x; t < kMmaTileRows * BT; t += blockDim.x) {
    const int row = t % kMmaTileRows, col = t / kMmaTileRows;
    const int64_t j = j0 + row;
    if (j >= N || col >= nb) continue;
    float v = 0.f;
    for (int w = 0; w < kMmaWarps; ++w) v += red[(w * kMmaTileRows + row) * BT + col];
    if (scales) v *= bits_to_float<kind>(scales[j]);
    if (bias) v += bits_to_float<kind>(bias[j]);
    out[col * N + j] = float_to_bits<kind>(v);
  }
}

// Shared memory of mma_forward_kernel: the codebook [M][E][8] and the warps' partial sums.
inline size_t mma_forward_smem(int64_t M, int64_t E, int NT) {
  return static_cast<size_t>(M * E * 16) +
         static_cast<size_t>(kMmaWarps) * kMmaTileRows * 8 * NT * sizeof(float);
}

}  // namespace rlx::codebook::cuda
