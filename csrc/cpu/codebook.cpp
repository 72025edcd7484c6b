// CPU kernels for rlx::codebook_matmul and rlx::codebook_matmul_backward.
//
// Lookup-table (LUT) path, used for small batches and whenever it is cheaper than a GEMM:
//   forward   L[g][m][c][b] = x[b, g*D:(g+1)*D] . C[m, c]        (E*M dot products per group)
//             out[b, j]     = s_j * sum_{g,m} L[g][m][idx[j,g,m]][b] + bias_j
//   backward  dL[g][m][c][b] = sum_{j: idx[j,g,m]=c} dout[b, j] * s_j      (scatter-add)
//             dx[b, g*D+t]   = sum_{m,c} dL[g][m][c][b] * C[m, c, t]
//             dC[m, c, t]    = sum_{g,b} dL[g][m][c][b] * x[b, g*D+t]
// The batch index b is innermost in L/dL, so that for a tile of BT batch rows one index byte
// selects a contiguous BT-wide row: the gather/scatter loops are plain vector loads and adds,
// no hardware gathers. Groups are processed in blocks sized to keep the table in L2.
// The dense N x K weight is never built on this path.
//
// Dense path, for large batches where a GEMM beats the gathers: dequantize row tiles of W and
// call at::mm on them.
//
// Determinism: every output element is written by exactly one work item, in an order that does
// not depend on the number of threads; dcodebook is reduced from per-block partials in a fixed
// order. Half inputs accumulate in float32, float64 in float64.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <rlx/codebook.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace rlx::codebook {
namespace {

template <typename T>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};

constexpr int64_t kLutBlockBytes = 256 * 1024;       // table block per work item: stays in L2
constexpr int64_t kLutBlockBytesOneRow = 16 * 1024;  // one-row tables: stay in L1
constexpr int64_t kDenseTileBytes = 4 << 20;    // dequantized weight tile (dense path)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Groups per table block: the block [groups][M][E][BT] of acc_t stays near kLutBlockBytes.
int64_t groups_per_block(const Dims& d, int64_t bt, int64_t acc_size) {
  const int64_t per_group = d.num_codebooks * d.num_entries * bt * acc_size;
  // One batch row reads 4 bytes of each 64-byte table line: keep its table in L1 instead.
  const int64_t bytes = bt == 1 ? kLutBlockBytesOneRow : kLutBlockBytes;
  return std::clamp<int64_t>(bytes / per_group, 1, std::max<int64_t>(d.groups, 1));
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

// 256-bit vectors via the GCC/Clang vector extension: explicit vectors keep the BT-wide
// accumulators in registers (the compiler scalarizes plain local arrays of this size).
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
  static constexpr int width = 32 / sizeof(T);
};

template <typename V, typename T>
inline V load_vec(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V, typename T>
inline void store_vec(T* p, const V& v) {
  std::memcpy(p, &v, sizeof(V));
}

// L[g][m][c][b] for the ng groups held in xT ([ng*D][BT]).
template <typename acc_t, int BT>
void build_table(const Dims& d, const acc_t* cb, const acc_t* cbT, const acc_t* xT, int64_t ng,
                 acc_t* L) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  for (int64_t g = 0; g < ng; ++g) {
    for (int64_t m = 0; m < M; ++m) {
      acc_t* Lgm = L + (g * M + m) * E * BT;
      if constexpr (BT == 1) {
        // One batch row: vectorize over the entries c with the transposed codebook [M][D][E].
        std::fill(Lgm, Lgm + E, acc_t(0));
        for (int64_t t = 0; t < D; ++t) {
          const acc_t xv = xT[g * D + t];
          const acc_t* ct = cbT + (m * D + t) * E;
          for (int64_t c = 0; c < E; ++c) Lgm[c] += xv * ct[c];
        }
      } else {
        using V = typename Vec<acc_t>::type;
        constexpr int W = Vec<acc_t>::width, NV = BT / W;
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
            for (int v = 0; v < NV; ++v) xv[v] = load_vec<V>(xr + v * W);
            for (int q = 0; q < CB; ++q) {
              const acc_t w = entry[q * D + t];
              for (int v = 0; v < NV; ++v) a[q][v] += w * xv[v];
            }
          }
          for (int q = 0; q < CB; ++q)
            for (int v = 0; v < NV; ++v) store_vec(Lgm + (c + q) * BT + v * W, a[q][v]);
        }
        for (; c < E; ++c) {
          const acc_t* entry = cb + (m * E + c) * D;
          V a[NV] = {};
          for (int64_t t = 0; t < D; ++t) {
            const acc_t w = entry[t];
            const acc_t* xr = xT + (g * D + t) * BT;
            for (int v = 0; v < NV; ++v) a[v] += w * load_vec<V>(xr + v * W);
          }
          for (int v = 0; v < NV; ++v) store_vec(Lgm + c * BT + v * W, a[v]);
        }
      }
    }
  }
}

