// Internal CPU building blocks of the codebook matmul kernels (lookup table and dense
// paths), shared by codebook.cpp (forward) and codebook_backward.cpp; the host code's parts
// are in codebook_kernels.h. See codebook.cpp for the algorithm.
#pragma once

#include <ATen/Parallel.h>

#include <rlx/acc_type.h>
#include <rlx/codebook.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <vector>

#include "codebook_kernels.h"
#include "vec.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {

using namespace ::rlx::RLX_ISA_NS;  // vec.h

// Fully unrolls a loop over a compile-time count, so that its vector accumulators stay in
// registers (GCC otherwise keeps the arrays on the stack and copies them around).
#if defined(__clang__)
#define RLX_UNROLL _Pragma("unroll")
#else
#define RLX_UNROLL _Pragma("GCC unroll 16")
#endif
// Unrolls a loop over a run-time count by up to 16 (clang's plain "unroll" means a full unroll,
// which it refuses, and -Werror makes that an error).
#if defined(__clang__)
#define RLX_UNROLL_BY_16 _Pragma("unroll 16")
#else
#define RLX_UNROLL_BY_16 _Pragma("GCC unroll 16")
#endif

// GCC's SLP vectorizer packs the one-row gather's JT scalar sums into a vector built lane by
// lane from the table loads (vinsertps) and spills its registers; plain scalar adds measured
// a few percent faster (1 row, 1 thread: 0.90-0.92 -> 0.88 ms).
#if defined(__GNUC__) && !defined(__clang__)
#define RLX_NO_SLP __attribute__((optimize("no-tree-slp-vectorize")))
#else
#define RLX_NO_SLP
#endif


// Table and gradient buffers start on a cache line: a BT = 16 float row is exactly one
// 64-byte line, and malloc's 16-byte alignment would split every lookup over two lines
// (measured: the BT = 16 gather spent most of its time on the second half of each row).
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// A buffer kept per thread across calls up to kKeptBufferBytes (fresh ones cost page faults
// and a zero fill every call); larger ones are allocated for the call.
//   thread_local LineVector<float> kept;  KeptBuffer<float> buf;  float* p = buf.get(kept, n);
inline constexpr size_t kKeptBufferBytes = size_t(8) << 20;
template <typename T>
struct KeptBuffer {
  LineVector<T> fresh;
  T* get(LineVector<T>& kept, int64_t n) {
    if (size_t(n) * sizeof(T) > kKeptBufferBytes) {
      fresh.resize(n);
      return fresh.data();
    }
    if (kept.size() < size_t(n)) kept.resize(n);
    return kept.data();
  }
};

inline constexpr int64_t kPrefetchRows = 32;  // index rows fetched ahead by the gathers

// Lanes of the vectors that hold a row of a BT-row table: 64 bytes in the AVX-512 copy where
// the row is a whole number of them (BT = 16, 32 floats), else the copy's SimdVec width.
template <typename acc_t, int BT>
inline constexpr int kTileLanes =
    RLX_ISA_AVX512 && (BT * sizeof(acc_t)) % 64 == 0 ? 64 / sizeof(acc_t) : kVecLanes<acc_t>;
