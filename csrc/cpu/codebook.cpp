// CPU kernel for rlx::codebook_matmul (the backward is in codebook_backward.cpp, the shared
// building blocks in codebook_lut.h; 16-bit indices take the gather path of
// codebook_gather.h). The algorithm for uint8 indices, for both directions:
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
// One-row tiles (B <= 2) have their own loop order and, in the AVX2 copy, an asm gather:
// codebook_one_row.h.
// The dense N x K weight is never built on this path.
//
// Dense path, for large batches where a GEMM beats the gathers: dequantize row tiles of W and
// call at::mm on them.
//
// Determinism: every output element is written by exactly one work item, in an order that does
// not depend on the number of threads; dcodebook is reduced from per-block partials in a fixed
// order. Half inputs accumulate in float32, float64 in float64.
#include "cpu_kernel_deps.h"
#include "codebook_kernels.h"

RLX_ISA_BEGIN
#include "codebook_lut.h"
#include "codebook_one_row.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {

template <typename scalar_t, typename acc_t, typename out_t>
void lut_forward_rows(const Dims& d, const scalar_t* x, const uint8_t* idx, const acc_t* cb,
                      const acc_t* cbT, const scalar_t* scales, const scalar_t* bias,
                      out_t* out) {
  with_tile_shape(d.rows, [&](auto BT, auto JT) {
    if constexpr (BT == 1) {
      lut_forward_one_row<scalar_t, acc_t, out_t>(d, x, idx, cb, scales, bias, out,
                                                  kMinWorkItems);
    } else {
#if RLX_ISA_AVX512
      // 32 vector registers: enough output rows at a time for 8 independent add chains of
      // 512-bit table rows (the gather is bound by the adds' latency, not by the loads).
      constexpr int kJT = std::max<int>(JT, 8 * kTileLanes<acc_t, BT> / BT);
#else
      constexpr int kJT = JT;
#endif
      lut_forward<scalar_t, acc_t, out_t, BT, kJT>(d, x, idx, cb, scales, bias, out);
    }
  });
}

// float32 and float64 (the host code widens 16-bit inputs to float32; the forward's rows and
// the backward's raw sums are then the same instantiation); the dense path's dequantization
// and dcodebook scatter for both index widths.
#define RLX_INSTANTIATE_LUT_FORWARD(scalar_t, acc_t, out_t)                                  \
  template void lut_forward_rows<scalar_t, acc_t, out_t>(const Dims&, const scalar_t*,      \
                                                         const uint8_t*, const acc_t*,      \
                                                         const acc_t*, const scalar_t*,     \
                                                         const scalar_t*, out_t*);
RLX_INSTANTIATE_LUT_FORWARD(float, float, float)
RLX_INSTANTIATE_LUT_FORWARD(double, double, double)

#if !defined(RLX_ISA_AVX512_COPY)  // (the AVX-512 copy has the lookup-table forward only)

#define RLX_INSTANTIATE_DENSE(acc_t, index_t)                                                 \
  template void dequantize_rows<acc_t, index_t>(const Dims&, const index_t*, const acc_t*,  \
                                                int64_t, int64_t, acc_t*);                  \
  template void scatter_weight_grad<acc_t, index_t>(const Dims&, const acc_t*, const index_t*, \
                                                    int64_t, int64_t, int64_t, acc_t*);
RLX_INSTANTIATE_DENSE(float, uint8_t)
RLX_INSTANTIATE_DENSE(double, uint8_t)
RLX_INSTANTIATE_DENSE(float, uint16_t)
RLX_INSTANTIATE_DENSE(double, uint16_t)
#endif

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY) && !defined(RLX_ISA_AVX512_COPY)
// The op: host code, compiled once.
namespace rlx::codebook::cpu {
namespace {

// uint8 indices, after the checks.
at::Tensor forward_u8(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                      const std::optional<at::Tensor>& scales,
                      const std::optional<at::Tensor>& bias, const Dims& d) {
  if (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) {
    // 16-bit x, codebook, scales and bias run the float32 kernels on float32 copies: the
    // kernels widen every element they read to float32 and round out once either way, so
    // the results are the same, and the kernels are compiled for two dtypes instead of four
    // (the copies cost a pass over x and out, next to the N x K gathers).
    return forward_u8(x.to(at::kFloat), indices, codebook.to(at::kFloat), to_float(scales),
                      to_float(bias), d)
        .to(x.scalar_type());
  }
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  // (A 2-d contiguous x as it is: at one row the host code's torch calls are a visible part
  // of the call, most of all right after a large GEMM has evicted their code and data.)
  auto x2d = x.dim() == 2 && x.is_contiguous() ? x : x.reshape({d.rows, d.in_features}).contiguous();
  auto idx = indices.contiguous();
  auto s = scales.has_value() ? scales->contiguous() : at::Tensor();
  auto bs = bias.has_value() ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "codebook_matmul", [&] {
    using acc_t = acc_type_t<scalar_t>;
    // One-row tiles transpose the codebook themselves (lut_forward_one_row).
    const CodebookAcc<acc_t> C(codebook, d, /*transposed=*/tile_rows(d.rows) > 1);
    const scalar_t* sp = s.defined() ? s.data_ptr<scalar_t>() : nullptr;
    const scalar_t* bp = bs.defined() ? bs.data_ptr<scalar_t>() : nullptr;
    if (use_dense(d)) {
      auto raw = dense_raw<acc_t>(d, x2d.to(C.cb.scalar_type()), idx.data_ptr<uint8_t>(), C.data());
      if (sp) raw = raw * s.to(raw.scalar_type());
      if (bp) raw = raw + bs.to(raw.scalar_type());
      out.view({d.rows, d.out_features}).copy_(raw);
      return;
    }
    RLX_ISA_CALL_AVX512(lut_forward_rows<scalar_t, acc_t, scalar_t>)(
        d, x2d.data_ptr<scalar_t>(), idx.data_ptr<uint8_t>(), C.data(),
        C.cbT.defined() ? C.dataT() : nullptr, sp, bp,
        out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor forward_cpu(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
                       const std::optional<at::Tensor>& scales,
                       const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  if (d.index_bytes == 2) {
    return gather_forward_op(x, indices, codebook, scales, bias, d);
  }
  check_index_range(indices, d);
  return forward_u8(x, indices, codebook, scales, bias, d);
}

}  // namespace
}  // namespace rlx::codebook::cpu

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("codebook_matmul", &rlx::codebook::cpu::forward_cpu);
}
#endif