// acc[j - j0][b] += sum_{g in block, m} L[g][m][idx[j, g0+g, m]][b] for j in [j0, j1).
// JT output rows at a time give independent add chains (latency, not throughput, bound).
template <typename acc_t, int BT, int JT>
void gather_block(const Dims& d, const uint8_t* idx, const acc_t* L, int64_t g0, int64_t ng,
                  int64_t j0, int64_t j1, acc_t* acc) {
  const int64_t M = d.num_codebooks, E = d.num_entries, row_stride = d.groups * M;
  const int64_t steps = ng * M;
  if constexpr (BT == 1) {
    int64_t j = j0;
    for (; j + JT <= j1; j += JT) {
      acc_t a[JT];
      const uint8_t* ip[JT];
      for (int q = 0; q < JT; ++q) {
        a[q] = acc[j + q - j0];
        ip[q] = idx + (j + q) * row_stride + g0 * M;
      }
      int64_t gm = 0;
      // Eight index bytes per load, unpacked with shifts: one load per table lookup, not two.
      for (; gm + 8 <= steps; gm += 8) {
        uint64_t packed[JT];
        for (int q = 0; q < JT; ++q) std::memcpy(&packed[q], ip[q] + gm, 8);
        for (int k = 0; k < 8; ++k) {
          const acc_t* Lgm = L + (gm + k) * E;
          for (int q = 0; q < JT; ++q) a[q] += Lgm[(packed[q] >> (8 * k)) & 0xff];
        }
      }
      for (; gm < steps; ++gm) {
        const acc_t* Lgm = L + gm * E;
        for (int q = 0; q < JT; ++q) a[q] += Lgm[ip[q][gm]];
      }
      for (int q = 0; q < JT; ++q) acc[j + q - j0] = a[q];
    }
    for (; j < j1; ++j) {
      acc_t a = acc[j - j0];
      const uint8_t* ip = idx + j * row_stride + g0 * M;
      for (int64_t gm = 0; gm < steps; ++gm) a += L[gm * E + ip[gm]];
      acc[j - j0] = a;
    }
  } else {
    using V = typename Vec<acc_t>::type;
    constexpr int W = Vec<acc_t>::width, NV = BT / W;
    int64_t j = j0;
    for (; j + JT <= j1; j += JT) {
      V a[JT][NV];
      const uint8_t* ip[JT];
      for (int q = 0; q < JT; ++q) {
        for (int v = 0; v < NV; ++v) a[q][v] = load_vec<V>(acc + (j + q - j0) * BT + v * W);
        ip[q] = idx + (j + q) * row_stride + g0 * M;
      }
      for (int64_t gm = 0; gm < steps; ++gm) {
        const acc_t* Lgm = L + gm * E * BT;
        for (int q = 0; q < JT; ++q) {
          const acc_t* r = Lgm + ip[q][gm] * BT;
          for (int v = 0; v < NV; ++v) a[q][v] += load_vec<V>(r + v * W);
        }
      }
      for (int q = 0; q < JT; ++q)
        for (int v = 0; v < NV; ++v) store_vec(acc + (j + q - j0) * BT + v * W, a[q][v]);
    }
    for (; j < j1; ++j) {
      V a[NV];
      for (int v = 0; v < NV; ++v) a[v] = load_vec<V>(acc + (j - j0) * BT + v * W);
      const uint8_t* ip = idx + j * row_stride + g0 * M;
      for (int64_t gm = 0; gm < steps; ++gm) {
        const acc_t* r = L + (gm * E + ip[gm]) * BT;
        for (int v = 0; v < NV; ++v) a[v] += load_vec<V>(r + v * W);
      }
      for (int v = 0; v < NV; ++v) store_vec(acc + (j - j0) * BT + v * W, a[v]);
    }
  }
}

