// Gather-dequantize-dot CPU kernels of the codebook matmul for 16-bit indices (E up to 65536,
// AQLM's 1x16 and 2x16 schemes), where a lookup table of E entries per group would cost more
// than the product itself:
//   forward   out[b, j]      = s_j * sum_{g,m} x[b, g*D:(g+1)*D] . C[m, I[j,g,m]] + bias_j
//   backward  dx[b, g*D + t] = sum_j gs[b, j] sum_m C[m, I[j,g,m], t]        (gs = dout * s)
//             dC[m, c, t]    = sum_{(j,g): I[j,g,m] = c} sum_b gs[b, j] x[b, g*D + t]
// Forward: each output row j reads its own codes and the entries they select (a D = 8 float
// entry is one 32-byte load; a float16/bfloat16 codebook is read as it is, 16 bytes an entry,
// by codebook_gather.cpp). Backward: per group, each row's code adds into dx accumulators and
// one dC partial, sharing the broadcasts of gs. Large batches use the dense path of
// codebook_lut.h instead (dequantized tiles + GEMM).
//
// Determinism: out and dx elements are each summed by one work item in a fixed order; dC is
// summed per fixed group chunk (a partial codebook each, the chunk count derived from the
// shape alone) and the partials are added in chunk order. Indices >= E are skipped and
// reported (the caller raises); the kernels never read outside the codebook.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <rlx/codebook.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <optional>
#include <tuple>
#include <type_traits>
#include <cstring>
#include <vector>

#include "vec.h"

#include "codebook_lut.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {

using namespace ::rlx::RLX_ISA_NS;  // vec.h

// Largest index >= E seen by a kernel (-1: none); the entry points return it and the host
// code raises (raise_if_bad_index, codebook_kernels.h).
struct BadIndex {
  std::atomic<int64_t> top{-1};
  void report(int64_t e) {
    int64_t cur = top.load(std::memory_order_relaxed);
    while (e > cur && !top.compare_exchange_weak(cur, e, std::memory_order_relaxed)) {
    }
  }
};

inline constexpr int64_t kGatherRowsPerItem = 64;  // output rows per forward work item

// Every 16 groups, the gather tile kernels prefetch the next tile's codes at the same offset
// (`offset` codes past each of this tile's rows), so that they come from memory while this
// tile's entries are read: each row's codes are a short stream of their own, which the
// hardware prefetchers pick up late.
template <int JT>
inline void prefetch_next_tile_codes(const uint16_t* const (&rows)[JT], int64_t offset) {
  RLX_UNROLL
  for (int q = 0; q < JT; ++q) __builtin_prefetch(rows[q] + offset);
}

// raw[b0 + b, j] (b < BT) for rows j in [j0, j1): JT rows at a time give JT*BT independent
// accumulator chains. xt is [BT][K] in acc_t (zero rows past the batch). Compile-time D;
// FixedM > 0 fixes the codebook count too (1x16, 2x16), so that the code offsets advance by
// constants and stay in registers instead of being reloaded from the stack (a load per code
// next to the entry's).
template <typename acc_t, int D, int BT, int JT, int FixedM>
void gather_rows_fixed(const Dims& d, const acc_t* xt, const uint16_t* idx, const acc_t* cb,
                       int64_t j0, int64_t j1, acc_t* raw, int64_t raw_stride, BadIndex& bad) {
  // One codebook entry, D lanes of acc_t (D in {4, 8, 16}: 16 to 128 bytes, one to four AVX
  // registers).
  using V = Vec<acc_t, D>;
  const int64_t G = d.groups, E = d.num_entries, K = d.in_features;
  const int64_t M = FixedM > 0 ? FixedM : d.num_codebooks;
  const int64_t steps = G * M;
  for (int64_t j = j0; j < j1; j += JT) {
    const int64_t nj = std::min<int64_t>(JT, j1 - j);
    V acc[JT][BT] = {};
    const uint16_t* rows[JT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) rows[q] = idx + std::min<int64_t>(j + q, j1 - 1) * steps;
    for (int64_t g = 0; g < G; ++g) {
      if ((g & 15) == 0) prefetch_next_tile_codes<JT>(rows, JT * steps + g * M);
      V xv[BT];
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) std::memcpy(&xv[b], xt + b * K + g * D, sizeof(V));
      for (int64_t m = 0; m < M; ++m) {
        const acc_t* cbm = cb + m * E * D;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) {
          // Rows past j1 repeat the last row (always in bounds) and are not written.
          const int64_t e = rows[q][g * M + m];
          if (e >= E) {
            bad.report(e);
            continue;
          }
          V c;
          std::memcpy(&c, cbm + e * D, sizeof(V));
          RLX_UNROLL
          for (int b = 0; b < BT; ++b) acc[q][b] += c * xv[b];
        }
      }
    }
    // Every row's sum with constant indices, then the nj kept: indexing acc by the run-time
    // nj would make the compiler keep acc in memory through the whole loop above.
    acc_t sums[JT][BT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) {
        acc_t s = 0;
        for (int t = 0; t < D; ++t) s += acc[q][b][t];
        sums[q][b] = s;
      }
    }
    for (int q = 0; q < nj; ++q)
      for (int b = 0; b < BT; ++b) raw[b * raw_stride + j + q] = sums[q][b];
  }
}

