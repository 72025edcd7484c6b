// A mock MPS device for Linux, so that the real host code (csrc/mps/*.mm) runs on MPS tensors:
// - storages live in host memory; an MPS storage's data pointer is a mock id<MTLBuffer> whose
//   contents are that memory, exactly what the host code's buffer_of() expects on a Mac;
// - every aten op without an MPS kernel (all of them here) goes to one boxed fallback: MPS
//   tensors become CPU tensors over the same memory, the CPU kernel runs, and results become
//   MPS tensors again (views keep their MPS storage, in-place results are the input itself);
// - like PyTorch's Metal kernels, such an op leaves the stream's coalesced compute encoder
//   open, and one that reads MPS data into CPU memory synchronizes the stream first;
// - a device guard for MPS (device count 1), which autograd and device guards need.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <cstring>
#include <utility>
#include <vector>

#include "mock_runtime.h"

namespace {

using Aliases = std::vector<std::pair<void*, c10::Storage>>;  // CPU data -> MPS storage

at::Tensor with_storage(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  at::Tensor t =
      at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                               like.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(),
                                                 like.storage_offset());
  return t;
}

void delete_storage(void* p) { delete static_cast<c10::Storage*>(p); }

// A CPU tensor over the memory of an MPS tensor (the same bytes, sizes, strides and offset).
at::Tensor cpu_alias(const at::Tensor& t, Aliases& aliases) {
  const c10::Storage& s = t.storage();
  void* buffer = s.data_ptr().get();
  void* contents = buffer != nullptr ? rlx_mock::buffer_contents(buffer) : nullptr;
  c10::DataPtr data(contents, new c10::Storage(s), &delete_storage, c10::Device(c10::kCPU));
  c10::Storage cpu(c10::Storage::use_byte_size_t(), s.nbytes(), std::move(data), nullptr, false);
  if (contents != nullptr) aliases.emplace_back(contents, s);
  return with_storage(std::move(cpu), c10::DispatchKey::CPU, t);
}

void release_buffer(void* b) { rlx_mock::buffer_release(b); }

// An MPS tensor over the memory of a CPU result: a view of an MPS input keeps that input's
// storage; anything else gets a new mock buffer that keeps the CPU storage alive.
at::Tensor mps_result(const at::Tensor& out, const Aliases& aliases) {
  const c10::Storage& s = out.storage();
  void* data = s.data_ptr().get();
  if (data != nullptr)
    for (const auto& [contents, mps] : aliases)
      if (contents == data) return with_storage(mps, c10::DispatchKey::MPS, out);
  c10::DataPtr ptr(nullptr, c10::Device(c10::kMPS, 0));
  if (data != nullptr) {
    void* buffer = rlx_mock::buffer_new(data, s.nbytes(), &delete_storage, new c10::Storage(s));
    ptr = c10::DataPtr(buffer, buffer, &release_buffer, c10::Device(c10::kMPS, 0));
  }
  c10::Storage mps(c10::Storage::use_byte_size_t(), s.nbytes(), std::move(ptr), nullptr, false);
  return with_storage(std::move(mps), c10::DispatchKey::MPS, out);
}

struct Scan {
  bool mps_input = false;
  bool mps_device_arg = false, other_device_arg = false;
  Aliases aliases;
};

bool is_write_alias(const c10::Argument& a) {
  return a.alias_info() != nullptr && a.alias_info()->isWrite();
}