template <typename acc_t, int BT>
using TileVec = Vec<acc_t, kTileLanes<acc_t, BT>>;
template <typename V, typename T>
inline V load_tile_vec(const T* p) {
  V x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <typename V, typename T>
inline void store_tile_vec(T* p, const V& x) {
  std::memcpy(p, &x, sizeof(x));
}


// xT[c][b] = x[b0 + b, c0 + c] for b < nb, zero padding up to BT (one tile of batch rows).
template <typename scalar_t, typename acc_t, int BT>
void load_x_tile(const scalar_t* x, int64_t K, int64_t b0, int64_t nb, int64_t c0, int64_t nc,
                 acc_t* xT) {
  if (nb < BT) std::fill(xT, xT + nc * BT, acc_t(0));
  for (int64_t b = 0; b < nb; ++b) {
    const scalar_t* row = x + (b0 + b) * K + c0;
    for (int64_t c = 0; c < nc; ++c) xT[c * BT + b] = static_cast<acc_t>(row[c]);
  }
}

// L[g][m][c][b] for the ng groups held in xT ([ng*D][BT]); BT > 1 (one-row tables:
// build_one_row_tables in codebook_one_row.h).
template <typename acc_t, int BT>
void build_table(const Dims& d, const acc_t* cb, const acc_t* xT, int64_t ng, acc_t* L) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t m = 0; m < M; ++m) {
      acc_t* Lgm = L + (g * M + m) * E * BT;
      using V = TileVec<acc_t, BT>;
      constexpr int W = kTileLanes<acc_t, BT>, NV = BT / W;
      static_assert(BT % W == 0, "batch tile must be a whole number of vectors");
      // CB entries at once: each x vector loaded serves CB entries (8 accumulators).
      constexpr int CB = NV >= 8 ? 1 : 8 / NV;
      int64_t c = 0;
      for (; c + CB <= E; c += CB) {
        const acc_t* entry = cb + (m * E + c) * D;
        V a[CB][NV] = {};
        for (int64_t t = 0; t < D; ++t) {
          const acc_t* xr = xT + (g * D + t) * BT;
          V xv[NV];
          RLX_UNROLL
          for (int v = 0; v < NV; ++v) xv[v] = load_tile_vec<V>(xr + v * W);
          RLX_UNROLL
          for (int q = 0; q < CB; ++q) {
            const acc_t w = entry[q * D + t];
            RLX_UNROLL
            for (int v = 0; v < NV; ++v) a[q][v] += w * xv[v];
          }
        }
        RLX_UNROLL
        for (int q = 0; q < CB; ++q)
          RLX_UNROLL
          for (int v = 0; v < NV; ++v) store_tile_vec(Lgm + (c + q) * BT + v * W, a[q][v]);
      }
      for (; c < E; ++c) {
        const acc_t* entry = cb + (m * E + c) * D;
        V a[NV] = {};
        for (int64_t t = 0; t < D; ++t) {
          const acc_t w = entry[t];
          const acc_t* xr = xT + (g * D + t) * BT;
          RLX_UNROLL
          for (int v = 0; v < NV; ++v) a[v] += w * load_tile_vec<V>(xr + v * W);
        }
        RLX_UNROLL
        for (int v = 0; v < NV; ++v) store_tile_vec(Lgm + c * BT + v * W, a[v]);
      }
    }
  }
}

// Fetches the index bytes [ahead, ahead + steps) past each of the JT row pointers. The gather
// reads one block column of the [N, K/D] indices at a time, rows 512 bytes apart for K = 4096;
// after a large GEMM (or on first use) those lines come from DRAM and the hardware prefetcher
// does not hide that (measured: 1-row forward 1.6 -> 1.2 ms on one thread right after a GEMM).
template <int JT>
inline void prefetch_rows(const uint8_t* const* ip, int64_t ahead, int64_t steps) {
  RLX_UNROLL
  for (int q = 0; q < JT; ++q) {
    const uint8_t* p = ip[q] + ahead;
    for (int64_t off = 0; off < steps; off += 64) __builtin_prefetch(p + off);
    __builtin_prefetch(p + steps - 1);
  }
}

