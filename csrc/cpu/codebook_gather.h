// Gather-dequantize-dot CPU kernels of the codebook matmul for 16-bit indices (E up to 65536,
// AQLM's 1x16 and 2x16 schemes), where a lookup table of E entries per group would cost more
// than the product itself:
//   forward   out[b, j]      = s_j * sum_{g,m} x[b, g*D:(g+1)*D] . C[m, I[j,g,m]] + bias_j
//   backward  dx[b, g*D + t] = sum_j gs[b, j] sum_m C[m, I[j,g,m], t]        (gs = dout * s)
//             dC[m, c, t]    = sum_{(j,g): I[j,g,m] = c} sum_b gs[b, j] x[b, g*D + t]
// Each output row j reads its own codes and the entries they select (a D = 8 float entry is
// one 32-byte load); the codebook (2 MiB in float for 65536 x 8) stays in the caches. Large
// batches use the dense path of codebook_lut.h instead (dequantized tiles + GEMM).
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

// Largest index >= E seen by a kernel (-1: none), for the caller's error message.
struct BadIndex {
  std::atomic<int64_t> top{-1};
  void report(int64_t e) {
    int64_t cur = top.load(std::memory_order_relaxed);
    while (e > cur && !top.compare_exchange_weak(cur, e, std::memory_order_relaxed)) {
    }
  }
  void raise_if_any(const Dims& d) const {
    const int64_t t = top.load();
    TORCH_CHECK_VALUE(t < 0, "codebook_matmul: indices must be < E=", d.num_entries,
                      " (the number of codebook entries), found ", t);
  }
};

inline constexpr int64_t kGatherRowsPerItem = 64;  // output rows per forward work item
inline constexpr int64_t kMaxGatherBatch = 16;     // the gather path's batch limit (else dense)

inline bool use_gather_dense(const Dims& d) { return d.rows > kMaxGatherBatch; }

