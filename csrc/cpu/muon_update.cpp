// The elementwise parts of a Muon step on CPU, fused (rlx_torch/optim/muon.py):
//   muon_ns_input: momentum buffer update, Nesterov look-ahead, per-matrix Frobenius norm and
//                  the normalized Newton–Schulz input, in two passes over each matrix (the
//                  second reads the matrix back from L2) instead of five passes over the
//                  whole batch through separate ops;
//   muon_apply_:   decoupled weight decay and the update, p <- (1 - lr wd) p - lr s O, in one
//                  pass that reads the bf16 (or float32) result of Newton–Schulz directly.
// float32 params only (the Python caller keeps the op-by-op path for other dtypes).
#include "cpu_kernel_deps.h"
#include "muon_kernels.h"

RLX_ISA_BEGIN

namespace rlx {
namespace RLX_ISA_NS {
namespace {

// torch.lerp's arithmetic (ATen's lerp): start + w (end - start) for |w| < 0.5, else
// end - (end - start)(1 - w), so the buffers match a foreach_lerp_ step for step. The branch
// is a template parameter so that the loops vectorize.
template <bool kSmall>
inline float lerp(float start, float end, float w) {
  return kSmall ? start + w * (end - start) : end - (end - start) * (1.0f - w);
}

// float -> bf16 bits, rounding to nearest even (NaN stays a quiet NaN), as c10::BFloat16
// does, written with integer operations so that the loop vectorizes.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
}

inline void store_as(float* dst, float x) { *dst = x; }
inline void store_as(at::BFloat16* dst, float x) {
  dst->x = bf16_bits(x);
}

// One matrix of n values: pass 1 updates the buffer and sums the squares of the update in
// double (8 lanes, then their sum, in a fixed order: reproducible; float32 squares would
// overflow from entries of about 1.8e19, although orthogonalization is scale-invariant);
// pass 2 writes the normalized update, rounded once to out_t. The scale 1/norm is applied in
// float32 unless it is below float32's normal range (a norm above about 8.5e37), then in
// double, so that no digits are lost.
// Element i = r * cols + c of a rows x cols matrix goes to x[i], or to x[c * rows + r] when
// `rows` > 0 (the transpose: Newton-Schulz iterates tall matrices in their wide form). The
// transpose goes through kTile x kTile tiles: values computed row by row (vectorized along
// c), then stored column by column, so both sides touch whole cache lines (element by element
// it ran at a third of the speed of the plain store).
constexpr int64_t kTile = 16;

// f(r0, nr, c0, nc) for the kTile x kTile tiles (short at the edges) of a rows x cols matrix.
template <typename F>
inline void for_each_tile(int64_t rows, int64_t cols, F f) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      f(r0, std::min(kTile, rows - r0), c0, std::min(kTile, cols - c0));
    }
  }
}

template <typename out_t, typename F>
inline void store_matrix(out_t* __restrict x, int64_t n, int64_t rows, F value) {
  if (rows <= 0) {
    for (int64_t i = 0; i < n; ++i) store_as(x + i, value(i));
    return;
  }
  const int64_t cols = n / rows;
  float tile[kTile][kTile];
  for_each_tile(rows, cols, [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    for (int64_t r = 0; r < nr; ++r) {
      for (int64_t c = 0; c < nc; ++c) tile[r][c] = value((r0 + r) * cols + c0 + c);
    }
    for (int64_t c = 0; c < nc; ++c) {
      out_t* dst = x + (c0 + c) * rows + r0;
      for (int64_t r = 0; r < nr; ++r) store_as(dst + r, tile[r][c]);
    }
  });
}

template <bool kSmallW, bool kSmallMomentum, bool kNesterov, typename out_t>
void ns_input_matrix(const float* __restrict g, float* __restrict b, int64_t n, float w,
                     float momentum, double eps, double safety, out_t* __restrict x,
                     int64_t rows) {
  auto update = [&](float gi, float bi) {
    return kNesterov ? lerp<kSmallMomentum>(gi, bi, momentum) : bi;
  };
  double lanes[8] = {};
  const int64_t n8 = n / 8 * 8;
  for (int64_t i0 = 0; i0 < n8; i0 += 8) {
    for (int64_t l = 0; l < 8; ++l) {
      const float nb = lerp<kSmallW>(b[i0 + l], g[i0 + l], w);
      b[i0 + l] = nb;
      const double u = update(g[i0 + l], nb);
      lanes[l] += u * u;
    }
  }
  for (int64_t i = n8; i < n; ++i) {
    b[i] = lerp<kSmallW>(b[i], g[i], w);
    const double u = update(g[i], b[i]);
    lanes[i - n8] += u * u;
  }
  double ss = 0;
  for (double s : lanes) ss += s;
  const double inv = 1.0 / std::max(std::sqrt(ss) * safety, eps);
  if (inv >= static_cast<double>(std::numeric_limits<float>::min())) {
    const float inv_f = static_cast<float>(inv);
    store_matrix(x, n, rows, [&](int64_t i) { return update(g[i], b[i]) * inv_f; });
  } else {
    store_matrix(x, n, rows, [&](int64_t i) {
      return static_cast<float>(static_cast<double>(update(g[i], b[i])) * inv);
    });
  }
}

}  // namespace

