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

constexpr int64_t kLutBlockBytes = 128 * 1024;  // table block per work item: stays in L2
constexpr int64_t kDenseTileBytes = 4 << 20;    // dequantized weight tile (dense path)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Groups per table block: the block [groups][M][E][BT] of acc_t stays near kLutBlockBytes.
int64_t groups_per_block(const Dims& d, int64_t bt, int64_t acc_size) {
  const int64_t per_group = d.num_codebooks * d.num_entries * bt * acc_size;
  return std::clamp<int64_t>(kLutBlockBytes / per_group, 1, std::max<int64_t>(d.groups, 1));
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
        for (int64_t c = 0; c < E; ++c) {
          const acc_t* entry = cb + (m * E + c) * D;
          acc_t a[BT] = {};
          for (int64_t t = 0; t < D; ++t) {
            const acc_t w = entry[t];
            const acc_t* xr = xT + (g * D + t) * BT;
            for (int b = 0; b < BT; ++b) a[b] += w * xr[b];
          }
          std::memcpy(Lgm + c * BT, a, sizeof(a));
        }
      }
    }
  }
}

// acc[j - j0][b] += sum_{g in block, m} L[g][m][idx[j, g0+g, m]][b] for j in [j0, j1).
// JT output rows at a time give JT*BT/width independent add chains.
template <typename acc_t, int BT, int JT>
void gather_block(const Dims& d, const uint8_t* idx, const acc_t* L, int64_t g0, int64_t ng,
                  int64_t j0, int64_t j1, acc_t* acc) {
  const int64_t M = d.num_codebooks, E = d.num_entries, row_stride = d.groups * M;
  int64_t j = j0;
  for (; j + JT <= j1; j += JT) {
    acc_t a[JT][BT];
    const uint8_t* ip[JT];
    for (int q = 0; q < JT; ++q) {
      std::memcpy(a[q], acc + (j + q - j0) * BT, sizeof(a[q]));
      ip[q] = idx + (j + q) * row_stride + g0 * M;
    }
    for (int64_t gm = 0; gm < ng * M; ++gm) {
      const acc_t* Lgm = L + gm * E * BT;
      for (int q = 0; q < JT; ++q) {
        const acc_t* r = Lgm + ip[q][gm] * BT;
        for (int b = 0; b < BT; ++b) a[q][b] += r[b];
      }
    }
    for (int q = 0; q < JT; ++q) std::memcpy(acc + (j + q - j0) * BT, a[q], sizeof(a[q]));
  }
  for (; j < j1; ++j) {
    acc_t a[BT];
    std::memcpy(a, acc + (j - j0) * BT, sizeof(a));
    const uint8_t* ip = idx + j * row_stride + g0 * M;
    for (int64_t gm = 0; gm < ng * M; ++gm) {
      const acc_t* r = L + (gm * E + ip[gm]) * BT;
      for (int b = 0; b < BT; ++b) a[b] += r[b];
    }
    std::memcpy(acc + (j - j0) * BT, a, sizeof(a));
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
    f.template operator()<1, 8>();
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

}  // namespace
}  // namespace rlx::codebook

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("codebook_matmul", &rlx::codebook::forward_cpu);
}