// The same for any D (scalar loops), nb <= kMaxGatherBatch batch rows.
template <typename acc_t>
void gather_rows_any(const Dims& d, const acc_t* xt, int64_t nb, const uint16_t* idx,
                     const acc_t* cb, int64_t j0, int64_t j1, acc_t* raw, int64_t raw_stride,
                     BadIndex& bad) {
  const int64_t G = d.groups, M = d.num_codebooks, E = d.num_entries, K = d.in_features;
  const int64_t D = d.entry_dim, steps = G * M;
  for (int64_t j = j0; j < j1; ++j) {
    acc_t acc[kMaxGatherBatch] = {};
    for (int64_t gm = 0; gm < steps; ++gm) {
      const int64_t g = gm / M, m = gm % M;
      const int64_t e = idx[j * steps + gm];
      if (e >= E) {
        bad.report(e);
        continue;
      }
      const acc_t* c = cb + (m * E + e) * D;
      for (int64_t b = 0; b < nb; ++b) {
        const acc_t* xr = xt + b * K + g * D;
        acc_t s = 0;
        for (int64_t t = 0; t < D; ++t) s += c[t] * xr[t];
        acc[b] += s;
      }
    }
    for (int64_t b = 0; b < nb; ++b) raw[b * raw_stride + j] = acc[b];
  }
}

// Reads the codebook once, line by line, in order, before the gathers (on every thread that
// gathers: each core reads it into its own L2). After other work (a layer's dense product,
// another layer's codebook) its lines come from DRAM or L3; a sequential pass, which the
// hardware prefetcher streams, costs less than fetching each line on first use at the random
// reads' latency (and a little more than nothing when it is still cached).
inline void warm_codebook(const void* table, int64_t bytes) {
  const auto* p = static_cast<const unsigned char*>(table);
  unsigned acc = 0;
  for (int64_t i = 0; i < bytes; i += 64) acc += p[i];
  asm volatile("" : : "r"(acc));
}

// f(item) for item in [0, items) on the intra-op threads, each item claimed by whichever
// thread is free: a thread that starts late (a busy machine) finds the items done instead of
// holding the others up with a static share. Each item writes only its own outputs, so the
// result does not depend on who ran it.
// first_on_thread() runs once on each thread before its first item (not at all on a thread
// that finds the items done).
template <typename F, typename First>
void for_each_item(int64_t items, const F& f, const First& first_on_thread) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    int64_t it = next.fetch_add(1);
    if (it < items) first_on_thread();
    for (; it < items; it = next.fetch_add(1)) f(it);
  });
}

template <typename F>
void for_each_item(int64_t items, const F& f) {
  for_each_item(items, f, [] {});
}