// Codebook in the accumulation type, as [M][E][D] and transposed [M][D][E].
template <typename acc_t>
struct CodebookAcc {
  at::Tensor cb, cbT;
  CodebookAcc(const at::Tensor& codebook, const Dims& d) {
    auto c = codebook.reshape({d.num_codebooks, d.num_entries, d.entry_dim})
                 .to(c10::CppTypeToScalarType<acc_t>::value);
    cb = c.contiguous();
    cbT = c.transpose(1, 2).contiguous();
  }
  const acc_t* data() const { return cb.data_ptr<acc_t>(); }
  const acc_t* dataT() const { return cbT.data_ptr<acc_t>(); }
};

// out[b, j] = s_j * raw[b, j] + bias_j (scales/bias may be null), out_t is scalar_t or acc_t.
template <typename scalar_t, typename acc_t, typename out_t, int BT, int JT>
void lut_forward(const Dims& d, const scalar_t* x, const uint8_t* idx, const CodebookAcc<acc_t>& C,
                 const scalar_t* scales, const scalar_t* bias, out_t* out) {
  const int64_t B = d.rows, N = d.out_features, K = d.in_features, D = d.entry_dim;
  const int64_t M = d.num_codebooks, E = d.num_entries;
  if (B == 0 || N == 0) return;
  const int64_t num_tiles = ceil_div(B, BT);
  // Split the outputs only when there are too few batch tiles to keep every thread busy;
  // each split rebuilds the table, so never more splits than needed.
  const int64_t want = at::get_num_threads();
  const int64_t splits = std::clamp<int64_t>(ceil_div(want, num_tiles), 1, ceil_div(N, 64));
  const int64_t rows_per_split = ceil_div(N, splits);
  const int64_t gpb = groups_per_block(d, BT, sizeof(acc_t));
  const acc_t* cb = C.data();
  const acc_t* cbT = C.dataT();
  at::parallel_for(0, num_tiles * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xT(gpb * D * BT), L(gpb * M * E * BT), acc(rows_per_split * BT);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b0 = (w / splits) * BT, nb = std::min<int64_t>(BT, B - b0);
      const int64_t j0 = (w % splits) * rows_per_split, j1 = std::min(N, j0 + rows_per_split);
      if (j0 >= j1) continue;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t g0 = 0; g0 < d.groups; g0 += gpb) {
        const int64_t ng = std::min(gpb, d.groups - g0);
        load_x_tile<scalar_t, acc_t, BT>(x, K, b0, nb, g0 * D, ng * D, xT.data());
        build_table<acc_t, BT>(d, cb, cbT, xT.data(), ng, L.data());
        gather_block<acc_t, BT, JT>(d, idx, L.data(), g0, ng, j0, j1, acc.data());
      }
      for (int64_t j = j0; j < j1; ++j) {
        const acc_t s = scales ? static_cast<acc_t>(scales[j]) : acc_t(1);
        const acc_t bj = bias ? static_cast<acc_t>(bias[j]) : acc_t(0);
        for (int64_t b = 0; b < nb; ++b)
          out[(b0 + b) * N + j] = static_cast<out_t>(acc[(j - j0) * BT + b] * s + bj);
      }
    }
  });
}

// Calls f.template operator()<BT, JT>() with the tile shape suited to B rows.
template <typename F>
void with_tile_shape(int64_t B, F&& f) {
  if (B <= 2) {
    f.template operator()<1, 4>();
  } else if (B <= 8) {
    f.template operator()<8, 4>();
  } else if (B <= 24) {
    f.template operator()<16, 2>();
  } else {
    f.template operator()<32, 1>();
  }
}

// The LUT costs about E*M table FMAs plus N*M/D gathered adds per (row, input feature);
// the dense path N FMAs at GEMM speed plus dequantizing the weight once. Weights measured on
// an AVX2 machine: a table FMA ~1/16, a gathered add ~1/8, a GEMM FMA ~1/24 cycle.
bool use_dense(const Dims& d) {
  if (d.rows < 64) return false;
  const double M = static_cast<double>(d.num_codebooks);
  const double lut = d.num_entries * M / 16.0 + d.out_features * M / (8.0 * d.entry_dim);
  const double dense = d.out_features / 24.0 + d.out_features * M / (4.0 * d.rows);
  return lut > dense;
}