c10::IValue to_cpu(const c10::IValue& v, Scan& scan) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return v;
    if (t.is_mps()) {
      scan.mps_input = true;
      return cpu_alias(t, scan.aliases);
    }
    return v;
  }
  if (v.isDevice()) {
    if (v.toDevice().is_mps()) {
      scan.mps_device_arg = true;
      return c10::IValue(c10::Device(c10::kCPU));
    }
    scan.other_device_arg = true;
    return v;
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const at::Tensor& t : v.toTensorList()) out.push_back(to_cpu(t, scan).toTensor());
    return out;
  }
  if (v.isList()) {
    const c10::List<c10::IValue> in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const c10::IValue& e : in) out.push_back(to_cpu(e, scan));
    return out;
  }
  return v;
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n_args = schema.arguments().size();
  const size_t first = stack->size() - n_args;
  std::vector<c10::IValue> originals(stack->begin() + first, stack->end());
  Scan scan;
  for (size_t i = first; i < stack->size(); ++i) (*stack)[i] = to_cpu((*stack)[i], scan);

  const std::string name = schema.name();
  bool view_only = !schema.returns().empty();
  for (const c10::Argument& r : schema.returns())
    view_only = view_only && r.alias_info() != nullptr && !r.alias_info()->isWrite();
  const bool factory = name.rfind("aten::empty", 0) == 0;
  const bool results_on_mps =
      scan.mps_device_arg || (!scan.other_device_arg && scan.mps_input);
  bool host_result = false;  // a Scalar, bool, ... computed from device data
  for (const c10::Argument& r : schema.returns()) {
    const c10::TypeKind k = r.type()->kind();
    host_result = host_result || (k != c10::TypeKind::TensorType &&
                                  k != c10::TypeKind::ListType &&
                                  k != c10::TypeKind::OptionalType);
  }
  bool writes_cpu = false;  // copy_ into a CPU tensor, out= on the CPU
  for (size_t a = 0; a < n_args; ++a)
    writes_cpu = writes_cpu || (is_write_alias(schema.arguments()[a]) && originals[a].isTensor() &&
                                originals[a].toTensor().defined() &&
                                originals[a].toTensor().device().is_cpu());
  if (scan.mps_input && (!results_on_mps || host_result || writes_cpu))
    rlx_mock::stream_synchronize();  // MPS data read into CPU memory: PyTorch syncs
  else if ((scan.mps_input || results_on_mps) && !view_only && !factory)
    rlx_mock::stream_pytorch_kernel();

  op.callBoxed(stack);

  const size_t n_ret = schema.returns().size();
  const size_t ret0 = stack->size() - n_ret;
  for (size_t r = 0; r < n_ret; ++r) {
    c10::IValue& v = (*stack)[ret0 + r];
    const c10::Argument& ret = schema.returns()[r];
    if (is_write_alias(ret)) {  // in place or out=: the very argument
      for (size_t a = 0; a < n_args; ++a) {
        const c10::Argument& arg = schema.arguments()[a];
        if (is_write_alias(arg) && arg.alias_info()->beforeSets() == ret.alias_info()->beforeSets())
          v = originals[a];
      }
      continue;
    }
    auto convert = [&](const at::Tensor& t) -> at::Tensor {
      if (!t.defined() || !t.device().is_cpu()) return t;
      if (ret.alias_info() != nullptr) {  // a view: of an MPS input, or of a CPU one
        void* data = t.storage().data_ptr().get();
        for (const auto& [contents, mps] : scan.aliases)
          if (data != nullptr && contents == data) return mps_result(t, scan.aliases);
        return t;
      }
      return results_on_mps ? mps_result(t, scan.aliases) : t;
    };
    if (v.isTensor()) {
      v = convert(v.toTensor());
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : v.toTensorList()) out.push_back(convert(t));
      v = out;
    }
  }
}

struct MockMPSGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::MPS; }
  c10::Device exchangeDevice(c10::Device) const override { return {c10::DeviceType::MPS, 0}; }
  c10::Device getDevice() const override { return {c10::DeviceType::MPS, 0}; }
  void setDevice(c10::Device) const override {}
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }
  c10::Stream exchangeStream(c10::Stream s) const override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};

}  // namespace

C10_REGISTER_GUARD_IMPL(MPS, MockMPSGuard);

TORCH_LIBRARY_IMPL(_, MPS, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// Composite-explicit aten kernels (copy_, _to_copy, ...) would otherwise run for MPS and
// reach CPU-only dispatch stubs: give every aten op that does not decompose (no
// CompositeImplicitAutograd kernel) and has no MPS kernel the fallback as its MPS kernel.
extern "C" int rlx_mock_install_backend() {
  static torch::Library* lib = nullptr;
  if (lib != nullptr) return 0;
  lib = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::MPS, __FILE__,
                           __LINE__);
  int n = 0;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::MPS))
      continue;
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional))
      continue;
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    lib->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    ++n;
  }
  return n;
}
