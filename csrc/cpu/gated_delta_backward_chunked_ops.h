// Gated delta rule on the CPU, chunked backward (gated_delta_backward_chunked.cpp): the
// small dense building blocks of its sub-chunk algebra (register-tiled matrix products,
// triangular inverse, row loads) and the row queues that overlap its memory traffic with
// them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "gated_delta_common.h"

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// C[M x N] = diag(rs) A[M x P] B[P x N] (+ cs X, X[M x N] with C's row stride: C itself to
// accumulate, or another matrix), row-major; N a multiple of the vector length. An
// MR x NV-vector tile of C stays in registers over the whole inner dimension. (The scaled
// addend saves a pass over a state where the products decay it first: S1 and dS.)
template <int64_t MR, int64_t NV, typename acc_t>
inline void gemm_tile(int64_t P, const acc_t* __restrict A, int64_t lda,
                      const acc_t* __restrict B, int64_t ldb, acc_t* C, int64_t ldc,
                      const acc_t* rs, const acc_t* X, acc_t cs) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t);
  vec c[MR][NV];
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < NV; ++v) c[m][v] = vec{};
  }
  for (int64_t p = 0; p < P; ++p) {
    vec b[NV];
    for (int64_t v = 0; v < NV; ++v) b[v] = load_vec(B + p * ldb + v * L);
    for (int64_t m = 0; m < MR; ++m) {
      const acc_t a = A[m * lda + p];
      for (int64_t v = 0; v < NV; ++v) c[m][v] += a * b[v];
    }
  }
  for (int64_t m = 0; m < MR; ++m) {
    for (int64_t v = 0; v < NV; ++v) {
      const vec x = rs ? rs[m] * c[m][v] : c[m][v];
      const int64_t o = m * ldc + v * L;
      store_vec(C + o, X ? cs * load_vec(X + o) + x : x);
    }
  }
}

// Tiles of 6 rows by 2 vectors: 12 independent accumulators keep both FMA pipes busy through
// their 4-cycle latency, and with the 2 B vectors and the broadcast A value they use 15 of
// AVX2's 16 vector registers. AVX-512 has 32: there 6 x 4 tiles (24 accumulators) load each
// A value once per 4 vectors of B (a 64-wide row of B in floats).
template <int64_t MR, typename acc_t>
inline void gemm_cols(int64_t P, int64_t N, const acc_t* A, int64_t lda, const acc_t* B,
                      int64_t ldb, acc_t* C, int64_t ldc, const acc_t* rs, const acc_t* X,
                      acc_t cs) {
  constexpr int64_t L = kVecLanes<acc_t>;
  int64_t j = 0;
#if RLX_VEC_BYTES == 64
  for (; j + 4 * L <= N; j += 4 * L) {
    gemm_tile<MR, 4>(P, A, lda, B + j, ldb, C + j, ldc, rs, X ? X + j : X, cs);
  }
#endif
  for (; j + 2 * L <= N; j += 2 * L) {
    gemm_tile<MR, 2>(P, A, lda, B + j, ldb, C + j, ldc, rs, X ? X + j : X, cs);
  }
  if (j < N) gemm_tile<MR, 1>(P, A, lda, B + j, ldb, C + j, ldc, rs, X ? X + j : X, cs);
}

// A's zero triangle, when it has one (M = P): a row tile then runs over A's nonzero columns
// only.
enum class Tri { kFull, kLower, kUpper };

