// CPU kernel for rlx::codebook_matmul_backward: lookup-table scatter for small batches,
// dequantized weight tiles + GEMM for large ones (the algorithm is described in codebook.cpp).
#include "cpu_kernel_deps.h"
#include "codebook_kernels.h"

RLX_ISA_BEGIN
#include "codebook_lut.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {
namespace {

// gT[tile][j][b] = grad[b0 + b, j] * s_j in acc_t, zero rows past the batch.
template <typename scalar_t, typename acc_t, int BT>
LineVector<acc_t> scaled_grad_tiles(const Dims& d, const scalar_t* grad, const scalar_t* scales) {
  const int64_t B = d.rows, N = d.out_features, num_tiles = ceil_div(B, BT);
  LineVector<acc_t> gT(num_tiles * N * BT, acc_t(0));
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
      using V = SimdVec<acc_t>;
      constexpr int W = kVecLanes<acc_t>, NV = BT / W;
      V gv[NV];
      for (int v = 0; v < NV; ++v) gv[v] = load_vec(gT + j * BT + v * W);
      for (int64_t gm = 0; gm < steps; ++gm) {
        acc_t* r = dL + (gm * E + ip[gm]) * BT;
        for (int v = 0; v < NV; ++v) store_vec(r + v * W, load_vec(r + v * W) + gv[v]);
      }
    }
  }
}

