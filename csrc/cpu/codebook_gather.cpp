// rlx::codebook_matmul and its backward for 16-bit indices on CPU: the gather kernels of
// codebook_gather.h for small batches, dequantized tiles + GEMM (codebook_kernels.h) for large
// ones. codebook.cpp and codebook_backward.cpp call these after checking the inputs. Each ISA
// copy defines the kernels' raw-pointer entry points; the host code after the region (checks,
// allocation, the accumulation type's choice) is compiled once.
#include "cpu_kernel_deps.h"
#include "codebook_kernels.h"

// The float16/bfloat16 codebook kernels live in the AVX2 and AVX-512 copies only (with F16C
// added to their targets, checked at run time for float16); the baseline copy converts the
// codebook instead. The AVX-512 copy (csrc/cpu/avx512/codebook_gather.cpp) has only them.
#if defined(__x86_64__) && RLX_ISA_AVX && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define RLX_HALF_GATHER 1
#endif

RLX_ISA_BEGIN
#include "codebook_gather.h"

namespace rlx::codebook::cpu::RLX_ISA_NS {
namespace {

#ifdef RLX_HALF_GATHER
// gather_rows_fixed for a float16 or bfloat16 codebook with D = 8: each entry is one 16-byte
// load widened to float32 in registers (exact: vcvtph2ps, or a 16-bit shift for bfloat16), so
// the random entry reads cover a table half the size of a float32 copy. Same tiles, same
// per-row summation order as the float32 kernel. FixedM > 0 fixes the codebook count at
// compile time (1x16, 2x16): the code offsets then advance by constants and stay in registers
// instead of being reloaded from the stack, which costs a load per code next to the entry's.
template <bool Bf16, int BT, int JT, int FixedM>
__attribute__((target("avx2,fma,f16c"))) void gather_rows_half8(
    const Dims& d, const float* xt, const uint16_t* idx, const uint16_t* cb, int64_t j0,
    int64_t j1, float* raw, int64_t raw_stride, BadIndex& bad) {
  const int64_t G = d.groups, E = d.num_entries, K = d.in_features;
  const int64_t M = FixedM > 0 ? FixedM : d.num_codebooks;
  const int64_t steps = G * M;
  for (int64_t j = j0; j < j1; j += JT) {
    const int64_t nj = std::min<int64_t>(JT, j1 - j);
    __m256 acc[JT][BT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) acc[q][b] = _mm256_setzero_ps();
    }
    const uint16_t* rows[JT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) rows[q] = idx + std::min<int64_t>(j + q, j1 - 1) * steps;
    for (int64_t g = 0; g < G; ++g) {
      if ((g & 15) == 0) prefetch_next_tile_codes<JT>(rows, JT * steps + g * M);
      __m256 xv[BT];
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) xv[b] = _mm256_loadu_ps(xt + b * K + g * 8);
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* cbm = cb + m * E * 8;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) {
          // Rows past j1 repeat the last row (always in bounds) and are not written.
          const int64_t e = rows[q][g * M + m];
          if (e >= E) {
            bad.report(e);
            continue;
          }
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cbm + e * 8));
          const __m256 c = Bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                : _mm256_cvtph_ps(h);
          RLX_UNROLL
          for (int b = 0; b < BT; ++b) acc[q][b] = _mm256_fmadd_ps(c, xv[b], acc[q][b]);
        }
      }
    }
    // Every row's sum with constant indices, then the nj kept: indexing acc by the run-time
    // nj would make the compiler keep acc in memory through the whole loop above.
    float sums[JT][BT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[q][b]);
        float s = 0;
        for (int t = 0; t < 8; ++t) s += lanes[t];
        sums[q][b] = s;
      }
    }
    for (int q = 0; q < nj; ++q)
      for (int b = 0; b < BT; ++b) raw[b * raw_stride + j + q] = sums[q][b];
  }
}

