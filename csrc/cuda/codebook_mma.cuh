// Small-batch codebook forward on tensor cores: float16 / bfloat16 x, D = 8, M <= 2, at most 16
// rows. out[b, j] = s_j * sum_k x[b, k] W[j, k] + bias_j, W[j, g*8 + t] = sum_m C[m, I[j,g,m], t],
// computed as mma.sync m16n8k16 products (16-bit inputs, float32 accumulation) with A = 16 rows
// of W, looked up in the codebook (shared memory) from the codes, and B = x^T.
//
// One block per 16 RT output rows (RT row tiles); its warps split K into windows of 16 groups
// (8 k-steps), warp w taking windows w, w + warps, ... At its start the block issues
// asynchronous copies (cp.async) of the codebook and of all its rows' codes into shared memory,
// so the codes' memory latency is paid about once rather than once per window; the products
// of a round of windows start as soon as its copies have landed. x is read from global memory
// into registers (8-byte loads, one window ahead) and each value serves all RT row tiles. The
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
// A holds the codebook's values themselves: with M = 2 each codebook's entries go through
// their own mma into the same float32 sums. Adding the two entries first would save an mma
// but round every weight to the input dtype: an error that grows with sqrt(K), has no
// counterpart in the math, and at long K outgrows the output's own rounding.
//
// This header is also compiled on the CPU by tests/cuda_emu (RLX_CUDA_EMULATION): there the
// 16-bit types are bit patterns converted in software and the mma is emulated per warp.
#pragma once

#include <cstdint>
#include <type_traits>
#ifdef RLX_CUDA_EMULATION
#include <cstring>
#include <utility>
#include <vector>
#endif

