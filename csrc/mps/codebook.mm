// MPS kernels for rlx::codebook_matmul and rlx::codebook_matmul_backward: validation (shared
// with the CPU backend), launch plans (rlx/mps_codebook_plan.h) and encoding (mps_common.h).
// The kernels are csrc/mps/kernels/codebook.metal. tests/test_metal_codebook_emulator.py runs
// the same plans and kernels on the CPU, step for step as here.
#include "mps_common.h"

#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "rlx/codebook.h"
#include "rlx/mps_codebook_plan.h"

namespace rlx::codebook {
namespace {

using rlx::mps::CodebookDtype;
using rlx::mps::CodebookPlan;
using rlx::mps::CodebookShape;
using rlx::mps::Dispatch;

constexpr const char* kSource = "codebook";
constexpr const char* kSortedSource = "codebook_sorted";

CodebookDtype metal_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return CodebookDtype::Float32;
    case at::kHalf: return CodebookDtype::Float16;
    case at::kBFloat16: return CodebookDtype::BFloat16;
    default:
      TORCH_CHECK_VALUE(false, "codebook_matmul on MPS supports float32, float16 and bfloat16, "
                        "got ", t);
  }
  return CodebookDtype::Float32;
}

// The kernels' view of the inputs: contiguous x [B, K], indices [N, G, M], codebook [M, E, D].
struct Inputs {
  at::Tensor x, indices, codebook;
  CodebookShape shape;
};

Inputs prepare(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& codebook,
               const Dims& d, bool has_scales, bool has_bias) {
  Inputs in;
  in.x = x.reshape({d.rows, d.in_features}).contiguous();
  in.indices = indices.reshape({d.out_features, d.groups, d.num_codebooks}).contiguous();
  in.codebook = codebook.reshape({d.num_codebooks, d.num_entries, d.entry_dim}).contiguous();
  CodebookShape& s = in.shape;
  s.rows = d.rows;
  s.in_features = d.in_features;
  s.out_features = d.out_features;
  s.groups = d.groups;
  s.num_codebooks = d.num_codebooks;
  s.num_entries = d.num_entries;
  s.entry_dim = d.entry_dim;
  s.has_scales = has_scales;
  s.has_bias = has_bias;
  s.dtype = metal_dtype(x.scalar_type());
  s.index_bytes = d.index_bytes;
  TORCH_CHECK_VALUE(rlx::mps::codebook_shape_fits(s), "codebook_matmul on MPS: sizes B=", d.rows,
                    ", K=", d.in_features, ", N=", d.out_features,
                    " exceed the kernels' 32-bit indexing");
  return in;
}

Dispatch make_dispatch(const CodebookPlan& plan,
                       std::vector<std::pair<int, at::Tensor>> buffers) {
  Dispatch d;
  d.launch = plan.launch;
  d.set_params(plan.params);
  d.buffers = std::move(buffers);
  return d;
}

// Empty tensors may have no MTLBuffer; the kernels never read them, but every declared buffer
// gets a valid binding.
const at::Tensor& or_dummy(const at::Tensor& t, const at::Tensor& dummy) {
  return t.numel() > 0 ? t : dummy;
}

// The smallest maxTotalThreadsPerThreadgroup of the two kernels a plan chooses from.
uint32_t max_threads(rlx::mps::CodebookKernels k) {
  return std::min(rlx::mps::max_threads(kSource, k.matvec),
                  rlx::mps::max_threads(kSource, k.tiled));
}

// A single-kernel plan, made again for its pipeline's maxTotalThreadsPerThreadgroup.
template <class MakePlan>
auto clamped(MakePlan make, const char* source = kSource) {
  const auto first = make(rlx::mps::kMaxThreadsPerThreadgroup);
  const uint32_t limit = rlx::mps::max_threads(source, first.launch.kernel);
  return limit >= first.launch.threads.count() ? first : make(limit);
}

Dispatch forward_dispatch(const Inputs& in, const std::optional<at::Tensor>& scales,
                          const std::optional<at::Tensor>& bias, const at::Tensor& out,
                          bool float_out) {
  const CodebookPlan plan = rlx::mps::plan_codebook_forward(
      in.shape, float_out,
      max_threads(rlx::mps::codebook_forward_kernels(in.shape, float_out)));
  const at::Tensor& dummy = in.codebook;
  const at::Tensor s = scales.has_value() && !float_out ? scales->contiguous() : dummy;
  const at::Tensor b = bias.has_value() && !float_out ? bias->contiguous() : dummy;
  return make_dispatch(plan, {{0, or_dummy(in.x, dummy)},
                              {1, in.indices},
                              {2, in.codebook},
                              {3, s},
                              {4, b},
                              {5, or_dummy(out, dummy)}});
}

