// The codebook forward's lookup-table path for tiles of one batch row (BT = 1: B <= 2 rows),
// every copy; included by codebook_lut.h, whose lut_forward hands BT = 1 here.
//
// One batch row makes N * groups * M table lookups (2 M for N = K = 4096, D = 8) against
// E * M * K table FMAs, so the gather is the whole cost. Its loop order:
//   work item   = (batch row, chunk of kOneRowItemSteps table steps s = g*M + m, row part):
//                 builds that chunk's tables (64 KiB of floats for E = 256: in L2), then
//   row chunk   = kOneRowChunkRows output rows; for each block of 8 steps (8 KiB of tables:
//                 in L1) those rows' 8 codes each are looked up and added.
// A 64-step chunk is one 64-byte line of each index row, fetched once from memory and reused
// by the chunk's 8 blocks from L2. Sweeping all N rows per block instead (the previous loop
// order) refetched the lines: rows K/D bytes apart (512) map onto 1/8 of the cache sets, so
// 4096 of them do not stay in L2 between blocks (1 row, 1 thread, N = K = 4096, measured in
// a standalone copy of the loops: 1.26 ms for 8-step blocks over all rows, 1.10 with 512-row
// chunks, 0.95 with an index layout packed per block).
//
// Per lookup, GCC emits mov/shr/movzx/add/vaddss for `a += T[k * E + ((p >> 8k) & 255)]`
// (E is a run-time value, and the byte extraction is not folded). The AVX2 copy on x86-64
// therefore gives its tables a fixed stride of 256 floats and does each row's 8 lookups of a
// block in inline asm: one 8-byte load of the codes, then per pair of codes movzx from the low
// and the high byte register and two vaddss with the table offset as displacement, a shift
// by 16 between pairs: 2.5 instructions a lookup (1.10 -> 0.80 ms in the same measurement).
// The adds stay in step order, so every copy sums each output row the same way.
//
// Determinism: the partition (one_row_plan) depends on the shape only; each chunk's partial
// sums start at zero and the chunks are added in chunk order by whichever item finishes a
// (row, part) last, so any thread count gives the same bits. Items are claimed dynamically, so
// a pool thread that starts late (after a dense GEMM, on a busy machine) just claims fewer.
#pragma once

#include <ATen/Parallel.h>

#include <rlx/codebook.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "codebook_kernels.h"
#include "codebook_lut.h"  // LineVector, RLX_UNROLL_BY_16, RLX_NO_SLP, gather_block
#include "codebook_byte_lookup.h"
#include "vec.h"

#if RLX_ISA_AVX && !RLX_ISA_AVX512 && defined(__x86_64__) && \
    (defined(__GNUC__) || defined(__clang__))
#define RLX_ONE_ROW_ASM 1
#else
#define RLX_ONE_ROW_ASM 0
#endif

namespace rlx::codebook::cpu::RLX_ISA_NS {

inline constexpr int64_t kOneRowItemSteps = 64;   // table steps per work item (see above)
inline constexpr int64_t kOneRowChunkRows = 512;  // output rows per pass over the blocks
inline constexpr int64_t kOneRowMinPartRows = 256;  // rows are split no finer than this
inline constexpr int64_t kAsmStride = 256;        // table stride of the asm gather (floats)

// The work partition: groups per step chunk, chunks, and parts of the N output rows (rows
// are split only when there are too few chunks to keep kMinWorkItems items).
struct OneRowPlan {
  int64_t gpi, chunks, parts, part_rows;
};
inline OneRowPlan one_row_plan(const Dims& d, int64_t min_items) {
  OneRowPlan p;
  const int64_t G = std::max<int64_t>(d.groups, 1), N = d.out_features;
  p.gpi = std::max<int64_t>(1, kOneRowItemSteps / d.num_codebooks);
  p.chunks = ceil_div(G, p.gpi);
  const int64_t most = std::max<int64_t>(1, N / kOneRowMinPartRows);
  const int64_t want = std::clamp<int64_t>(ceil_div(min_items, p.chunks * d.rows), 1, most);
  p.part_rows = ceil_div(ceil_div(N, want), 16) * 16;
  p.parts = ceil_div(N, p.part_rows);
  return p;
}

// L[s][c] (stride S floats) = x[g*D:(g+1)*D] . C[m, c] for the ns = ng*M steps of groups
// [g0, g0 + ng), s = (g - g0)*M + m, entries c < E (the rest of a stride-256 row is never
// read: codes are < E, check_index_range). NV vectors of entries stay in registers over t
// (a plain array of them went through the stack: the build took 1/6 of the call).
template <typename scalar_t, typename acc_t>
void build_one_row_tables(const Dims& d, const acc_t* cbT, const scalar_t* xrow, int64_t g0,
                          int64_t ng, int64_t S, acc_t* L) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  using V = SimdVec<acc_t>;
  constexpr int W = kVecLanes<acc_t>, NV = 8;
  for (int64_t g = 0; g < ng; ++g) {
    const scalar_t* xg = xrow + (g0 + g) * D;
    for (int64_t m = 0; m < M; ++m) {
      acc_t* Ls = L + (g * M + m) * S;
      const acc_t* cm = cbT + m * D * E;
      int64_t c0 = 0;
      for (; c0 + NV * W <= E; c0 += NV * W) {
        V a[NV] = {};
        for (int64_t t = 0; t < D; ++t) {
          const acc_t xv = static_cast<acc_t>(xg[t]);
          RLX_UNROLL
          for (int v = 0; v < NV; ++v) a[v] += xv * load_vec(cm + t * E + c0 + v * W);
        }
        RLX_UNROLL
        for (int v = 0; v < NV; ++v) store_vec(Ls + c0 + v * W, a[v]);
      }
      if (c0 < E) {
        std::fill(Ls + c0, Ls + E, acc_t(0));
        for (int64_t t = 0; t < D; ++t) {
          const acc_t xv = static_cast<acc_t>(xg[t]);
          for (int64_t c = c0; c < E; ++c) Ls[c] += xv * cm[t * E + c];
        }
      }
    }
  }
}