#if RLX_ISA_AVX512
// The AVX-512 copy's kernel for tiles of two or more batch rows: the entries of groups g and
// g + 1 side by side in one 512-bit vector, against x's 16 contiguous values of the pair, so
// that a step does half the FMAs and x reads of gather_rows_half8 (at more than one row those,
// not the entry reads, bound the loop: 1.3x faster at 16 rows). An odd last group fills the
// low half only. Out-of-range codes read a zero entry (and are reported).
template <bool Bf16, int BT, int JT, int FixedM>
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) void
gather_rows_half8_pairs(const Dims& d, const float* xt, const uint16_t* idx, const uint16_t* cb,
                        int64_t j0, int64_t j1, float* raw, int64_t raw_stride, BadIndex& bad) {
  static_assert(BT > 1, "one-row tiles take gather_rows_half8 (bound by the entry reads)");
  alignas(16) static const uint16_t kZeroEntry[8] = {};
  const int64_t G = d.groups, E = d.num_entries, K = d.in_features;
  const int64_t M = FixedM > 0 ? FixedM : d.num_codebooks;
  const int64_t steps = G * M;
  const auto entry = [&](const uint16_t* cbm, int64_t e) {
    if (e >= E) {
      bad.report(e);
      return reinterpret_cast<const __m128i*>(kZeroEntry);
    }
    return reinterpret_cast<const __m128i*>(cbm + e * 8);
  };
  // (The zero-masked forms of the conversions: the plain ones start from an undefined vector,
  // which GCC 12 reports as maybe uninitialized.)
  const auto widen = [](__m256i h) {
    return Bf16 ? _mm512_castsi512_ps(_mm512_maskz_slli_epi32(
                      0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16))
                : _mm512_maskz_cvtph_ps(0xffff, h);
  };
  const auto lane_sum = [](__m512 a) {  // fixed order: the halves, then 8 lanes in turn
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, a, 0),
                                         _mm512_maskz_extractf32x8_ps(0xff, a, 1)));
    float s = 0;
    for (int t = 0; t < 8; ++t) s += lanes[t];
    return s;
  };
  for (int64_t j = j0; j < j1; j += JT) {
    const int64_t nj = std::min<int64_t>(JT, j1 - j);
    __m512 acc[JT][BT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) acc[q][b] = _mm512_setzero_ps();
    }
    const uint16_t* rows[JT];
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) rows[q] = idx + std::min<int64_t>(j + q, j1 - 1) * steps;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      __m512 xv[BT];
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) xv[b] = _mm512_loadu_ps(xt + b * K + g * 8);
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* cbm = cb + m * E * 8;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) {
          const __m128i lo = _mm_loadu_si128(entry(cbm, rows[q][g * M + m]));
          const __m128i hi = _mm_loadu_si128(entry(cbm, rows[q][(g + 1) * M + m]));
          const __m512 c = widen(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
          RLX_UNROLL
          for (int b = 0; b < BT; ++b) acc[q][b] = _mm512_fmadd_ps(c, xv[b], acc[q][b]);
        }
      }
    }
    if (g < G) {
      __m512 xv[BT];
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) xv[b] = _mm512_maskz_loadu_ps(0x00ff, xt + b * K + g * 8);
      for (int64_t m = 0; m < M; ++m) {
        const uint16_t* cbm = cb + m * E * 8;
        RLX_UNROLL
        for (int q = 0; q < JT; ++q) {
          const __m128i lo = _mm_loadu_si128(entry(cbm, rows[q][g * M + m]));
          const __m512 c = widen(_mm256_zextsi128_si256(lo));
          RLX_UNROLL
          for (int b = 0; b < BT; ++b) acc[q][b] = _mm512_fmadd_ps(c, xv[b], acc[q][b]);
        }
      }
    }
    float sums[JT][BT];  // constant indices (see gather_rows_half8)
    RLX_UNROLL
    for (int q = 0; q < JT; ++q) {
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) sums[q][b] = lane_sum(acc[q][b]);
    }
    for (int q = 0; q < nj; ++q)
      for (int b = 0; b < BT; ++b) raw[b * raw_stride + j + q] = sums[q][b];
  }
}
#endif  // RLX_ISA_AVX512
#endif  // RLX_HALF_GATHER

}  // namespace