// grad_codebook for 16-bit indices: keys m*E + code (M*E for a code >= E: never summed),
// sorted stably on the GPU with their positions (j*G + g)*M + m; see codebook_sorted.metal.
Dispatch sorted_dcodebook_dispatch(const Inputs& in, const at::Tensor& g2, const at::Tensor& s,
                                   const Dims& d, const at::Tensor& dc) {
  const auto codes = in.indices.view(at::kShort).to(at::kInt).bitwise_and(0xFFFF);
  const auto offsets = at::arange(d.num_codebooks, codes.options()).mul(d.num_entries);
  const auto keys = at::where(codes < d.num_entries, codes + offsets,
                              at::full({}, d.num_codebooks * d.num_entries, codes.options()))
                        .reshape({-1});
  const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor sorted_keys = std::get<0>(sorted).contiguous();
  const at::Tensor order = std::get<1>(sorted).to(at::kInt).contiguous();
  const rlx::mps::CodebookSortedPlan plan = clamped(
      [&](uint32_t limit) { return rlx::mps::plan_codebook_dcodebook_sorted(in.shape, limit); },
      kSortedSource);
  const at::Tensor& dummy = in.codebook;
  Dispatch dispatch;
  dispatch.launch = plan.launch;
  dispatch.set_params(plan.params);
  dispatch.buffers = {{0, or_dummy(g2, dummy)},          {1, or_dummy(in.x, dummy)},
                      {2, or_dummy(sorted_keys, dummy)}, {3, or_dummy(order, dummy)},
                      {4, s},                            {5, dc}};
  return dispatch;
}

at::Tensor forward_mps(const at::Tensor& x, const at::Tensor& indices,
                       const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
                       const std::optional<at::Tensor>& bias) {
  const Dims d = check_inputs(x, indices, codebook, scales, bias);
  const Inputs in = prepare(x, indices, codebook, d, scales.has_value(), bias.has_value());
  auto out = at::empty({d.rows, d.out_features}, x.options());
  if (out.numel() > 0) rlx::mps::encode(kSource, {forward_dispatch(in, scales, bias, out, false)});
  return out.view(output_shape(x, d));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_mps(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& indices,
    const at::Tensor& codebook, const std::optional<at::Tensor>& scales,
    std::array<bool, 4> mask) {
  const Dims d = check_backward_inputs(grad_out, x, indices, codebook, scales, mask);
  const Inputs in = prepare(x, indices, codebook, d, scales.has_value(), false);
  const at::Tensor& dummy = in.codebook;
  const auto g2 = grad_out.reshape({d.rows, d.out_features}).contiguous();
  const at::Tensor s = scales.has_value() ? scales->contiguous() : dummy;
  const auto skipped = at::empty({0}, x.options());
  at::Tensor dx = skipped, dc = skipped, ds = skipped, db = skipped;
  std::vector<Dispatch> work;

  if (mask[0]) {
    dx = at::empty({d.rows, d.in_features}, x.options());
    const uint32_t limit = max_threads(rlx::mps::codebook_dx_kernels(in.shape));
    work.push_back(make_dispatch(rlx::mps::plan_codebook_dx(in.shape, limit),
                                 {{0, or_dummy(g2, dummy)},
                                  {1, in.indices},
                                  {2, in.codebook},
                                  {3, s},
                                  {4, or_dummy(dx, dummy)}}));
  }
  std::vector<Dispatch> sorted_work;  // 16-bit grad_codebook: codebook_sorted.metal
  if (mask[1] && d.index_bytes == 2) {
    dc = at::empty({d.num_codebooks, d.num_entries, d.entry_dim}, x.options());
    sorted_work.push_back(sorted_dcodebook_dispatch(in, g2, s, d, dc));
  } else if (mask[1]) {
    const CodebookPlan partial = rlx::mps::plan_codebook_dcodebook_partial(in.shape);
    auto partials = at::empty({int64_t(rlx::mps::codebook_partials_count(partial))},
                              x.options().dtype(at::kFloat));
    dc = at::empty({d.num_codebooks, d.num_entries, d.entry_dim}, x.options());
    work.push_back(make_dispatch(partial, {{0, or_dummy(g2, dummy)},
                                           {1, or_dummy(in.x, dummy)},
                                           {2, in.indices},
                                           {3, s},
                                           {4, partials}}));
    work.push_back(make_dispatch(clamped([&](uint32_t limit) {
                                   return rlx::mps::plan_codebook_dcodebook_reduce(
                                       partial, in.shape.dtype, limit);
                                 }),
                                 {{0, partials}, {1, dc}}));
  }
  if (mask[2] || mask[3]) {
    at::Tensor y = dummy;
    if (mask[2]) {  // the unscaled product, recomputed in float32
      y = at::empty({d.rows, d.out_features}, x.options().dtype(at::kFloat));
      work.push_back(forward_dispatch(in, std::nullopt, std::nullopt, y, true));
    }
    if (mask[2]) ds = at::empty({d.out_features}, x.options());
    if (mask[3]) db = at::empty({d.out_features}, x.options());
    work.push_back(make_dispatch(
        clamped([&](uint32_t limit) {
          return rlx::mps::plan_codebook_dscale_dbias(in.shape, mask[2], mask[3], limit);
        }),
        {{0, or_dummy(g2, dummy)},
         {1, or_dummy(y, dummy)},
         {2, mask[2] ? or_dummy(ds, dummy) : dummy},
         {3, mask[3] ? or_dummy(db, dummy) : dummy}}));
  }
  rlx::mps::encode(kSource, work);
  if (!sorted_work.empty()) rlx::mps::encode(kSortedSource, sorted_work);
  if (mask[0]) dx = dx.view(x.sizes());
  if (mask[1]) dc = dc.view(codebook.sizes());
  return {dx, dc, ds, db};
}

}  // namespace
}  // namespace rlx::codebook

TORCH_LIBRARY_IMPL(rlx, MPS, m) {
  m.impl("codebook_matmul", &rlx::codebook::forward_mps);
  m.impl("codebook_matmul_backward", &rlx::codebook::backward_mps);
}