// W[j - j0, g*D + t] = sum_m C[m, idx[j, g, m], t] for rows [j0, j1).
template <typename acc_t>
at::Tensor dequantize_rows(const Dims& d, const uint8_t* idx, const acc_t* cb, int64_t j0,
                           int64_t j1) {
  const int64_t K = d.in_features, D = d.entry_dim, M = d.num_codebooks, E = d.num_entries;
  at::Tensor W = at::empty({j1 - j0, K}, at::dtype(c10::CppTypeToScalarType<acc_t>::value));
  acc_t* w = W.data_ptr<acc_t>();
  at::parallel_for(j0, j1, 16, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      acc_t* row = w + (j - j0) * K;
      const uint8_t* ip = idx + j * d.groups * M;
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
  return W;
}

int64_t dense_tile_rows(const Dims& d, int64_t acc_size) {
  return std::max<int64_t>(64, kDenseTileBytes / std::max<int64_t>(d.in_features * acc_size, 1));
}

// raw[b, j] = sum_k x[b, k] W[j, k] in the accumulation dtype, one weight tile at a time.
template <typename acc_t>
at::Tensor dense_raw(const Dims& d, const at::Tensor& x_acc, const uint8_t* idx, const acc_t* cb) {
  auto rawT = at::empty({d.out_features, d.rows}, x_acc.options());
  const int64_t tile = dense_tile_rows(d, sizeof(acc_t));
  for (int64_t j0 = 0; j0 < d.out_features; j0 += tile) {
    const int64_t j1 = std::min(d.out_features, j0 + tile);
    auto dst = rawT.narrow(0, j0, j1 - j0);
    at::mm_out(dst, dequantize_rows<acc_t>(d, idx, cb, j0, j1), x_acc.t());
  }
  return rawT.t();
}

// E < 256 leaves uint8 values that would read past the codebook; 256 entries cannot overflow.
void check_index_range(const at::Tensor& indices, const Dims& d) {
  if (d.num_entries >= 256 || indices.numel() == 0) return;
  const int64_t top = indices.max().item<uint8_t>();
  TORCH_CHECK_VALUE(top < d.num_entries, "codebook_matmul: indices must be < E=", d.num_entries,
                    " (the number of codebook entries), found ", top);
}

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                       const std::optional<at::Tensor>& scales,
                       const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  check_index_range(indices, d);
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  auto bs = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codebook_matmul", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const CodebookAcc<acc_t> C(codebook, d);
    const scalar_t* sp = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    const scalar_t* bp = bs.defined() ? bs.data_ptr<scalar_t>() : nullptr;
    if (use_dense(d)) {
      auto raw = dense_raw<acc_t>(d, x2d.to(C.cb.scalar_type()), idx.data_ptr<uint8_t>(), C.data());
      if (sp) raw = raw * s.to(raw.scalar_type());
      if (bp) raw = raw + bs.to(raw.scalar_type());
      out.view({d.rows, d.out_features}).copy_(raw);
      return;
    }
    with_tile_shape(d.rows, [&]<int BT, int JT>() {
      lut_forward<scalar_t, acc_t, scalar_t, BT, JT>(d, x2d.data_ptr<scalar_t>(),
                                                     idx.data_ptr<uint8_t>(), C, sp, bp,
                                                     out.data_ptr<scalar_t>());
    });
  });
  return out;
}


// ---- backward ----

// Fixed (thread-count independent) partition of the groups into blocks: each block's
// dcodebook partial is summed in block order, so results never depend on scheduling.
int64_t backward_groups_per_block(const Dims& d, int64_t bt, int64_t acc_size) {
  return std::min(groups_per_block(d, bt, acc_size), std::max<int64_t>(1, ceil_div(d.groups, 16)));
}

// gT[tile][j][b] = grad[b0 + b, j] * s_j in acc_t, zero rows past the batch.
template <typename scalar_t, typename acc_t, int BT>
std::vector<acc_t> scaled_grad_tiles(const Dims& d, const scalar_t* grad, const scalar_t* scales) {
  const int64_t B = d.rows, N = d.out_features, num_tiles = ceil_div(B, BT);
  std::vector<acc_t> gT(num_tiles * N * BT, acc_t(0));
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t b0 = tile * BT, nb = std::min<int64_t>(BT, B - b0);
      acc_t* dst = gT.data() + tile * N * BT;
      for (int64_t b = 0; b < nb; ++b) {
        const scalar_t* row = grad + (b0 + b) * N;
        for (int64_t j = 0; j < N; ++j) {
          const acc_t s = scales ? static_cast<acc_t>(scales[j]) : acc_t(1);
          dst[j * BT + b] = static_cast<acc_t>(row[j]) * s;
        }
      }
    }
  });
  return gT;
}