bool half_gather_supported(bool bf16) {
#ifdef RLX_HALF_GATHER
  return bf16 || rlx::cpu_has_f16c();
#else
  return false;
#endif
}

int64_t gather_forward_half_rows(const Dims& d, const float* x, const uint16_t* idx,
                                 const uint16_t* cb, bool bf16, float* raw) {
  BadIndex bad;
#ifdef RLX_HALF_GATHER
  if (d.rows == 0 || d.out_features == 0) return -1;
  gather_tiles(d, x, raw, cb, d.num_codebooks * d.num_entries * 8 * 2,
               [&](auto bt, auto jt, const float* xt, int64_t j0, int64_t j1, float* dst) {
                 constexpr int BT = decltype(bt)::value, JT = decltype(jt)::value;
                 const auto with_m = [&](auto fixed_m) {
                   constexpr int FM = decltype(fixed_m)::value;
#if RLX_ISA_AVX512
                   if constexpr (BT > 1) {
                     if (bf16)
                       gather_rows_half8_pairs<true, BT, JT, FM>(d, xt, idx, cb, j0, j1, dst,
                                                                 d.out_features, bad);
                     else
                       gather_rows_half8_pairs<false, BT, JT, FM>(d, xt, idx, cb, j0, j1, dst,
                                                                  d.out_features, bad);
                     return;
                   }
#endif
                   if (bf16)
                     gather_rows_half8<true, BT, JT, FM>(d, xt, idx, cb, j0, j1, dst,
                                                         d.out_features, bad);
                   else
                     gather_rows_half8<false, BT, JT, FM>(d, xt, idx, cb, j0, j1, dst,
                                                          d.out_features, bad);
                 };
                 using std::integral_constant;
                 if (d.num_codebooks == 1)
                   with_m(integral_constant<int, 1>{});
                 else if (d.num_codebooks == 2)
                   with_m(integral_constant<int, 2>{});
                 else
                   with_m(integral_constant<int, 0>{});
               });
#endif
  return bad.top.load();
}

#if !defined(RLX_ISA_AVX512_COPY)  // (the AVX-512 copy has the float16/bfloat16 forward only)
template <typename acc_t>
int64_t gather_forward_rows(const Dims& d, const acc_t* x, const uint16_t* idx, const acc_t* cb,
                            acc_t* raw) {
  BadIndex bad;
  gather_forward<acc_t>(d, x, idx, cb, raw, bad);
  return bad.top.load();
}

template <typename acc_t>
int64_t gather_backward_rows(const Dims& d, const acc_t* gs, const acc_t* x, const uint16_t* idx,
                             const acc_t* cb, acc_t* dx, acc_t* dc_parts, int64_t chunks) {
  BadIndex bad;
  gather_backward<acc_t>(d, gs, x, idx, cb, dx, dc_parts, chunks, bad);
  return bad.top.load();
}

#define RLX_INSTANTIATE_GATHER(acc_t)                                                         \
  template int64_t gather_forward_rows<acc_t>(const Dims&, const acc_t*, const uint16_t*,     \
                                              const acc_t*, acc_t*);                          \
  template int64_t gather_backward_rows<acc_t>(const Dims&, const acc_t*, const acc_t*,       \
                                               const uint16_t*, const acc_t*, acc_t*, acc_t*, \
                                               int64_t);