// Batch tiles of BT rows (zero padded), then output-row blocks in parallel: calls
// rows(bt, jt, xt, j0, j1, dst) with bt, jt std::integral_constant tile sizes (C++17: no
// template lambdas), xt [BT][K] and dst the tile's [BT][N] output (row stride N). Each thread
// first reads the table (table_bytes bytes) with warm_codebook.
template <typename acc_t, typename Rows>
void gather_tiles(const Dims& d, const acc_t* x_acc, acc_t* raw, const void* table,
                  int64_t table_bytes, const Rows& rows) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features;
  const auto run = [&](auto bt, auto jt) {
    constexpr int BT = decltype(bt)::value;
    std::vector<acc_t> pad;
    for (int64_t b0 = 0; b0 < B; b0 += BT) {
      const int64_t nb = std::min<int64_t>(BT, B - b0);
      const acc_t* xt = x_acc + b0 * K;
      if (nb < BT) {
        pad.assign(BT * K, acc_t(0));
        std::copy_n(xt, nb * K, pad.data());
        xt = pad.data();
      }
      std::vector<acc_t> tile(nb < BT ? BT * N : 0);
      acc_t* dst = nb < BT ? tile.data() : raw + b0 * N;
      for_each_item(ceil_div(N, kGatherRowsPerItem), [&](int64_t it) {
        const int64_t j0 = it * kGatherRowsPerItem;
        rows(bt, jt, xt, j0, std::min(N, j0 + kGatherRowsPerItem), dst);
      }, [&] { warm_codebook(table, table_bytes); });
      if (nb < BT) std::copy_n(tile.data(), nb * N, raw + b0 * N);
    }
  };
  // Each step of JT output rows reads the tile's x vectors of a group (BT of them) from L1 or
  // L2 (the tile's x, BT * K values, is swept once per step): with more than one batch row
  // those reads, not the entries', bound the loop, so a step serves several output rows.
  // Tiles of 4 rows and 3 output rows fill the AVX2 copy's 16 vector registers (12 sums and
  // 4 x vectors); 8 x 1 (the earlier shape) took 1.5x as long at 16 rows, 4 x 2 1.3x.
  // The AVX-512 copy's pair kernel (codebook_gather.cpp) has 32 registers: 8 x 3 (24 sums).
  using std::integral_constant;
  if (B == 1) {
    run(integral_constant<int, 1>{}, integral_constant<int, 8>{});
#if RLX_ISA_AVX512
  } else if (B > 4) {
    run(integral_constant<int, 8>{}, integral_constant<int, 3>{});
#endif
  } else if (B == 2) {
    run(integral_constant<int, 2>{}, integral_constant<int, 6>{});
  } else {
    run(integral_constant<int, 4>{}, integral_constant<int, 3>{});
  }
}