// acc[j - j0][b] += sum_{g in block, m} L[g][m][idx[j, g0+g, m]][b] for j in [j0, j1).
// JT output rows at a time give independent add chains (latency, not throughput, bound).
// accumulate = false: acc is written, not read (the first block of a chunk: no zeroing pass).
template <typename acc_t, int BT, int JT>
RLX_NO_SLP void gather_block(const Dims& d, const uint8_t* idx, const acc_t* L, int64_t g0,
                             int64_t ng, int64_t j0, int64_t j1, acc_t* acc,
                             bool accumulate = true) {
  const int64_t M = d.num_codebooks, E = d.num_entries, row_stride = d.groups * M;
  const int64_t steps = ng * M;
  if constexpr (BT == 1) {
    int64_t j = j0;
    for (; j + JT <= j1; j += JT) {
      acc_t a[JT];
      const uint8_t* ip[JT];
      RLX_UNROLL
      for (int q = 0; q < JT; ++q) {
        a[q] = accumulate ? acc[j + q - j0] : acc_t(0);
        ip[q] = idx + (j + q) * row_stride + g0 * M;
      }
      int64_t gm = 0;
      if (j + kPrefetchRows + JT <= j1) prefetch_rows<JT>(ip, kPrefetchRows * row_stride, steps);
      // Eight index bytes per load, unpacked with shifts: one load per table lookup, not two.
      for (; gm + 8 <= steps; gm += 8) {
        uint64_t packed[JT];
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) std::memcpy(&packed[q], ip[q] + gm, 8);
        RLX_UNROLL
        for (int k = 0; k < 8; ++k) {
          const acc_t* Lgm = L + (gm + k) * E;
          RLX_UNROLL
          for (int q = 0; q < JT; ++q) a[q] += Lgm[(packed[q] >> (8 * k)) & 0xff];
        }
      }
      for (; gm < steps; ++gm) {
        const acc_t* Lgm = L + gm * E;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) a[q] += Lgm[ip[q][gm]];
      }
      RLX_UNROLL
      for (int q = 0; q < JT; ++q) acc[j + q - j0] = a[q];
    }
    for (; j < j1; ++j) {
      acc_t a = accumulate ? acc[j - j0] : acc_t(0);
      const uint8_t* ip = idx + j * row_stride + g0 * M;
      for (int64_t gm = 0; gm < steps; ++gm) a += L[gm * E + ip[gm]];
      acc[j - j0] = a;
    }
  } else {
    using V = TileVec<acc_t, BT>;
    constexpr int W = kTileLanes<acc_t, BT>, NV = BT / W;
    int64_t j = j0;
    for (; j + JT <= j1; j += JT) {
      V a[JT][NV];
      const uint8_t* ip[JT];
      RLX_UNROLL
      for (int q = 0; q < JT; ++q) {
        RLX_UNROLL
        for (int v = 0; v < NV; ++v)
          a[q][v] = accumulate ? load_tile_vec<V>(acc + (j + q - j0) * BT + v * W) : V{};
        ip[q] = idx + (j + q) * row_stride + g0 * M;
      }
      if (j + kPrefetchRows + JT <= j1) prefetch_rows<JT>(ip, kPrefetchRows * row_stride, steps);
      for (int64_t gm = 0; gm < steps; ++gm) {
        const acc_t* Lgm = L + gm * E * BT;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) {
          const acc_t* r = Lgm + ip[q][gm] * BT;
          RLX_UNROLL
          for (int v = 0; v < NV; ++v) a[q][v] += load_tile_vec<V>(r + v * W);
        }
      }
      RLX_UNROLL
      for (int q = 0; q < JT; ++q)
        RLX_UNROLL
        for (int v = 0; v < NV; ++v) store_tile_vec(acc + (j + q - j0) * BT + v * W, a[q][v]);
    }
    for (; j < j1; ++j) {
      V a[NV];
      RLX_UNROLL
      for (int v = 0; v < NV; ++v)
        a[v] = accumulate ? load_tile_vec<V>(acc + (j - j0) * BT + v * W) : V{};
      const uint8_t* ip = idx + j * row_stride + g0 * M;
      for (int64_t gm = 0; gm < steps; ++gm) {
        const acc_t* r = L + (gm * E + ip[gm]) * BT;
        RLX_UNROLL
        for (int v = 0; v < NV; ++v) a[v] += load_tile_vec<V>(r + v * W);
      }
      RLX_UNROLL
      for (int v = 0; v < NV; ++v) store_tile_vec(acc + (j - j0) * BT + v * W, a[v]);
    }
  }
}


// Work items are (batch tile, group chunk) pairs; the chunk count is derived from the shape
// alone, never from the thread count, so every thread count gives bitwise the same result.
inline constexpr int64_t kMinWorkItems = 8;

// Group chunks for num_tiles batch tiles: split K only when there are too few tiles to keep
// the threads busy. Splitting K (not N) builds every table entry exactly once; the price is a
// chunk-ordered reduction of per-chunk partial outputs ([N][BT] each).
inline int64_t group_chunks(int64_t num_tiles, int64_t num_blocks) {
  return std::clamp<int64_t>(ceil_div(kMinWorkItems, num_tiles), 1, num_blocks);
}