RLX_INSTANTIATE_GATHER(float)
RLX_INSTANTIATE_GATHER(double)
#endif

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY) && !defined(RLX_ISA_AVX512_COPY)
// The ops: host code, compiled once.
namespace rlx::codebook::cpu {
namespace {

const uint16_t* u16_data(const at::Tensor& contiguous_indices) {
  // int16 and uint16 share the bit pattern; reading uint16 is AQLM's "modulo 2^16".
  return static_cast<const uint16_t*>(contiguous_indices.const_data_ptr());
}

// Raises unless every index is < E (16-bit indices, before the dense path reads them).
void check_index_range_u16(const uint16_t* idx, int64_t n, const Dims& d) {
  if (d.num_entries >= 65536 || n == 0) return;
  std::atomic<int64_t> bad{-1};
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    uint16_t top = 0;
    for (int64_t i = begin; i < end; ++i) top = std::max(top, idx[i]);
    if (top < d.num_entries) return;
    int64_t cur = bad.load(std::memory_order_relaxed);
    while (top > cur && !bad.compare_exchange_weak(cur, top, std::memory_order_relaxed)) {
    }
  });
  raise_if_bad_index(bad.load(), d);
}

// raw for a float16/bfloat16 codebook read as it is (D = 8, float accumulation, the gather
// path's batch sizes, a CPU with F16C for float16); otherwise an undefined tensor, and the
// caller converts the codebook.
at::Tensor gather_raw_half(const Dims& d, const at::Tensor& x_acc, const uint16_t* ip,
                           const at::Tensor& codebook) {
  const at::ScalarType ct = codebook.scalar_type();
  const bool bf16 = ct == at::kBFloat16;
  if (x_acc.scalar_type() != at::kFloat || (ct != at::kHalf && !bf16) || d.entry_dim != 8 ||
      use_gather_dense(d) || !RLX_ISA_CALL_AVX512(half_gather_supported)(bf16))
    return {};
  auto raw = at::empty({d.rows, d.out_features}, x_acc.options());
  if (d.rows == 0 || d.out_features == 0) return raw;
  const auto cb = codebook.contiguous();
  raise_if_bad_index(
      RLX_ISA_CALL_AVX512(gather_forward_half_rows)(d, x_acc.const_data_ptr<float>(), ip,
                                             static_cast<const uint16_t*>(cb.const_data_ptr()),
                                             bf16, raw.data_ptr<float>()),
      d);
  return raw;
}

// raw[b, j] = sum_{g,m} x[b, g] . C[m, I[j,g,m]] in acc_t ([B, N], unscaled, no bias).
template <typename acc_t>
at::Tensor gather_raw(const Dims& d, const at::Tensor& x_acc, const uint16_t* ip,
                      const at::Tensor& idx, const CodebookAcc<acc_t>& C) {
  if (use_gather_dense(d)) {
    check_index_range_u16(ip, idx.numel(), d);
    return dense_raw<acc_t>(d, x_acc, ip, C.data());
  }
  auto raw = at::empty({d.rows, d.out_features}, x_acc.options());
  raise_if_bad_index(RLX_ISA_CALL(gather_forward_rows<acc_t>)(
                         d, x_acc.const_data_ptr<acc_t>(), ip, C.data(), raw.data_ptr<acc_t>()),
                     d);
  return raw;
}

// f(acc_t{}) for the accumulation type of x's dtype (float32 for float32 and the 16-bit
// types, float64 for float64): the host code runs on copies in acc_t, so the four input
// dtypes share two instantiations.
template <typename F>
void with_acc_type(at::ScalarType x_type, const F& f) {
  if (acc_dtype(x_type) == at::kDouble) {
    f(double{});
  } else {
    f(float{});
  }
}

}  // namespace