// raw[b, j] = sum_{g,m} x[b, g] . C[m, I[j,g,m]] for all B <= kMaxGatherBatch rows; x_acc
// [B, K] and cb [M, E, D] contiguous in acc_t, raw [B, N].
template <typename acc_t>
void gather_forward(const Dims& d, const acc_t* x_acc, const uint16_t* idx, const acc_t* cb,
                    acc_t* raw, BadIndex& bad) {
  const int64_t B = d.rows, N = d.out_features, D = d.entry_dim;
  if (B == 0 || N == 0) return;
  const int64_t table_bytes = d.num_codebooks * d.num_entries * D * int64_t(sizeof(acc_t));
  using std::integral_constant;
  const auto by_batch = [&](auto dd) {
    constexpr int DD = decltype(dd)::value;
    gather_tiles(d, x_acc, raw, cb, table_bytes, [&](auto bt, auto jt, const acc_t* xt, int64_t j0, int64_t j1,
                                    acc_t* dst) {
      constexpr int BT = decltype(bt)::value, JT = decltype(jt)::value;
      if (d.num_codebooks == 1)
        gather_rows_fixed<acc_t, DD, BT, JT, 1>(d, xt, idx, cb, j0, j1, dst, N, bad);
      else if (d.num_codebooks == 2)
        gather_rows_fixed<acc_t, DD, BT, JT, 2>(d, xt, idx, cb, j0, j1, dst, N, bad);
      else
        gather_rows_fixed<acc_t, DD, BT, JT, 0>(d, xt, idx, cb, j0, j1, dst, N, bad);
    });
  };
  if (D == 8) {
    by_batch(integral_constant<int, 8>{});
  } else if (D == 16 && sizeof(acc_t) == 4) {
    by_batch(integral_constant<int, 16>{});
  } else if (D == 4) {
    by_batch(integral_constant<int, 4>{});
  } else {
    warm_codebook(cb, table_bytes);
    at::parallel_for(0, ceil_div(N, kGatherRowsPerItem), 1, [&](int64_t begin, int64_t end) {
      for (int64_t it = begin; it < end; ++it) {
        const int64_t j0 = it * kGatherRowsPerItem;
        gather_rows_any<acc_t>(d, x_acc, B, idx, cb, j0, std::min(N, j0 + kGatherRowsPerItem),
                               raw, N, bad);
      }
    });
  }
}

// Codes of groups [g0, g1) transposed to ct[(g - g0) * M + m][j] (one sequential stream per
// (group, codebook) for the column loops of the backward).
inline void transpose_codes(const Dims& d, const uint16_t* idx, int64_t g0, int64_t g1,
                            uint16_t* ct) {
  const int64_t N = d.out_features, steps = d.groups * d.num_codebooks;
  const int64_t s0 = g0 * d.num_codebooks, width = (g1 - g0) * d.num_codebooks;
  for (int64_t j = 0; j < N; ++j) {
    const uint16_t* row = idx + j * steps + s0;
    for (int64_t s = 0; s < width; ++s) ct[s * N + j] = row[s];
  }
}

inline constexpr int64_t kBackwardGroupsPerBlock = 16;  // groups transposed at a time

// The backward for one group chunk [g0, g1) and one tile of BT batch rows (compile-time D):
// per group g, with x's BT group vectors held fixed, every output row j adds
//   dx[b, g] += gs[b, j] * C[m, I[j,g,m]]             (BT accumulators over the chunk's rows)
//   part[m, I[j,g,m]] += sum_b gs[b, j] * x[b, g]     (one read-modify-write per code)
// sharing the BT broadcasts of gs[b, j]. gsT is [N][BT] (zero past the batch), xt [BT][K]
// (zero rows past the batch), dxt [BT][width] of the chunk's columns (or null).
template <typename acc_t, int D, int BT, bool WantDx, bool WantDc>
void gather_backward_tile(const Dims& d, const acc_t* gsT, const acc_t* xt, const uint16_t* ct,
                          int64_t g0, int64_t g1, int64_t gb0, const acc_t* cb, acc_t* dxt,
                          int64_t width, acc_t* part, BadIndex& bad) {
  using V = Vec<acc_t, D>;
  const int64_t N = d.out_features, K = d.in_features, M = d.num_codebooks, E = d.num_entries;
  for (int64_t g = g0; g < g1; ++g) {
    V xg[BT];
    RLX_UNROLL
    for (int b = 0; b < BT; ++b) std::memcpy(&xg[b], xt + b * K + g * D, sizeof(V));
    V acc[BT] = {};
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* cm = ct + ((g - gb0) * M + m) * N;
      const acc_t* cbm = cb + m * E * D;
      acc_t* pm = WantDc ? part + m * E * D : nullptr;
      for (int64_t j = 0; j < N; ++j) {
        const int64_t e = cm[j];
        if (e >= E) {
          bad.report(e);
          continue;
        }
        const acc_t* gj = gsT + j * BT;
        V c, v0 = {}, v1 = {};
        if (WantDx) std::memcpy(&c, cbm + e * D, sizeof(V));
        RLX_UNROLL
        for (int b = 0; b < BT; ++b) {
          const acc_t gv = gj[b];
          if (WantDx) acc[b] += gv * c;
          if (WantDc) (b % 2 ? v1 : v0) += gv * xg[b];
        }
        if (WantDc) {
          V p;
          std::memcpy(&p, pm + e * D, sizeof(V));
          p += v0 + v1;
          std::memcpy(pm + e * D, &p, sizeof(V));
        }
      }
    }
    if (WantDx) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) std::memcpy(dxt + b * width + (g - g0) * D, &acc[b], sizeof(V));
    }
  }
}