// out[b0 + b, j] = s_j * sum_c parts[c][j - j0][b] + bias_j for b < nb, j in [j0, j1): the
// partial sums of a tile's chunks added in chunk order (one part: no sum), out_t is scalar_t
// or acc_t. Rows go 16 output features at a time through a small [16][BT] buffer, so that the
// stores into out's rows are contiguous runs, not one element every N.
template <typename scalar_t, typename acc_t, typename out_t, int BT>
void write_out_rows(const Dims& d, const acc_t* parts, int64_t num_parts, int64_t part_stride,
                    const scalar_t* scales, const scalar_t* bias, int64_t b0, int64_t nb,
                    int64_t j0, int64_t j1, out_t* out) {
  constexpr int JB = 16;
  const int64_t N = d.out_features;
  alignas(64) acc_t sum[JB * BT];
  for (int64_t j = j0; j < j1; j += JB) {
    const int64_t nj = std::min<int64_t>(JB, j1 - j);
    const acc_t* first = parts + (j - j0) * BT;
    std::copy_n(first, nj * BT, sum);
    for (int64_t c = 1; c < num_parts; ++c) {
      const acc_t* p = first + c * part_stride;
      RLX_UNROLL_BY_16
      for (int64_t i = 0; i < nj * BT; ++i) sum[i] += p[i];
    }
    acc_t s[JB], bj[JB];
    for (int64_t q = 0; q < nj; ++q) {
      s[q] = scales ? static_cast<acc_t>(scales[j + q]) : acc_t(1);
      bj[q] = bias ? static_cast<acc_t>(bias[j + q]) : acc_t(0);
    }
    for (int64_t b = 0; b < nb; ++b) {
      out_t* o = out + (b0 + b) * N + j;
      if (nj == JB) {
        RLX_UNROLL
        for (int q = 0; q < JB; ++q) o[q] = static_cast<out_t>(sum[q * BT + b] * s[q] + bj[q]);
      } else {
        for (int64_t q = 0; q < nj; ++q) o[q] = static_cast<out_t>(sum[q * BT + b] * s[q] + bj[q]);
      }
    }
  }
}

// Requests x's lines for a tile's next table block (columns [c0, c0 + nc) of rows b0..b0+nb):
// each row's slice is a few lines 4 * K bytes from the next, which the hardware prefetcher
// does not follow, and x comes from memory when the tile's rows are many.
template <typename scalar_t>
inline void prefetch_x_tile(const scalar_t* x, int64_t K, int64_t b0, int64_t nb, int64_t c0,
                            int64_t nc) {
  const int64_t bytes = nc * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = 0; b < nb; ++b) {
    const char* row = reinterpret_cast<const char*>(x + (b0 + b) * K + c0);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off);
  }
}