#if RLX_ONE_ROW_ASM
// a += T[0*256 + c0] + T[1*256 + c1] + ... + T[7*256 + c7], added in that order, where c0..c7
// are the 8 bytes at codes. The codes sit in a register with addressable high byte (Q: rax,
// rbx, rcx, rdx), so each pair of codes is two movzx (low byte, high byte) and one shift.
inline void add_8_lookups(const uint8_t* codes, const float* T, float& a) {
  uint64_t p, c;
#define RLX_LOOKUP_PAIR(lo, hi)                             \
  "movzbl %b[p], %k[c]\n\t"                                 \
  "vaddss " #lo "(%[T],%[c],4), %[a], %[a]\n\t"             \
  "movzbl %h[p], %k[c]\n\t"                                 \
  "vaddss " #hi "(%[T],%[c],4), %[a], %[a]\n\t"
  asm("movq %[codes], %[p]\n\t"
      RLX_LOOKUP_PAIR(0, 1024) "shrq $16, %[p]\n\t"
      RLX_LOOKUP_PAIR(2048, 3072) "shrq $16, %[p]\n\t"
      RLX_LOOKUP_PAIR(4096, 5120) "shrq $16, %[p]\n\t"
      RLX_LOOKUP_PAIR(6144, 7168)
      : [a] "+x"(a), [p] "=&Q"(p), [c] "=&Q"(c)
      : [codes] "m"(*reinterpret_cast<const uint64_t*>(codes)), [T] "r"(T),
        "m"(*reinterpret_cast<const float(*)[8 * kAsmStride]>(T)));
#undef RLX_LOOKUP_PAIR
}
static_assert(kAsmStride == 256, "add_8_lookups' displacements are k * 256 floats");

// acc[j - j0] += sum_{s < ns} L[s][ip_j[s]] for j in [j0, j1), ip_j = idx + j*row_stride + s0:
// blocks of 8 steps through add_8_lookups, one row after another (out-of-order execution
// overlaps the rows' add chains; accumulators in a local array made GCC pack pairs of them
// into general registers and move them in and out of xmm around every asm block).
// The first block prefetches the index lines kOneRowAhead rows ahead (up to row j_end): after
// a large GEMM they come from DRAM, at a stride the hardware prefetcher does not cover.
inline constexpr int64_t kOneRowAhead = 64;
RLX_NO_SLP inline void gather_one_row_asm(const uint8_t* idx, int64_t row_stride, int64_t s0,
                                          int64_t ns, const float* L, int64_t j0, int64_t j1,
                                          int64_t j_end, float* acc) {
  const int64_t n = j1 - j0;
  const int64_t ahead = std::clamp<int64_t>(j_end - j0 - kOneRowAhead, 0, n);
  int64_t s = 0;
  for (; s + 8 <= ns; s += 8) {
    const float* T = L + s * kAsmStride;
    const uint8_t* ip = idx + j0 * row_stride + s0 + s;
    int64_t j = 0;
    if (s == 0) {
      for (; j < ahead; ++j) {
        const uint8_t* r = ip + (j + kOneRowAhead) * row_stride;
        __builtin_prefetch(r);
        __builtin_prefetch(r + ns - 1);
        add_8_lookups(ip + j * row_stride, T, acc[j]);
      }
    }
    RLX_UNROLL_BY_16
    for (; j < n; ++j) add_8_lookups(ip + j * row_stride, T, acc[j]);
  }
  if (s < ns) {  // the last < 8 steps
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* ip = idx + j * row_stride + s0;
      float a = acc[j - j0];
      for (int64_t t = s; t < ns; ++t) a += L[t * kAsmStride + ip[t]];
      acc[j - j0] = a;
    }
  }
}
#endif