// dL[g][m][idx[j, g0+g, m]][b] += gT[j][b] over every output row j, in order (dL zeroed).
template <typename acc_t, int BT>
void scatter_block(const Dims& d, const uint8_t* idx, const acc_t* gT, int64_t g0, int64_t ng,
                   acc_t* dL) {
  const int64_t M = d.num_codebooks, E = d.num_entries, row_stride = d.groups * M;
  const int64_t steps = ng * M;
  for (int64_t j = 0; j < d.out_features; ++j) {
    const uint8_t* ip = idx + j * row_stride + g0 * M;
    if constexpr (BT == 1) {
      const acc_t gv = gT[j];
      for (int64_t gm = 0; gm < steps; ++gm) dL[gm * E + ip[gm]] += gv;
    } else {
      using V = typename Vec<acc_t>::type;
      constexpr int W = Vec<acc_t>::width, NV = BT / W;
      V gv[NV];
      for (int v = 0; v < NV; ++v) gv[v] = load_vec<V>(gT + j * BT + v * W);
      for (int64_t gm = 0; gm < steps; ++gm) {
        acc_t* r = dL + (gm * E + ip[gm]) * BT;
        for (int v = 0; v < NV; ++v) store_vec(r + v * W, load_vec<V>(r + v * W) + gv[v]);
      }
    }
  }
}

// sum_i a[i] * b[i] with W independent lanes, reduced in a fixed order.
template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using V = typename Vec<acc_t>::type;
  constexpr int W = Vec<acc_t>::width;
  V s = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) s += load_vec<V>(a + i) * load_vec<V>(b + i);
  acc_t total = 0;
  for (int k = 0; k < W; ++k) total += s[k];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// dx[b0 + b, (g0+g)*D + t] = sum_{m,c} dL[g][m][c][b] * C[m, c, t].
template <typename scalar_t, typename acc_t, int BT>
void dx_block(const Dims& d, const acc_t* cbT, const acc_t* dL, int64_t g0, int64_t ng,
              int64_t b0, int64_t nb, scalar_t* dx) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim, K = d.in_features;
  for (int64_t g = 0; g < ng; ++g) {
    const acc_t* dLg = dL + g * M * E * BT;
    scalar_t* out = dx + b0 * K + (g0 + g) * D;
    if constexpr (BT == 1) {
      for (int64_t t = 0; t < D; ++t) {
        acc_t sum = 0;
        for (int64_t m = 0; m < M; ++m) sum += dot(dLg + m * E, cbT + (m * D + t) * E, E);
        out[t] = static_cast<scalar_t>(sum);
      }
    } else {
      using V = typename Vec<acc_t>::type;
      constexpr int W = Vec<acc_t>::width, NV = BT / W, TT = 4;
      int64_t t0 = 0;
      // TT entry coordinates at once: TT*NV independent FMA chains per dL row load.
      for (; t0 < D; t0 += TT) {
        const int64_t nt = std::min<int64_t>(TT, D - t0);
        V a[TT][NV] = {};
        for (int64_t m = 0; m < M; ++m) {
          const acc_t* rows = dLg + m * E * BT;
          const acc_t* ct = cbT + (m * D + t0) * E;
          for (int64_t c = 0; c < E; ++c) {
            V r[NV];
            for (int v = 0; v < NV; ++v) r[v] = load_vec<V>(rows + c * BT + v * W);
            for (int tt = 0; tt < TT; ++tt) {
              const acc_t w = tt < nt ? ct[tt * E + c] : acc_t(0);
              for (int v = 0; v < NV; ++v) a[tt][v] += w * r[v];
            }
          }
        }
        for (int64_t tt = 0; tt < nt; ++tt)
          for (int64_t b = 0; b < nb; ++b)
            out[b * K + t0 + tt] = static_cast<scalar_t>(a[tt][b / W][b % W]);
      }
    }
  }
}