template <typename acc_t>
inline void gemm(int64_t M, int64_t N, int64_t P, const acc_t* A, int64_t lda, const acc_t* B,
                 int64_t ldb, acc_t* C, int64_t ldc, const acc_t* rs, const acc_t* X,
                 acc_t cs = 1, Tri tri = Tri::kFull) {
  constexpr int64_t MR = 6;
  for (int64_t i = 0; i < M; i += MR) {
    const int64_t m = std::min(MR, M - i);
    const int64_t p0 = tri == Tri::kUpper ? i : 0;
    const int64_t p1 = tri == Tri::kLower ? std::min(P, i + m) : P;
    const acc_t* Ai = A + i * lda + p0;
    const acc_t* Bi = B + p0 * ldb;
    acc_t* Ci = C + i * ldc;
    const acc_t* rsi = rs ? rs + i : nullptr;
    const acc_t* Xi = X ? X + i * ldc : nullptr;
    const int64_t Pi = p1 - p0;
    switch (m) {
      case 6: gemm_cols<6>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 5: gemm_cols<5>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 4: gemm_cols<4>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 3: gemm_cols<3>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      case 2: gemm_cols<2>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs); break;
      default: gemm_cols<1>(Pi, N, Ai, lda, Bi, ldb, Ci, ldc, rsi, Xi, cs);
    }
  }
}

// out[0, n) = c x y elementwise, n a multiple of the vector length.
template <typename acc_t>
inline void hadamard(int64_t n, const acc_t* x, const acc_t* y, acc_t* out, acc_t c = 1) {
  constexpr int64_t L = kVecLanes<acc_t>;
  for (int64_t i = 0; i < n; i += L) store_vec(out + i, c * (load_vec(x + i) * load_vec(y + i)));
}

template <typename acc_t>
inline acc_t dot(int64_t n, const acc_t* x, const acc_t* y) {
  return hsum<acc_t>(dot_lanes(n, x, y));
}

// sum x y in double (a float product is exact in double): dg's terms, <dSn, S0> and the
// per-token dots; in float the rounding of <dSn, S0>, ~1e-7 of sum |dS| |S|, would go into
// every dg of the sub-chunk alike, and so into a gate parameter's gradient (a sum of dg over
// tokens) without cancelling.
template <typename acc_t>
inline double dot_f64(int64_t n, const acc_t* x, const acc_t* y) {
  if constexpr (std::is_same_v<acc_t, double>) {
    return dot(n, x, y);
  } else {
    // L floats widened to one vector of L doubles, four vectors at a time.
    constexpr int64_t L = kVecLanes<double>;
    using vd = SimdVec<double>;
    using vf = Vec<float, L>;
    vd acc[4] = {};
    int64_t i = 0;
    for (; i + 4 * L <= n; i += 4 * L) {
      for (int64_t m = 0; m < 4; ++m) {
        vf a, b;
        std::memcpy(&a, x + i + L * m, sizeof(a));
        std::memcpy(&b, y + i + L * m, sizeof(b));
        acc[m] += __builtin_convertvector(a, vd) * __builtin_convertvector(b, vd);
      }
    }
    const vd t = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double tail = 0;
    for (; i < n; ++i) tail += double(x[i]) * double(y[i]);
    double sum = 0;  // the lanes in pairs: (t0 + t1) + (t2 + t3) for four
    for (int64_t l = 0; l < L; l += 2) sum += t[l] + t[l + 1];
    return sum + tail;
  }
}

// Loads n rows (tok0.., head) of a [tokens, heads, dim] input into a zero-padded [Cs, ld]
// acc_t matrix, each row times f[i] (1 when f is null) and c.
template <typename in_t, typename acc_t>
inline void load_rows(const in_t* base, int64_t tok0, int64_t n, int64_t rows, int64_t heads,
                      int64_t head, int64_t dim, int64_t ld, const acc_t* f, acc_t c,
                      acc_t* out) {
  for (int64_t i = 0; i < rows; ++i) {
    acc_t* o = out + i * ld;
    if (i < n) {
      const in_t* src = base + ((tok0 + i) * heads + head) * dim;
      const acc_t s = f ? c * f[i] : c;
      for (int64_t d = 0; d < dim; ++d) o[d] = s * static_cast<acc_t>(src[d]);
      for (int64_t d = dim; d < ld; ++d) o[d] = 0;
    } else {
      for (int64_t d = 0; d < ld; ++d) o[d] = 0;
    }
  }
}