// sum_i a[i] * b[i] with W independent lanes, reduced in a fixed order.
template <typename acc_t>
acc_t dot(const acc_t* a, const acc_t* b, int64_t n) {
  using V = SimdVec<acc_t>;
  constexpr int W = kVecLanes<acc_t>;
  V s = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) s += load_vec(a + i) * load_vec(b + i);
  acc_t total = 0;
  for (int k = 0; k < W; ++k) total += s[k];
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// dx[b0 + b, (g0+g)*D + t] = sum_{m,c} dL[g][m][c][b] * C[m, c, t].
template <typename scalar_t, typename acc_t, int BT>
void dx_block(const Dims& d, const acc_t* cbT, const acc_t* dL, int64_t g0, int64_t ng,
              int64_t b0, int64_t nb, scalar_t* dx, const uint8_t* used) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim, K = d.in_features;
  for (int64_t g = 0; g < ng; ++g) {
    const acc_t* dLg = dL + g * M * E * BT;
    scalar_t* out = dx + b0 * K + (g0 + g) * D;
    if (used) {
      // Non-finite codebook: sum over the selected entries only, as the dense product does
      // (0 * inf from an entry no index selects would make the sum NaN).
      const uint8_t* ug = used + g * M * E;
      for (int64_t t = 0; t < D; ++t)
        for (int64_t b = 0; b < nb; ++b) {
          acc_t sum = 0;
          for (int64_t mc = 0; mc < M * E; ++mc)
            if (ug[mc]) sum += dLg[mc * BT + b] * cbT[(mc / E * D + t) * E + mc % E];
          out[b * K + t] = static_cast<scalar_t>(sum);
        }
      continue;
    }
    if constexpr (BT == 1) {
      for (int64_t t = 0; t < D; ++t) {
        acc_t sum = 0;
        for (int64_t m = 0; m < M; ++m) sum += dot(dLg + m * E, cbT + (m * D + t) * E, E);
        out[t] = static_cast<scalar_t>(sum);
      }
    } else {
      using V = SimdVec<acc_t>;
      constexpr int W = kVecLanes<acc_t>, NV = BT / W, TT = 4;
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
            for (int v = 0; v < NV; ++v) r[v] = load_vec(rows + c * BT + v * W);
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
void dcodebook_block(const Dims& d, const acc_t* dL, const acc_t* xT, int64_t ng, acc_t* wide,
                     const uint8_t* used) {
  const int64_t M = d.num_codebooks, E = d.num_entries, D = d.entry_dim;
  // used (non-finite x only): entries no index selects get no x term, as in the dense path.
  const auto skip = [&](int64_t g, int64_t mc) { return used && !used[g * M * E + mc]; };
  if constexpr (BT == 1) {
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t mc = 0; mc < M * E; ++mc) {
        if (skip(g, mc)) continue;
        const acc_t v = dL[g * M * E + mc];
        for (int64_t t = 0; t < D; ++t) wide[mc * D + t] += v * xT[g * D + t];
      }
  } else {
    using V = SimdVec<acc_t>;
    constexpr int W = kVecLanes<acc_t>, NV = BT / W, TT = 4;
    for (int64_t mc = 0; mc < M * E; ++mc) {
      for (int64_t t0 = 0; t0 < D; t0 += TT) {
        const int64_t nt = std::min<int64_t>(TT, D - t0);
        V a[TT][NV] = {};
        for (int64_t g = 0; g < ng; ++g) {
          if (skip(g, mc)) continue;
          const acc_t* row = dL + (g * M * E + mc) * BT;
          V r[NV];
          for (int v = 0; v < NV; ++v) r[v] = load_vec(row + v * W);
          for (int tt = 0; tt < TT; ++tt) {
            if (tt >= nt) break;
            const acc_t* xr = xT + (g * D + t0 + tt) * BT;
            for (int v = 0; v < NV; ++v) a[tt][v] += r[v] * load_vec(xr + v * W);
          }
        }
        for (int64_t tt = 0; tt < nt; ++tt) {
          acc_t* w = wide + (mc * D + t0 + tt) * BT;
          for (int v = 0; v < NV; ++v) store_vec(w + v * W, load_vec(w + v * W) + a[tt][v]);
        }
      }
    }
  }
}

// used[g][m][c] = 1 where some output row selects entry c of codebook m in group g0 + g.
inline void mark_used(const Dims& d, const uint8_t* idx, int64_t g0, int64_t ng, uint8_t* used) {
  const int64_t M = d.num_codebooks, E = d.num_entries, steps = ng * M;
  std::fill(used, used + steps * E, uint8_t(0));
  for (int64_t j = 0; j < d.out_features; ++j) {
    const uint8_t* ip = idx + j * d.groups * M + g0 * M;
    for (int64_t gm = 0; gm < steps; ++gm) used[gm * E + ip[gm]] = 1;
  }
}

// LUT backward for dx (written into dx) and the per-block dcodebook partials [blocks][M*E*D].
template <typename scalar_t, typename acc_t, int BT>
void lut_backward(const Dims& d, const scalar_t* grad, const scalar_t* x, const uint8_t* idx,
                  const acc_t* cbT, const scalar_t* scales, scalar_t* dx,
                  acc_t* dc_parts, int64_t gpb, bool mask_dx, bool mask_dc) {
  const int64_t B = d.rows, K = d.in_features, D = d.entry_dim;
  const int64_t M = d.num_codebooks, E = d.num_entries, MED = M * E * D;
  const int64_t num_tiles = ceil_div(B, BT), num_blocks = ceil_div(d.groups, gpb);
  const LineVector<acc_t> gT = scaled_grad_tiles<scalar_t, acc_t, BT>(d, grad, scales);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    LineVector<acc_t> dL(gpb * M * E * BT), xT(gpb * D * BT);
    LineVector<acc_t> wide(dc_parts ? MED * BT : 0);
    std::vector<uint8_t> used(mask_dx || mask_dc ? gpb * M * E : 0);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t g0 = blk * gpb, ng = std::min(gpb, d.groups - g0);
      std::fill(wide.begin(), wide.end(), acc_t(0));
      if (!used.empty()) mark_used(d, idx, g0, ng, used.data());
      const uint8_t* used_dx = mask_dx ? used.data() : nullptr;
      const uint8_t* used_dc = mask_dc ? used.data() : nullptr;
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t b0 = tile * BT, nb = std::min<int64_t>(BT, B - b0);
        std::fill(dL.begin(), dL.begin() + ng * M * E * BT, acc_t(0));
        scatter_block<acc_t, BT>(d, idx, gT.data() + tile * d.out_features * BT, g0, ng,
                                 dL.data());
        if (dx)
          dx_block<scalar_t, acc_t, BT>(d, cbT, dL.data(), g0, ng, b0, nb, dx, used_dx);
        if (dc_parts) {
          load_x_tile<scalar_t, acc_t, BT>(x, K, b0, nb, g0 * D, ng * D, xT.data());
          dcodebook_block<acc_t, BT>(d, dL.data(), xT.data(), ng, wide.data(), used_dc);
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

}  // namespace

template <typename scalar_t, typename acc_t>
void lut_backward_rows(const Dims& d, const scalar_t* grad, const scalar_t* x,
                       const uint8_t* idx, const acc_t* cbT, const scalar_t* scales,
                       scalar_t* dx, acc_t* dc_parts, int64_t gpb, bool mask_dx, bool mask_dc) {
  with_tile_shape(d.rows, [&](auto BT, auto) {
    lut_backward<scalar_t, acc_t, BT>(d, grad, x, idx, cbT, scales, dx, dc_parts, gpb, mask_dx,
                                      mask_dc);
  });
}

#define RLX_INSTANTIATE_LUT_BACKWARD(scalar_t)                                                \
  template void lut_backward_rows<scalar_t, acc_type_t<scalar_t>>(                          \
      const Dims&, const scalar_t*, const scalar_t*, const uint8_t*,                         \
      const acc_type_t<scalar_t>*, const scalar_t*, scalar_t*, acc_type_t<scalar_t>*, int64_t, \
      bool, bool);
RLX_INSTANTIATE_LUT_BACKWARD(float)
RLX_INSTANTIATE_LUT_BACKWARD(double)

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY)
// The op: host code, compiled once.
namespace rlx::codebook::cpu {
namespace {

// uint8 indices, after the checks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_u8(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d) {
  if (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) {
    // As in the forward: 16-bit inputs run the float32 kernels on float32 copies (the
    // kernels widen every element they read and round each gradient once either way).
    auto [dx, dC, ds, db] = backward_u8(grad_out.to(at::kFloat), x.to(at::kFloat), indices,
                                        codebook.to(at::kFloat), to_float(scales), mask, d);
    const auto t = x.scalar_type();
    return {dx.to(t), dC.to(t), ds.to(t), db.to(t)};
  }
  // Distinct empty tensors for the outputs not computed (outputs must not alias).
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType acc_type = acc_dtype(x.scalar_type());
  auto g2d = grad_out.reshape({d.rows, d.out_features}).contiguous();
  auto x2d = x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  at::Tensor dx = mask[0] ? at::empty(x.sizes(), x.options()) : skipped();
  at::Tensor dC = skipped(), ds = skipped(), db = skipped();
  if (mask[3]) db = g2d.to(acc_type).sum(0).to(x.scalar_type());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "codebook_matmul_backward", [&] {
    using acc_t = acc_type_t<scalar_t>;
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
        RLX_ISA_CALL_AVX512(lut_forward_rows<scalar_t, acc_t, acc_t>)(
            d, x2d.data_ptr<scalar_t>(), ip, C.data(), C.dataT(), nullptr, nullptr,
            raw.data_ptr<acc_t>());
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
      // The table sums run over every entry: with a non-finite codebook (for dx) or x (for
      // dcodebook) they must skip the entries no index selects to agree with the dense path.
      const bool mask_dx = mask[0] && !at::isfinite(codebook).all().item<bool>();
      const bool mask_dc = mask[1] && !at::isfinite(x).all().item<bool>();
      const int64_t gpb = backward_groups_per_block(d, tile_rows(d.rows), sizeof(acc_t));
      acc_t* dc_parts = run(gpb);
      RLX_ISA_CALL(lut_backward_rows<scalar_t, acc_t>)(
          d, g2d.data_ptr<scalar_t>(), x2d.data_ptr<scalar_t>(), ip, C.dataT(), sp,
          mask[0] ? dx.data_ptr<scalar_t>() : nullptr, dc_parts, gpb, mask_dx, mask_dc);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask) {
  const Dims d = check_backward_inputs(grad_out, x, indices, codebook, scales, mask);
  if (d.index_bytes == 2) {
    return gather_backward_op(grad_out, x, indices, codebook, scales, mask, d);
  }
  check_index_range(indices, d);
  return backward_u8(grad_out, x, indices, codebook, scales, mask, d);
}

}  // namespace
}  // namespace rlx::codebook::cpu

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("codebook_matmul_backward", &rlx::codebook::cpu::backward_cpu);
}
#endif