namespace rlx::codebook::cuda {

constexpr int kMmaTileRows = 16;   // output rows of a row tile (the mma's M)
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

// Asynchronous 16-byte copies global -> shared (cp.async, sm_80+), committed in groups; a wait
// takes the number of most recent groups allowed to stay in flight.
#ifndef RLX_CUDA_EMULATION
__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#else
// The emulation keeps cp.async's contract rather than copying at once: each thread's copies
// land only when a wait retires their group, so a read before its wait (and barrier) sees
// the NaN bytes shared memory starts with.
struct AsyncCopies {
  struct Copy {
    void* dst;
    const void* src;
  };
  std::vector<Copy> open;                 // issued since the last commit
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
};
inline thread_local AsyncCopies async_copies;
inline void copy16_async(void* smem, const void* gmem) {
  async_copies.open.push_back({smem, gmem});
}
inline void async_commit() {
  async_copies.groups.push_back(std::move(async_copies.open));
  async_copies.open.clear();
}
template <int N>
inline void async_wait() {
  auto& g = async_copies.groups;
  while (g.size() > size_t(N)) {
    for (const auto& c : g.front()) std::memcpy(c.dst, c.src, 16);
    g.erase(g.begin());
  }
}
#endif
// Waits until at most `pending` groups are in flight (more than 7 waits as for 7: safe).
__device__ __forceinline__ void async_wait_at_most(int pending) {
  switch (pending) {
    case 0: async_wait<0>(); break;
    case 1: async_wait<1>(); break;
    case 2: async_wait<2>(); break;
    case 3: async_wait<3>(); break;
    case 4: async_wait<4>(); break;
    case 5: async_wait<5>(); break;
    case 6: async_wait<6>(); break;
    default: async_wait<7>(); break;
  }
}

// Bytes per output row of the block's codes in shared memory: the row's G*M code bytes and a
// pad that puts consecutive rows 16 M bytes apart in the banks (conflict-free window reads).
__host__ __device__ inline int64_t mma_code_stride(int64_t G, int M) {
  return (G * M + 15) / 16 * 16 + 16 * M;
}

// Whether the codes can be copied with cp.async: every row's G*M bytes are whole 16-byte
// vectors at 16-byte addresses.
inline bool mma_async_codes(int64_t G, int M, const void* idx) {
  return (G * M) % 16 == 0 && reinterpret_cast<uintptr_t>(idx) % 16 == 0;
}

// Shared memory of mma_forward_kernel: the codebook [M][E][8], then the block's codes
// [16 RT][stride] (reused for the warps' partial sums once the products are done).
inline size_t mma_forward_smem(int64_t M, int64_t E, int NT, int RT, int warps, int64_t G) {
  const size_t codes = static_cast<size_t>(kMmaTileRows * RT * mma_code_stride(G, int(M)));
  const size_t red = static_cast<size_t>(warps) * kMmaTileRows * RT * 8 * NT * sizeof(float);
  return static_cast<size_t>(M * E * 16) + (codes > red ? codes : red);
}

// B (x) of one window for NT n8 tiles and 8 k-steps: lane (gid, tig) holds x[n = 8 nt + gid]
// at the four k of k-step s (zeros past the batch and past K).
template <int NT>
struct XWindow {
  uint32_t b[NT][8][2];
};

template <int NT>
__device__ __forceinline__ void load_x_window(XWindow<NT>& w, const uint16_t* __restrict__ x,
                                              int64_t g0, int64_t G, int nb, int lane) {
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
}

// One block per 16 RT output rows, `WARPS` warps splitting K in windows: window w (16 groups)
// belongs to warp w % WARPS, and round r is every warp's r-th window. At the start the block
// issues cp.async copies of its whole codebook and of all its rows' codes, one commit group
// per round, so every code byte is in flight at once; round r's products start when its group
// has landed. A lane's B (x) comes from global memory (one window ahead) and serves the RT row
// tiles. `async_codes`: the rows' code bytes are whole 16-byte vectors at 16-byte addresses
// (else they are copied byte by byte); `async_cb`: the codebook is 16-byte aligned.
template <Bits16 kind, int NT, int M, int RT, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    mma_forward_kernel(const uint16_t* __restrict__ x, const uint8_t* __restrict__ idx,
                       const uint16_t* __restrict__ cb, const uint16_t* __restrict__ scales,
                       const uint16_t* __restrict__ bias, uint16_t* __restrict__ out,
                       int64_t B, int64_t N, int64_t G, int E, bool async_codes, bool async_cb) {
  RLX_MMA_SMEM(smem_raw);
  constexpr int BT = 8 * NT, ROWS = kMmaTileRows * RT, THREADS = WARPS * 32;
  const int64_t stride = mma_code_stride(G, M);
  uint16_t* C = reinterpret_cast<uint16_t*>(smem_raw);  // [M][E][8]
  const int nb = static_cast<int>(B < BT ? B : BT);
  uint8_t* codes = smem_raw + static_cast<size_t>(M) * E * 16;  // [ROWS][stride]
  float* red = reinterpret_cast<float*>(codes);                  // [WARPS][ROWS][BT], later
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int gid = lane / 4, tig = lane % 4, half = tig >> 1, quarter = tig & 1;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * ROWS;
  const int64_t windows = (G + kWindowGroups - 1) / kWindowGroups;
  const int rounds = static_cast<int>((windows + WARPS - 1) / WARPS);
  const int64_t round_bytes = int64_t(kWindowGroups) * WARPS * M;  // per row
  const int64_t row_bytes = G * M;

  if (async_cb) {
    for (int i = tid; i < M * E; i += THREADS) copy16_async(C + i * 8, cb + i * 8);
  } else {
    for (int i = tid; i < M * E * 8; i += THREADS) C[i] = cb[i];
  }
  async_commit();
  if (async_codes) {
    for (int r = 0; r < rounds; ++r) {
      const int64_t b0 = r * round_bytes;
      const int64_t b1 = b0 + round_bytes < row_bytes ? b0 + round_bytes : row_bytes;
      const int per_row = static_cast<int>((b1 - b0) / 16);
      for (int c = tid; c < ROWS * per_row; c += THREADS) {
        const int row = c / per_row;
        const int64_t off = b0 + int64_t(c % per_row) * 16;
        if (j0 + row < N)
          copy16_async(codes + row * stride + off, idx + (j0 + row) * row_bytes + off);
      }
      async_commit();
    }
    if (j0 + ROWS > N) {  // rows past N: code 0 (their sums are not stored)
      for (int64_t i = tid; i < ROWS * stride; i += THREADS)
        if (j0 + i / stride >= N) codes[i] = 0;
    }
  } else {
    for (int64_t i = tid; i < ROWS * row_bytes; i += THREADS) {
      const int64_t row = i / row_bytes, k = i % row_bytes;
      codes[row * stride + k] = j0 + row < N ? idx[(j0 + row) * row_bytes + k] : uint8_t(0);
    }
  }

  float acc[RT][NT][4];
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[t][nt][i] = 0.f;
  const uint16_t* Cm[M];  // the lane's half of entry 0 of each codebook
#pragma unroll
  for (int m = 0; m < M; ++m) Cm[m] = C + m * E * 8 + 4 * quarter;
  XWindow<NT> next{};
  if (warp < windows)
    load_x_window<NT>(next, x, warp * int64_t(kWindowGroups), G, nb, lane);
  for (int r = 0; r < rounds; ++r) {
    async_wait_at_most(async_codes ? rounds - 1 - r : 0);
    __syncthreads();  // round r's codes (and, the first time, the codebook) are in place
    const int64_t wi = int64_t(r) * WARPS + warp;
    if (wi >= windows) continue;
    const XWindow<NT> cur = next;
    const int64_t g0 = wi * kWindowGroups;
    if (wi + WARPS < windows)
      load_x_window<NT>(next, x, g0 + int64_t(WARPS) * kWindowGroups, G, nb, lane);
    // the lane's codes: groups g0 + 8 half .. + 7 of rows 16 t + gid + 8 q
    uint32_t cw[RT][2][2 * M];
#pragma unroll
    for (int t = 0; t < RT; ++t)
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint8_t* p = codes + (16 * t + gid + 8 * q) * stride + (g0 + 8 * half) * M;
        if constexpr (M == 1) {
          const uint2 v = *reinterpret_cast<const uint2*>(p);
          cw[t][q][0] = v.x, cw[t][q][1] = v.y;
        } else {
          const uint4 v = *reinterpret_cast<const uint4*>(p);
          cw[t][q][0] = v.x, cw[t][q][1] = v.y, cw[t][q][2] = v.z, cw[t][q][3] = v.w;
        }
      }
    // k-step s: every lane looks up its rows' entries (8 bytes at Cm[m] + code * 8) for the
    // groups g0 + s + 8 half; a window that runs past K (ragged) masks its codes and A.
    auto products = [&](auto ragged_tag) {
      constexpr bool kRagged = decltype(ragged_tag)::value;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const bool valid = !kRagged || g0 + s + 8 * half < G;  // A is zero past K (B is too)
#pragma unroll
        for (int t = 0; t < RT; ++t)
#pragma unroll
          for (int m = 0; m < M; ++m) {  // one product per codebook: the entries are not added
            uint32_t a[4];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
              const int byte = s * M + m;
              uint32_t code = (cw[t][q][byte / 4] >> (8 * (byte % 4))) & 0xffu;
              if (kRagged) code = valid ? code : 0u;
              const uint2 e = *reinterpret_cast<const uint2*>(Cm[m] + code * 8);
              a[q] = kRagged && !valid ? 0u : e.x;      // rows gid (+ 8 q), logical k 2 tig, +1
              a[2 + q] = kRagged && !valid ? 0u : e.y;  // logical k 2 tig + 8, 2 tig + 9
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mma_16816<kind>(acc[t][nt], a, cur.b[nt][s]);
          }
      }
    };
    if (g0 + kWindowGroups <= G) {
      products(std::false_type{});
    } else {
      products(std::true_type{});
    }
  }
  __syncthreads();  // every warp is done with the codes: their space takes the partial sums
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * t + gid + 8 * (i / 2), col = nt * 8 + 2 * tig + (i % 2);
        red[(warp * ROWS + row) * BT + col] = acc[t][nt][i];
      }
  __syncthreads();
  for (int t = tid; t < ROWS * BT; t += THREADS) {
    const int row = t % ROWS, col = t / ROWS;
    const int64_t j = j0 + row;
    if (j >= N || col >= nb) continue;
    float v = 0.f;
    for (int w = 0; w < WARPS; ++w) v += red[(w * ROWS + row) * BT + col];
    if (scales) v *= bits_to_float<kind>(scales[j]);
    if (bias) v += bits_to_float<kind>(bias[j]);
    out[col * N + j] = float_to_bits<kind>(v);
  }
}

}  // namespace rlx::codebook::cuda