template <typename out_t>
void muon_ns_input_rows(const MatrixIndex& index, const float* const* grads,
                        float* const* bufs, float momentum, bool nesterov, double eps,
                        double safety, out_t* out, int64_t rows) {
  const float w = 1.0f - momentum;
  auto matrix = [&](const float* g, float* b, out_t* x) {
    const int64_t n = index.size;
    // w = 1 - mu with mu in [0, 1): at most one of w and mu is below 0.5 (neither at 0.5).
    const bool small_w = std::abs(w) < 0.5f, small_m = std::abs(momentum) < 0.5f;
    if (!nesterov) {  // mu's lerp is not used
      small_w ? ns_input_matrix<true, true, false>(g, b, n, w, momentum, eps, safety, x, rows)
              : ns_input_matrix<false, true, false>(g, b, n, w, momentum, eps, safety, x, rows);
    } else if (small_w) {  // the usual momentum, 0.5 < mu < 1
      ns_input_matrix<true, false, true>(g, b, n, w, momentum, eps, safety, x, rows);
    } else if (small_m) {
      ns_input_matrix<false, true, true>(g, b, n, w, momentum, eps, safety, x, rows);
    } else {
      ns_input_matrix<false, false, true>(g, b, n, w, momentum, eps, safety, x, rows);
    }
  };
  at::parallel_for(0, index.total(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t mat = begin; mat < end; ++mat) {
      const auto [t, offset] = index.locate(mat);
      matrix(grads[t] + offset, bufs[t] + offset, out + mat * index.size);
    }
  });
}
template void muon_ns_input_rows<float>(const MatrixIndex&, const float* const*,
                                        float* const*, float, bool, double, double, float*,
                                        int64_t);
template void muon_ns_input_rows<at::BFloat16>(const MatrixIndex&, const float* const*,
                                               float* const*, float, bool, double, double,
                                               at::BFloat16*, int64_t);

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace

template <typename in_t>
void muon_apply_rows(const MatrixIndex& index, float* const* params, const in_t* ortho,
                     float decay, float step, int64_t rows) {
  at::parallel_for(0, index.total(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t mat = begin; mat < end; ++mat) {
      const auto [t, offset] = index.locate(mat);
      float* p = params[t] + offset;
      const in_t* o = ortho + mat * index.size;
      if (rows <= 0) {
        for (int64_t i = 0; i < index.size; ++i) p[i] = decay * p[i] - step * to_float(o[i]);
        continue;
      }
      // o holds the matrix as its transpose: read in tiles, as store_matrix writes it.
      const int64_t cols = index.size / rows;
      float tile[kTile][kTile];
      for_each_tile(rows, cols, [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
        for (int64_t c = 0; c < nc; ++c) {
          const in_t* src = o + (c0 + c) * rows + r0;
          for (int64_t r = 0; r < nr; ++r) tile[r][c] = to_float(src[r]);
        }
        for (int64_t r = 0; r < nr; ++r) {
          float* pr = p + (r0 + r) * cols + c0;
          for (int64_t c = 0; c < nc; ++c) pr[c] = decay * pr[c] - step * tile[r][c];
        }
      });
    }
  });
}

template void muon_apply_rows<float>(const MatrixIndex&, float* const*, const float*, float,
                                     float, int64_t);
template void muon_apply_rows<at::BFloat16>(const MatrixIndex&, float* const*,
                                            const at::BFloat16*, float, float, int64_t);

}  // namespace RLX_ISA_NS
}  // namespace rlx
RLX_ISA_END