at::Tensor gather_forward_op(const at::Tensor& x, const at::Tensor& indices,
                             const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                             const std::optional<at::Tensor>& bias, const Dims& d) {
  auto out = at::empty(output_shape(x, d), x.options());
  if (out.numel() == 0) return out;
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  auto x_acc = x.reshape({d.rows, d.in_features}).to(acc).contiguous();
  auto idx = indices.contiguous();
  with_acc_type(x.scalar_type(), [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    at::Tensor raw = gather_raw_half(d, x_acc, u16_data(idx), codebook);
    if (!raw.defined()) {
      const CodebookAcc<acc_t> C(codebook, d, /*transposed=*/false);
      raw = gather_raw<acc_t>(d, x_acc, u16_data(idx), idx, C);
    }
    if (scales.has_value()) raw = raw * scales->to(acc);
    if (bias.has_value()) raw = raw + bias->to(acc);
    out.view({d.rows, d.out_features}).copy_(raw);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_backward_op(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask, const Dims& d) {
  const auto skipped = [&] { return at::empty({0}, x.options()); };
  const at::ScalarType acc = acc_dtype(x.scalar_type());
  auto g_acc = grad_out.reshape({d.rows, d.out_features}).to(acc).contiguous();
  auto x_acc = x.reshape({d.rows, d.in_features}).to(acc).contiguous();
  auto idx = indices.contiguous();
  const uint16_t* ip = u16_data(idx);
  at::Tensor dx = skipped(), dC = skipped(), ds = skipped(), db = skipped();
  if (mask[3]) db = g_acc.sum(0).to(x.scalar_type());
  with_acc_type(x.scalar_type(), [&](auto acc_zero) {
    using acc_t = decltype(acc_zero);
    if (mask[2]) {
      at::Tensor raw = gather_raw_half(d, x_acc, ip, codebook);
      if (!raw.defined())
        raw = gather_raw<acc_t>(d, x_acc, ip, idx, CodebookAcc<acc_t>(codebook, d, false));
      ds = (g_acc * raw).sum(0).to(x.scalar_type());
    }
    if (!mask[0] && !mask[1]) return;
    const CodebookAcc<acc_t> C(codebook, d, /*transposed=*/false);
    const at::Tensor gs = scales.has_value() ? (g_acc * scales->to(acc)).contiguous() : g_acc;
    const int64_t med = d.num_codebooks * d.num_entries * d.entry_dim;
    at::Tensor parts, dx_acc;
    if (use_gather_dense(d)) {
      check_index_range_u16(ip, idx.numel(), d);
      const int64_t gpb = std::max<int64_t>(1, ceil_div(d.groups, 16));
      if (mask[1]) parts = at::zeros({ceil_div(d.groups, gpb), med}, at::dtype(acc));
      if (mask[0]) dx_acc = at::zeros({d.rows, d.in_features}, at::dtype(acc));
      dense_backward<acc_t>(d, gs, x_acc, ip, C.data(), mask[0] ? &dx_acc : nullptr,
                            mask[1] ? parts.data_ptr<acc_t>() : nullptr, gpb);
    } else {
      const int64_t chunks = gather_backward_chunks(d, sizeof(acc_t), mask[1]);
      if (mask[1]) parts = at::zeros({chunks, med}, at::dtype(acc));
      if (mask[0]) dx_acc = at::empty({d.rows, d.in_features}, at::dtype(acc));
      raise_if_bad_index(RLX_ISA_CALL(gather_backward_rows<acc_t>)(
                             d, gs.const_data_ptr<acc_t>(), x_acc.const_data_ptr<acc_t>(), ip,
                             C.data(), mask[0] ? dx_acc.data_ptr<acc_t>() : nullptr,
                             mask[1] ? parts.data_ptr<acc_t>() : nullptr, chunks),
                         d);
    }
    if (mask[0]) dx = dx_acc.view(x.sizes()).to(x.scalar_type()).contiguous();
    if (mask[1]) {
      // Fixed-order reduction of the chunk partials.
      at::Tensor total = at::zeros({med}, at::dtype(acc));
      for (int64_t p = 0; p < parts.size(0); ++p) total.add_(parts[p]);
      dC = total.view(codebook.sizes()).to(codebook.scalar_type());
    }
  });
  return {dx, dC, ds, db};
}

}  // namespace rlx::codebook::cpu
#endif