// dx (optional, [B, K] acc_t) and dC partials (optional, [chunks][M*E*D] acc_t, zeroed) for
// B <= kMaxGatherBatch rows, with compile-time D and batch tiles of BT rows. gs [B, N] =
// dout * s, x_acc [B, K], cb [M, E, D], all acc_t. Each chunk sums its dx columns and its
// partial over rows j in order, batch tile after batch tile: fixed for a given shape.
template <typename acc_t, int D, int BT, bool WantDx, bool WantDc>
void gather_backward_fixed(const Dims& d, const acc_t* gs, const acc_t* x_acc,
                           const uint16_t* idx, const acc_t* cb, acc_t* dx, acc_t* dc_parts,
                           int64_t chunks, BadIndex& bad) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, G = d.groups;
  const int64_t M = d.num_codebooks, MED = M * d.num_entries * D;
  const int64_t tiles = ceil_div(B, BT), per_chunk = ceil_div(G, chunks);
  // gsT[tile][j][b] and xt[tile][b][k], zero past the batch.
  std::vector<acc_t> gsT(tiles * N * BT, acc_t(0)), xt(tiles * BT * K, acc_t(0));
  for (int64_t b = 0; b < B; ++b) {
    acc_t* dst = gsT.data() + (b / BT) * N * BT + b % BT;
    for (int64_t j = 0; j < N; ++j) dst[j * BT] = gs[b * N + j];
  }
  std::copy_n(x_acc, B * K, xt.data());
  for_each_item(chunks, [&](int64_t ch) {
    std::vector<acc_t> dxl;
    std::vector<uint16_t> ct(kBackwardGroupsPerBlock * M * N);
    const int64_t g0 = ch * per_chunk, g1 = std::min(G, g0 + per_chunk);
    if (g0 >= g1) return;
    const int64_t width = (g1 - g0) * D;
    if (WantDx) dxl.assign(tiles * BT * width, acc_t(0));
    acc_t* part = WantDc ? dc_parts + ch * MED : nullptr;
    for (int64_t gb = g0; gb < g1; gb += kBackwardGroupsPerBlock) {
      const int64_t ge = std::min(g1, gb + kBackwardGroupsPerBlock);
      transpose_codes(d, idx, gb, ge, ct.data());
      for (int64_t t = 0; t < tiles; ++t) {
        acc_t* dxt = WantDx ? dxl.data() + t * BT * width + (gb - g0) * D : nullptr;
        gather_backward_tile<acc_t, D, BT, WantDx, WantDc>(
            d, gsT.data() + t * N * BT, xt.data() + t * BT * K, ct.data(), gb, ge, gb, cb, dxt,
            width, part, bad);
      }
    }
    if (WantDx)
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(dxl.data() + b * width, width, dx + b * K + g0 * D);
  });
}