// raw[b0 + b, j] (b < BT) for rows j in [j0, j1): JT rows at a time give JT*BT independent
// accumulator chains. xt is [BT][K] in acc_t (zero rows past the batch). Compile-time D.
template <typename acc_t, int D, int BT, int JT>
void gather_rows_fixed(const Dims& d, const acc_t* xt, const uint16_t* idx, const acc_t* cb,
                       int64_t j0, int64_t j1, acc_t* raw, int64_t raw_stride, BadIndex& bad) {
  // One codebook entry, D lanes of acc_t (D in {4, 8, 16}: 16 to 128 bytes, one to four AVX
  // registers).
  using V = Vec<acc_t, D>;
  const int64_t G = d.groups, M = d.num_codebooks, E = d.num_entries, K = d.in_features;
  const int64_t steps = G * M;
  for (int64_t j = j0; j < j1; j += JT) {
    const int64_t nj = std::min<int64_t>(JT, j1 - j);
    V acc[JT][BT] = {};
    const uint16_t* rows[JT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) rows[q] = idx + std::min<int64_t>(j + q, j1 - 1) * steps;
    for (int64_t g = 0; g < G; ++g) {
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
    for (int q = 0; q < nj; ++q)
      for (int b = 0; b < BT; ++b) {
        acc_t s = 0;
        for (int t = 0; t < D; ++t) s += acc[q][b][t];
        raw[b * raw_stride + j + q] = s;
      }
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

// raw[b, j] = sum_{g,m} x[b, g] . C[m, I[j,g,m]] for all B <= kMaxGatherBatch rows; x_acc
// [B, K] and cb [M, E, D] contiguous in acc_t, raw [B, N].
template <typename acc_t>
void gather_forward(const Dims& d, const acc_t* x_acc, const uint16_t* idx, const acc_t* cb,
                    acc_t* raw, BadIndex& bad) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, D = d.entry_dim;
  if (B == 0 || N == 0) return;
  // Batch tiles of BT rows (zero padded), then output-row blocks in parallel.
  // Tile sizes come in as std::integral_constant (C++17: no template lambdas).
  const auto run = [&](auto dd, auto bt, auto jt) {
    constexpr int DD = decltype(dd)::value, BT = decltype(bt)::value, JT = decltype(jt)::value;
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
      at::parallel_for(0, ceil_div(N, kGatherRowsPerItem), 1, [&](int64_t begin, int64_t end) {
        for (int64_t it = begin; it < end; ++it) {
          const int64_t j0 = it * kGatherRowsPerItem;
          const int64_t j1 = std::min(N, j0 + kGatherRowsPerItem);
          gather_rows_fixed<acc_t, DD, BT, JT>(d, xt, idx, cb, j0, j1, dst, N, bad);
        }
      });
      if (nb < BT) std::copy_n(tile.data(), nb * N, raw + b0 * N);
    }
  };
  using std::integral_constant;
  const auto by_batch = [&](auto dd) {
    if (B == 1) {
      run(dd, integral_constant<int, 1>{}, integral_constant<int, 8>{});
    } else if (B == 2) {
      run(dd, integral_constant<int, 2>{}, integral_constant<int, 4>{});
    } else if (B <= 4) {
      run(dd, integral_constant<int, 4>{}, integral_constant<int, 2>{});
    } else {
      run(dd, integral_constant<int, 8>{}, integral_constant<int, 1>{});
    }
  };
  if (D == 8) {
    by_batch(integral_constant<int, 8>{});
  } else if (D == 16 && sizeof(acc_t) == 4) {
    by_batch(integral_constant<int, 16>{});
  } else if (D == 4) {
    by_batch(integral_constant<int, 4>{});
  } else {
    at::parallel_for(0, ceil_div(N, kGatherRowsPerItem), 1, [&](int64_t begin, int64_t end) {
      for (int64_t it = begin; it < end; ++it) {
        const int64_t j0 = it * kGatherRowsPerItem;
        gather_rows_any<acc_t>(d, x_acc, B, idx, cb, j0, std::min(N, j0 + kGatherRowsPerItem),
                               raw, N, bad);
      }
    });
  }
}

// Group chunks of the gather backward: each owns its dx columns and one dC partial. The count
// depends on the shape alone (deterministic); partials are capped at 64 MiB in all.
inline int64_t gather_backward_chunks(const Dims& d, int64_t acc_size, bool want_dc) {
  const int64_t by_groups = std::max<int64_t>(1, std::min<int64_t>(8, ceil_div(d.groups, 16)));
  if (!want_dc) return std::max<int64_t>(1, std::min<int64_t>(d.groups, 64));
  const int64_t med_bytes = d.num_codebooks * d.num_entries * d.entry_dim * acc_size;
  const int64_t by_memory = std::max<int64_t>(1, (int64_t(64) << 20) / std::max<int64_t>(med_bytes, 1));
  return std::min(by_groups, by_memory);
}

// dx (optional, [B, K] acc_t) and dC partials (optional, [chunks][M*E*D] acc_t, zeroed) for
// B <= kMaxGatherBatch rows. gs [B, N] = dout * s, x_acc [B, K], cb [M, E, D], all acc_t.
template <typename acc_t>
void gather_backward(const Dims& d, const acc_t* gs, const acc_t* x_acc, const uint16_t* idx,
                     const acc_t* cb, acc_t* dx, acc_t* dc_parts, int64_t chunks, BadIndex& bad) {
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

// Raises unless every index is < E (16-bit indices, before the dense path reads them).
inline void check_index_range_u16(const uint16_t* idx, int64_t n, const Dims& d) {
  if (d.num_entries >= 65536 || n == 0) return;
  BadIndex bad;
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    uint16_t top = 0;
    for (int64_t i = begin; i < end; ++i) top = std::max(top, idx[i]);
    if (top >= d.num_entries) bad.report(top);
  });
  bad.raise_if_any(d);
}

// The two ops for 16-bit indices (codebook_gather.cpp); inputs already checked.
at::Tensor gather_forward_op(const at::Tensor& x, const at::Tensor& indices,
                             const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& bias, const Dims& d);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d);

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