// wide[m][c][t][b] += sum_g dL[g][m][c][b] * x[b0 + b, (g0+g)*D + t]   (xT holds the x tile).
template <typename acc_t, int BT>
void dcodebook_block(const Dims& d, const acc_t* dL, const acc_t* xT, int64_t ng, acc_t* wide) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  if constexpr (BT == 1) {
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t mc = 0; mc < M * E; ++mc) {
        const acc_t v = dL[g * M * E + mc];
        for (int64_t t = 0; t < D; ++t) wide[mc * D + t] += v * xT[g * D + t];
      }
  } else {
    using V = typename Vec<acc_t>::type;
    constexpr int W = Vec<acc_t>::width, NV = BT / W, TT = 4;
    for (int64_t mc = 0; mc < M * E; ++mc) {
      for (int64_t t0 = 0; t0 < D; t0 += TT) {
        const int64_t nt = std::min<int64_t>(TT, D - t0);
        V a[TT][NV] = {};
        for (int64_t g = 0; g < ng; ++g) {
          const acc_t* row = dL + (g * M * E + mc) * BT;
          V r[NV];
          for (int v = 0; v < NV; ++v) r[v] = load_vec<V>(row + v * W);
          for (int tt = 0; tt < TT; ++tt) {
            if (tt >= nt) break;
            const acc_t* xr = xT + (g * D + t0 + tt) * BT;
            for (int v = 0; v < NV; ++v) a[tt][v] += r[v] * load_vec<V>(xr + v * W);
          }
        }
        for (int64_t tt = 0; tt < nt; ++tt) {
          acc_t* w = wide + (mc * D + t0 + tt) * BT;
          for (int v = 0; v < NV; ++v) store_vec(w + v * W, load_vec<V>(w + v * W) + a[tt][v]);
        }
      }
    }
  }
}

// LUT backward for dx (written into dx) and the per-block dcodebook partials [blocks][M*E*D].
template <typename scalar_t, typename acc_t, int BT>
void lut_backward(const Dims& d, const scalar_t* grad, const scalar_t* x, const uint8_t* idx,
                  const CodebookAcc<acc_t>& C, const scalar_t* scales, scalar_t* dx,
                  acc_t* dc_parts, int64_t gpb) {
  const int64_t B = d.rows, K = d.in_features, D = d.entry_dim;
  const int64_t M = d.num_codebooks, E = d.num_entries, MED = M * E * D;
  const int64_t num_tiles = ceil_div(B, BT), num_blocks = ceil_div(d.groups, gpb);
  const std::vector<acc_t> gT = scaled_grad_tiles<scalar_t, acc_t, BT>(d, grad, scales);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> dL(gpb * M * E * BT), xT(gpb * D * BT);
    std::vector<acc_t> wide(dc_parts ? MED * BT : 0);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t g0 = blk * gpb, ng = std::min(gpb, d.groups - g0);
      std::fill(wide.begin(), wide.end(), acc_t(0));
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t b0 = tile * BT, nb = std::min<int64_t>(BT, B - b0);
        std::fill(dL.begin(), dL.begin() + ng * M * E * BT, acc_t(0));
        scatter_block<acc_t, BT>(d, idx, gT.data() + tile * d.out_features * BT, g0, ng,
                                 dL.data());
        if (dx) dx_block<scalar_t, acc_t, BT>(d, C.dataT(), dL.data(), g0, ng, b0, nb, dx);
        if (dc_parts) {
          load_x_tile<scalar_t, acc_t, BT>(x, K, b0, nb, g0 * D, ng * D, xT.data());
          dcodebook_block<acc_t, BT>(d, dL.data(), xT.data(), ng, wide.data());
        }
      }
      if (dc_parts) {
        acc_t* part = dc_parts + blk * MED;
        for (int64_t i = 0; i < MED; ++i) {
          acc_t s = 0;
          for (int b = 0; b < BT; ++b) s += wide[i * BT + b];
          part[i] = s;
        }
      }
    }
  });
}