// out[b, j] = s_j * raw[b, j] + bias_j (scales/bias may be null), out_t is scalar_t or acc_t.
// Tiles of BT > 1 rows (one-row tiles: lut_forward_one_row, codebook_one_row.h).
template <typename scalar_t, typename acc_t, typename out_t, int BT, int JT>
void lut_forward(const Dims& d, const scalar_t* x, const uint8_t* idx, const acc_t* cb,
                 const scalar_t* scales, const scalar_t* bias, out_t* out) {
  static_assert(BT > 1, "one-row tiles take lut_forward_one_row");
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, D = d.entry_dim;
  const int64_t M = d.num_codebooks, E = d.num_entries;
  if (B == 0 || N == 0) return;
  const int64_t num_tiles = ceil_div(B, BT);
  const int64_t gpb = groups_per_block(d, BT, sizeof(acc_t), forward_lut_block_bytes());
  const int64_t num_blocks = std::max<int64_t>(1, ceil_div(d.groups, gpb));
  const int64_t blocks_per_chunk = ceil_div(num_blocks, group_chunks(num_tiles, num_blocks));
  const int64_t chunks = ceil_div(num_blocks, blocks_per_chunk);
  // partial[tile][chunk][j][b] when K is split; otherwise each item writes out directly.
  // A split tile's sums are added in chunk order (same bits whoever does it) by reduction
  // items of kReduceRows output rows, queued after every chunk item: whoever claims one waits
  // for that tile's chunks (claimed before it, so running) and then shares the additions with
  // the other threads, instead of one thread adding every chunk of the tile alone.
  constexpr int64_t kReduceRows = 512;
  const int64_t reduce_parts = chunks > 1 ? ceil_div(N, kReduceRows) : 0;
  thread_local LineVector<acc_t> kept_partial;
  KeptBuffer<acc_t> partial_buf;
  acc_t* partial = chunks > 1 ? partial_buf.get(kept_partial, num_tiles * chunks * N * BT) : nullptr;
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[num_tiles]());
  // Items are claimed dynamically: a thread that starts late (a busy machine, a sleeping pool
  // thread) finds them done instead of holding everyone up with its static share.
  const int64_t chunk_items = num_tiles * chunks;
  const int64_t items = chunk_items + num_tiles * reduce_parts;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    thread_local LineVector<acc_t> kept_xT, kept_table, kept_acc;
    KeptBuffer<acc_t> xT_buf, table_buf, acc_buf;
    acc_t *xT = nullptr, *L = nullptr, *own = nullptr;
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      if (w >= chunk_items) {
        const int64_t tile = (w - chunk_items) / reduce_parts;
        const int64_t part = (w - chunk_items) % reduce_parts;
        while (done[tile].load(std::memory_order_acquire) < chunks) std::this_thread::yield();
        const int64_t b0 = tile * BT, nb = std::min<int64_t>(BT, B - b0);
        const int64_t j0 = part * kReduceRows, j1 = std::min(N, j0 + kReduceRows);
        write_out_rows<scalar_t, acc_t, out_t, BT>(
            d, partial + tile * chunks * N * BT + j0 * BT, chunks, N * BT, scales, bias,
            b0, nb, j0, j1, out);
        continue;
      }
      if (L == nullptr) {
        xT = xT_buf.get(kept_xT, gpb * D * BT);
        L = table_buf.get(kept_table, gpb * M * E * BT);
        if (chunks == 1) own = acc_buf.get(kept_acc, N * BT);
      }
      const int64_t tile = w / chunks, chunk = w % chunks;
      const int64_t b0 = tile * BT, nb = std::min<int64_t>(BT, B - b0);
      acc_t* acc = chunks > 1 ? partial + w * N * BT : own;
      const int64_t g_begin = chunk * blocks_per_chunk * gpb;
      const int64_t g_end = std::min(d.groups, g_begin + blocks_per_chunk * gpb);
      if (g_begin >= g_end) std::fill(acc, acc + N * BT, acc_t(0));  // K = 0: empty sums
      for (int64_t g0 = g_begin; g0 < g_end; g0 += gpb) {
        const int64_t ng = std::min(gpb, g_end - g0);
        load_x_tile<scalar_t, acc_t, BT>(x, K, b0, nb, g0 * D, ng * D, xT);
        if (g0 + ng < g_end) {
          prefetch_x_tile(x, K, b0, nb, (g0 + ng) * D, std::min(gpb, g_end - g0 - ng) * D);
        }
        build_table<acc_t, BT>(d, cb, xT, ng, L);
        gather_block<acc_t, BT, JT>(d, idx, L, g0, ng, 0, N, acc, g0 != g_begin);
      }
      if (chunks == 1) {
        write_out_rows<scalar_t, acc_t, out_t, BT>(d, acc, 1, 0, scales, bias, b0, nb, 0, N, out);
      } else {
        done[tile].fetch_add(1, std::memory_order_acq_rel);
      }
    }
  });
}

template <typename acc_t, typename index_t>
void dequantize_rows(const Dims& d, const index_t* idx, const acc_t* cb, int64_t j0, int64_t j1,
                     acc_t* w) {
  const int64_t K = d.in_features, D = d.entry_dim, M = d.num_codebooks, E = d.num_entries;
  at::parallel_for(j0, j1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      acc_t* row = w + (j - j0) * K;
      const index_t* ip = idx + j * d.groups * M;
      for (int64_t g = 0; g < d.groups; ++g) {
        acc_t* dst = row + g * D;
        std::copy_n(cb + ip[g * M] * D, D, dst);
        for (int64_t m = 1; m < M; ++m) {
          const acc_t* e = cb + (m * E + ip[g * M + m]) * D;
          for (int64_t t = 0; t < D; ++t) dst[t] += e[t];
        }
      }
    }
  });
}

template <typename acc_t, typename index_t>
void scatter_weight_grad(const Dims& d, const acc_t* dw, const index_t* idx, int64_t j0,
                         int64_t j1, int64_t gpb, acc_t* dc_parts) {
  const int64_t K = d.in_features, D = d.entry_dim, M = d.num_codebooks, E = d.num_entries;
  at::parallel_for(0, ceil_div(d.groups, gpb), 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      acc_t* part = dc_parts + blk * M * E * D;
      const int64_t g1 = std::min(d.groups, (blk + 1) * gpb);
      for (int64_t j = j0; j < j1; ++j) {
        for (int64_t g = blk * gpb; g < g1; ++g) {
          const acc_t* src = dw + (j - j0) * K + g * D;
          for (int64_t m = 0; m < M; ++m) {
            acc_t* dst = part + (m * E + idx[(j * d.groups + g) * M + m]) * D;
            for (int64_t t = 0; t < D; ++t) dst[t] += src[t];
          }
        }
      }
    }
  });
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