// The lookup-table forward for tiles of one batch row: out[b, j] = s_j * raw[b, j] + bias_j.
// cb: [M][E][D]; the tables' loop wants it as [M][D][E], transposed here into a kept buffer
// (M*E*D <= a few thousand values) rather than by a torch copy in the host code.
template <typename scalar_t, typename acc_t, typename out_t>
void lut_forward_one_row(const Dims& d, const scalar_t* x, const uint8_t* idx, const acc_t* cb,
                         const scalar_t* scales, const scalar_t* bias, out_t* out,
                         int64_t min_items) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, M = d.num_codebooks;
  const int64_t E = d.num_entries, D = d.entry_dim, row_stride = d.groups * M;
  if (B == 0 || N == 0) return;
  thread_local LineVector<acc_t> kept_cbT;
  KeptBuffer<acc_t> cbT_buf;
  acc_t* cbT = cbT_buf.get(kept_cbT, M * D * E);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < E; ++c)
      for (int64_t t = 0; t < D; ++t) cbT[(m * D + t) * E + c] = cb[(m * E + c) * D + t];
  constexpr bool kAsm = RLX_ONE_ROW_ASM && std::is_same_v<acc_t, float>;
  const int64_t S = kAsm ? kAsmStride : E;
  const OneRowPlan p = one_row_plan(d, min_items);
  const int64_t items = B * p.chunks * p.parts;
  // partial[b][chunk][N] when K is split into several chunks; otherwise each item writes out.
  thread_local LineVector<acc_t> kept_partial;
  KeptBuffer<acc_t> partial_buf;
  acc_t* partial = p.chunks > 1 ? partial_buf.get(kept_partial, B * p.chunks * N) : nullptr;
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[B * p.parts]());
  const auto write_out = [&](const acc_t* acc, int64_t b, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const acc_t s = scales ? static_cast<acc_t>(scales[j]) : acc_t(1);
      const acc_t bj = bias ? static_cast<acc_t>(bias[j]) : acc_t(0);
      out[b * N + j] = static_cast<out_t>(acc[j - j0] * s + bj);
    }
  };
  std::atomic<int64_t> next{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    thread_local LineVector<acc_t> kept_table, kept_acc;
    KeptBuffer<acc_t> table_buf, acc_buf;
    acc_t* L = table_buf.get(kept_table, p.gpi * M * S);
    acc_t* own = p.chunks > 1 ? nullptr : acc_buf.get(kept_acc, p.part_rows);
    int64_t built = -1;  // the (row, chunk) whose tables L holds
#if RLX_ISA_AVX512
    thread_local LineVector<uint32_t> kept_planes;  // L's byte planes (codebook_byte_lookup.h)
    const __m512i* planes = nullptr;
#endif
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t part = w % p.parts, bc = w / p.parts;  // bc = b * chunks + chunk
      const int64_t b = bc / p.chunks, chunk = bc % p.chunks;
      const int64_t g0 = chunk * p.gpi, ng = std::min(p.gpi, d.groups - g0);
      const int64_t j0 = part * p.part_rows, j1 = std::min(N, j0 + p.part_rows);
      if (bc != built) {
        build_one_row_tables<scalar_t, acc_t>(d, cbT, x + b * K, g0, ng, S, L);
#if RLX_ISA_AVX512
        if constexpr (std::is_same_v<acc_t, float>) {
          planes = one_row_planes(d, L, ng * M, kept_planes);
        }
#endif
        built = bc;
      }
      acc_t* acc = partial ? partial + bc * N + j0 : own;
      std::fill(acc, acc + (j1 - j0), acc_t(0));
      for (int64_t r0 = j0; r0 < j1; r0 += kOneRowChunkRows) {
        const int64_t r1 = std::min(j1, r0 + kOneRowChunkRows);
        acc_t* a = acc + (r0 - j0);
        if constexpr (kAsm) {
          gather_one_row_asm(idx, row_stride, g0 * M, ng * M, L, r0, r1, j1, a);
        } else {
#if RLX_ISA_AVX512
          if constexpr (std::is_same_v<acc_t, float>) {
            gather_one_row_avx512(d, idx, L, planes, g0, ng, r0, r1, a);
          } else
#endif
          {
            gather_block<acc_t, 1, 8>(d, idx, L, g0, ng, r0, r1, a);
          }
        }
      }
      if (p.chunks == 1) {
        write_out(acc, b, j0, j1);
      } else if (done[b * p.parts + part].fetch_add(1, std::memory_order_acq_rel) ==
                 p.chunks - 1) {
        // The last chunk of (b, part) to finish sums the chunks in chunk order.
        acc_t* first = partial + b * p.chunks * N;
        for (int64_t c = 1; c < p.chunks; ++c) {
          const acc_t* q = first + c * N;
          for (int64_t j = j0; j < j1; ++j) first[j] += q[j];
        }
        write_out(first + j0, b, j0, j1);
      }
    }
  });
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