// The same for any D and acc_t (scalar loops).
template <typename acc_t>
void gather_backward_any(const Dims& d, const acc_t* gs, const acc_t* x_acc, const uint16_t* idx,
                         const acc_t* cb, acc_t* dx, acc_t* dc_parts, int64_t chunks,
                         BadIndex& bad) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, D = d.entry_dim;
  const int64_t G = d.groups, M = d.num_codebooks, E = d.num_entries, MED = M * E * D;
  const int64_t per_chunk = ceil_div(G, chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dxl, v(D);
    for (int64_t ch = begin; ch < end; ++ch) {
      const int64_t g0 = ch * per_chunk, g1 = std::min(G, g0 + per_chunk);
      if (g0 >= g1) continue;
      const int64_t width = (g1 - g0) * D;
      if (dx) dxl.assign(B * width, acc_t(0));
      acc_t* part = dc_parts ? dc_parts + ch * MED : nullptr;
      for (int64_t j = 0; j < N; ++j) {
        const uint16_t* ip = idx + j * G * M;
        for (int64_t g = g0; g < g1; ++g) {
          if (part) {  // v[t] = sum_b gs[b, j] x[b, g*D + t]
            std::fill(v.begin(), v.end(), acc_t(0));
            for (int64_t b = 0; b < B; ++b) {
              const acc_t gv = gs[b * N + j];
              const acc_t* xr = x_acc + b * K + g * D;
              for (int64_t t = 0; t < D; ++t) v[t] += gv * xr[t];
            }
          }
          for (int64_t m = 0; m < M; ++m) {
            const int64_t e = ip[g * M + m];
            if (e >= E) {
              bad.report(e);
              continue;
            }
            const acc_t* c = cb + (m * E + e) * D;
            if (dx) {
              for (int64_t b = 0; b < B; ++b) {
                const acc_t gv = gs[b * N + j];
                acc_t* o = dxl.data() + b * width + (g - g0) * D;
                for (int64_t t = 0; t < D; ++t) o[t] += gv * c[t];
              }
            }
            if (part) {
              acc_t* p = part + (m * E + e) * D;
              for (int64_t t = 0; t < D; ++t) p[t] += v[t];
            }
          }
        }
      }
      if (dx)
        for (int64_t b = 0; b < B; ++b)
          std::copy_n(dxl.data() + b * width, width, dx + b * K + g0 * D);
    }
  });
}

// dx (optional, [B, K] acc_t) and dC partials (optional, [chunks][M*E*D] acc_t, zeroed) for
// B <= kMaxGatherBatch rows. gs [B, N] = dout * s, x_acc [B, K], cb [M, E, D], all acc_t.
template <typename acc_t>
void gather_backward(const Dims& d, const acc_t* gs, const acc_t* x_acc, const uint16_t* idx,
                     const acc_t* cb, acc_t* dx, acc_t* dc_parts, int64_t chunks, BadIndex& bad) {
  if (d.rows == 0 || d.out_features == 0 || d.groups == 0 || (!dx && !dc_parts)) return;
  using std::integral_constant;
  // Batch tiles of 8 rows keep BT accumulators, BT x vectors and the two partial sums in
  // registers at D = 8 (16 rows would spill); fewer rows take a smaller tile.
  const auto run = [&](auto dd) {
    constexpr int DD = decltype(dd)::value;
    const auto with_bt = [&](auto bt) {
      constexpr int BT = decltype(bt)::value;
      if (dx && dc_parts)
        gather_backward_fixed<acc_t, DD, BT, true, true>(d, gs, x_acc, idx, cb, dx, dc_parts,
                                                         chunks, bad);
      else if (dx)
        gather_backward_fixed<acc_t, DD, BT, true, false>(d, gs, x_acc, idx, cb, dx, dc_parts,
                                                          chunks, bad);
      else
        gather_backward_fixed<acc_t, DD, BT, false, true>(d, gs, x_acc, idx, cb, dx, dc_parts,
                                                          chunks, bad);
    };
    if (d.rows == 1) {
      with_bt(integral_constant<int, 1>{});
    } else if (d.rows <= 4) {
      with_bt(integral_constant<int, 4>{});
    } else {
      with_bt(integral_constant<int, 8>{});
    }
  };
  if (std::is_same<acc_t, float>::value && d.entry_dim == 8) {
    run(integral_constant<int, 8>{});
  } else if (std::is_same<acc_t, float>::value && d.entry_dim == 4) {
    run(integral_constant<int, 4>{});
  } else {
    gather_backward_any<acc_t>(d, gs, x_acc, idx, cb, dx, dc_parts, chunks, bad);
  }
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