// X = (I + M)^-1 for a strictly lower triangular n x n M (row-major, n a multiple of the
// vector length): X is unit lower triangular, row i = e_i - sum_{j<i} M[i][j] X_j. The
// sub-chunk's two triangular solves then run as one small matrix product each. Row i is
// summed in registers, in two chains (even and odd j): through memory, each term would wait
// on the store of the one before.
template <int64_t n, typename acc_t>
inline void unit_lower_inverse(const acc_t* __restrict M, acc_t* __restrict X) {
  using vec = SimdVec<acc_t>;
  constexpr int64_t L = sizeof(vec) / sizeof(acc_t), NV = n / L;
  for (int64_t i = 0; i < n; ++i) {
    vec x0[NV] = {}, x1[NV] = {};
    x0[i / L][i % L] = 1;
    int64_t j = 0;
    for (; j + 1 < i; j += 2) {
      const acc_t c0 = -M[i * n + j], c1 = -M[i * n + j + 1];
      for (int64_t v = 0; v < NV; ++v) {
        x0[v] += c0 * load_vec(X + j * n + v * L);
        x1[v] += c1 * load_vec(X + (j + 1) * n + v * L);
      }
    }
    if (j < i) {
      const acc_t c0 = -M[i * n + j];
      for (int64_t v = 0; v < NV; ++v) x0[v] += c0 * load_vec(X + j * n + v * L);
    }
    for (int64_t v = 0; v < NV; ++v) store_vec(X + i * n + v * L, x0[v] + x1[v]);
  }
}

// Rows of [tokens, heads, dim] inputs to prefetch into L2, a few lines at a time. The input
// rows a walk reads lie a KiB or more apart, and the chunks run backwards: the hardware does
// not prefetch them, and a burst of prefetches for a whole sub-chunk stalls on the few
// line-fill buffers. So while one walk runs, the rows the next one reads are queued in the
// order it reads them (the forward walk of a chunk queues its q and go rows, last sub-chunk
// first; the backward walk the checkpoint and the k, v and vw rows of the chunk before,
// sub-chunk by sub-chunk) and fetched between products. Into L2, not L1: a walk's rows (48
// KiB or more) would evict the states the products work on, and themselves before they are
// read. (In-process A/B of the backward op, 1 thread, B=1 T=2048 H=4 K=V=64: 10.9 -> 10.2 ms
// median with L2 and the order, 10.0 -> 9.7 ms with L2 alone; then the checkpoint with 40
// lines per pump instead of 24, 9.44 -> 9.13 and 9.53 -> 9.19 ms.)
struct RowQueue {
  std::vector<std::pair<const char*, int64_t>> rows;  // (row, bytes)
  size_t next = 0;
  int64_t byte = 0;
  void restart() { rows.clear(), next = 0, byte = 0; }
  void add(const void* base, int64_t t0, int64_t n, int64_t heads, int64_t head, int64_t dim,
           int64_t elem) {
    const char* c = static_cast<const char*>(base);
    for (int64_t tok = t0; tok < t0 + n; ++tok) {
      rows.emplace_back(c + ((tok * heads + head) * dim) * elem, dim * elem);
    }
  }
  void fetch(int64_t lines) {
    for (; lines > 0 && next < rows.size(); --lines) {
      __builtin_prefetch(rows[next].first + byte, 0, 2);
      byte += 64;
      if (byte >= rows[next].second) ++next, byte = 0;
    }
  }
};

// Gradient rows waiting to be streamed out (stream_row), a few at a time between products:
// written all at once, the sub-chunk's rows (~200 lines) wait on the few write-combining
// buffers.
template <typename acc_t>
struct RowDrain {
  struct Row {
    acc_t* dst;
    const acc_t* src;
    int64_t n;
  };
  std::vector<Row> rows;
  size_t next = 0;
  void drain(int64_t n) {
    for (; n > 0 && next < rows.size(); --n, ++next) {
      stream_row(rows[next].dst, rows[next].src, rows[next].n);
    }
  }
  void flush() {
    drain(int64_t(rows.size()));
    rows.clear(), next = 0;
  }
};

}  // namespace
}  // namespace RLX_ISA_NS
}  // namespace rlx