// Dense backward for large batches: per weight tile, dx += gs @ W and dW = gs^T @ x, whose
// rows are scattered into per-block dcodebook partials.
template <typename acc_t>
void dense_backward(const Dims& d, const at::Tensor& gs, const at::Tensor& x_acc,
                    const uint8_t* idx, const acc_t* cb, at::Tensor* dx_acc, acc_t* dc_parts,
                    int64_t gpb) {
  const int64_t K = d.in_features, D = d.entry_dim, M = d.num_codebooks, E = d.num_entries;
  const int64_t num_blocks = ceil_div(d.groups, gpb), tile = dense_tile_rows(d, sizeof(acc_t));
  for (int64_t j0 = 0; j0 < d.out_features; j0 += tile) {
    const int64_t j1 = std::min(d.out_features, j0 + tile);
    const at::Tensor g_tile = gs.narrow(1, j0, j1 - j0);
    if (dx_acc) dx_acc->addmm_(g_tile, dequantize_rows<acc_t>(d, idx, cb, j0, j1));
    if (!dc_parts) continue;
    const at::Tensor dW = at::mm(g_tile.t(), x_acc);
    const acc_t* dw = dW.data_ptr<acc_t>();
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
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
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask) {
  const Dims d = check_inputs(x, indices, codebook, scales, std::nullopt);
  check_grad_out(grad_out, x, d);
  TORCH_CHECK_VALUE(!mask[2] || scales.has_value(),
                    "codebook_matmul_backward: output_mask[2] (grad_scales) needs scales");
  check_index_range(indices, d);
  // Distinct empty tensors for the outputs not computed (outputs must not alias).
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType acc_type = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto g2d = grad_out.reshape({d.rows, d.out_features}).contiguous();
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  at::Tensor dx = mask[0] ? at::empty(x.sizes(), x.options()) : skipped();
  at::Tensor dC = skipped(), ds = skipped(), db = skipped();
  if (mask[3]) db = g2d.to(acc_type).sum(0).to(x.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "codebook_matmul_backward", [&] {
    using acc_t = typename AccType<scalar_t>::type;
    const CodebookAcc<acc_t> C(codebook, d);
    const scalar_t* sp = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    const uint8_t* ip = idx.data_ptr<uint8_t>();
    const bool dense = use_dense(d);
    if (mask[2]) {
      at::Tensor raw;
      if (dense) {
        raw = dense_raw<acc_t>(d, x2d.to(acc_type), ip, C.data());
      } else {
        raw = at::empty({d.rows, d.out_features}, at::dtype(acc_type));
        with_tile_shape(d.rows, [&]<int BT, int JT>() {
          lut_forward<scalar_t, acc_t, acc_t, BT, JT>(d, x2d.data_ptr<scalar_t>(), ip, C, nullptr,
                                                      nullptr, raw.data_ptr<acc_t>());
        });
      }
      ds = (g2d.to(acc_type) * raw).sum(0).to(x.scalar_type());
    }
    if (!mask[0] && !mask[1]) return;
    const int64_t med = d.num_codebooks * d.num_entries * d.entry_dim;
    at::Tensor parts;
    auto run = [&](int64_t gpb) {
      const int64_t num_blocks = ceil_div(d.groups, gpb);
      if (mask[1]) parts = at::zeros({num_blocks, med}, at::dtype(acc_type));
      return parts.defined() ? parts.data_ptr<acc_t>() : nullptr;
    };
    if (dense) {
      const int64_t gpb = std::max<int64_t>(1, ceil_div(d.groups, 16));
      acc_t* dc_parts = run(gpb);
      auto x_acc = x2d.to(acc_type);
      auto gs = g2d.to(acc_type);
      if (sp) gs = gs * s.to(acc_type);
      at::Tensor dx_acc = mask[0] ? at::zeros({d.rows, d.in_features}, at::dtype(acc_type))
                                  : at::Tensor();
      dense_backward<acc_t>(d, gs, x_acc, ip, C.data(), mask[0] ? &dx_acc : nullptr, dc_parts, gpb);
      if (mask[0]) dx.view({d.rows, d.in_features}).copy_(dx_acc);
    } else {
      with_tile_shape(d.rows, [&]<int BT, int JT>() {
        const int64_t gpb = backward_groups_per_block(d, BT, sizeof(acc_t));
        acc_t* dc_parts = run(gpb);
        lut_backward<scalar_t, acc_t, BT>(d, g2d.data_ptr<scalar_t>(), x2d.data_ptr<scalar_t>(),
                                          ip, C, sp, mask[0] ? dx.data_ptr<scalar_t>() : nullptr,
                                          dc_parts, gpb);
      });
    }
    if (mask[1]) {
      // Fixed-order reduction of the block partials (parts is [blocks, M*E*D]).
      at::Tensor total = at::zeros({med}, at::dtype(acc_type));
      for (int64_t blk = 0; blk < parts.size(0); ++blk) total.add_(parts[blk]);
      dC = total.view(codebook.sizes()).to(x.scalar_type());
    }
  });
  return {dx, dC, ds, db};
}

}  // namespace
}  // namespace rlx::codebook

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("codebook_matmul", &rlx::codebook::forward_cpu);
  m.impl("codebook_matmul_backward", &rlx::codebook::backward_cpu);
}