#if !defined(RLX_ISA_AVX2_COPY)
// The ops: host code, compiled once.
namespace rlx {
namespace {

void check_list(const char* op, const char* name, const at::TensorList& list,
                const at::TensorList& like, int64_t size) {
  TORCH_CHECK(list.size() == like.size(), op, ": ", name, " must hold ", like.size(),
              " tensors, got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), op,
                ": ", name, "[", i, "] must be a contiguous float32 CPU tensor, got ",
                t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (strided)");
    TORCH_CHECK(t.sizes() == like[i].sizes(), op, ": ", name, "[", i, "] must have shape ",
                like[i].sizes(), ", got ", t.sizes());
    TORCH_CHECK(size > 0 && t.numel() % size == 0, op, ": ", name, "[", i, "] (", t.numel(),
                " elements) is not a whole number of ", size, "-element matrices");
  }
}

template <typename T>
std::vector<T*> data_ptrs(const at::TensorList& list) {
  std::vector<T*> out;
  for (const at::Tensor& t : list) out.push_back(t.data_ptr<float>());
  return out;
}

at::Tensor muon_ns_input_cpu(at::TensorList grads, at::TensorList bufs, int64_t rows,
                             int64_t cols, double momentum, bool nesterov, double eps,
                             double safety, at::ScalarType dtype, bool transposed) {
  const char* op = "rlx::muon_ns_input";
  check_list(op, "grads", grads, grads, rows * cols);
  check_list(op, "bufs", bufs, grads, rows * cols);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16, got ", dtype);
  const MatrixIndex index(grads, rows * cols);
  at::Tensor out = transposed
                       ? at::empty({index.total(), cols, rows}, at::TensorOptions().dtype(dtype))
                       : at::empty({index.total(), rows, cols}, at::TensorOptions().dtype(dtype));
  const int64_t t_rows = transposed ? rows : 0;
  const std::vector<const float*> g = data_ptrs<const float>(grads);
  const std::vector<float*> b = data_ptrs<float>(bufs);
  if (dtype == at::kFloat) {
    RLX_ISA_CALL(muon_ns_input_rows<float>)(index, g.data(), b.data(),
                                            static_cast<float>(momentum), nesterov, eps, safety,
                                            out.data_ptr<float>(), t_rows);
  } else {
    RLX_ISA_CALL(muon_ns_input_rows<at::BFloat16>)(index, g.data(), b.data(),
                                                   static_cast<float>(momentum), nesterov, eps,
                                                   safety, out.data_ptr<at::BFloat16>(), t_rows);
  }
  return out;
}

void muon_apply_cpu(at::TensorList params, const at::Tensor& ortho, double lr,
                    double weight_decay, double scale) {
  const char* op = "rlx::muon_apply_";
  // A transposed view of a contiguous [N, cols, rows] is read as such (no copy).
  const bool transposed = ortho.dim() == 3 && !ortho.is_contiguous() &&
                          ortho.transpose(1, 2).is_contiguous();
  TORCH_CHECK(ortho.dim() == 3 && ortho.device().is_cpu() &&
                  (ortho.is_contiguous() || transposed) &&
                  (ortho.scalar_type() == at::kFloat || ortho.scalar_type() == at::kBFloat16),
              op, ": ortho must be a float32 or bfloat16 CPU tensor [N, rows, cols], contiguous "
              "or the transpose of a contiguous [N, cols, rows], got ", ortho.scalar_type(), " ",
              ortho.sizes(), " strides ", ortho.strides());
  const int64_t t_rows = transposed ? ortho.size(1) : 0;
  const int64_t size = ortho.size(1) * ortho.size(2);
  check_list(op, "params", params, params, size);
  const MatrixIndex index(params, size);
  TORCH_CHECK(index.total() == ortho.size(0), op, ": params hold ", index.total(),
              " matrices but ortho has ", ortho.size(0));
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float step = static_cast<float>(lr * scale);
  const std::vector<float*> p = data_ptrs<float>(params);
  if (ortho.scalar_type() == at::kFloat) {
    RLX_ISA_CALL(muon_apply_rows<float>)(index, p.data(), ortho.data_ptr<float>(), decay, step,
                                         t_rows);
  } else {
    RLX_ISA_CALL(muon_apply_rows<at::BFloat16>)(index, p.data(), ortho.data_ptr<at::BFloat16>(),
                                                decay, step, t_rows);
  }
}

}  // namespace
}  // namespace rlx

TORCH_LIBRARY_IMPL(rlx, CPU, m) {
  m.impl("muon_ns_input", &rlx::muon_ns_input_cpu);
  m.impl("muon_apply_", &rlx::muon_apply_cpu);
}
#endif
