// Host-side plumbing shared by every csrc/mps/*.mm (Objective-C++, macOS only):
// - buffer_of / byte_offset_of: the MTLBuffer behind an MPS tensor and the tensor's byte offset
//   inside it (views and slices bind at their own first element);
// - pipeline(): each embedded .metal source (tools/embed_metal.py) is compiled once into an
//   MTLLibrary, and each kernel's MTLComputePipelineState is cached, under one mutex;
// - encode(): encodes dispatches into PyTorch's own compute encoder on its MPS stream, inside
//   dispatch_sync on the stream's queue (see encode() for why not a command encoder of ours).
// Launch plans (grid, threadgroup size, params, threadgroup memory) come from the plain C++
// headers in csrc/include/rlx/mps_*_plan.h, which the Linux emulator tests run too.
#pragma once

#include <ATen/ATen.h>
#include <ATen/mps/MPSStream.h>

#include <Foundation/Foundation.h>
#include <Metal/Metal.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rlx/mps_kernels_embedded.h"
#include "rlx/mps_launch.h"

namespace rlx::mps {

// The storage's data pointer of an MPS tensor is its id<MTLBuffer>.
inline id<MTLBuffer> buffer_of(const at::Tensor& t) {
  return __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
}

inline NSUInteger byte_offset_of(const at::Tensor& t) {
  return static_cast<NSUInteger>(t.storage_offset() * t.element_size());
}

inline const char* embedded_source(const char* name) {
  for (const auto& s : embedded::kSources)
    if (std::strcmp(s.name, name) == 0) return s.text;
  return nullptr;
}

inline std::string describe(NSError* error) {
  return error != nil ? std::string([[error localizedDescription] UTF8String]) : "unknown error";
}

inline bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Options for compiling the embedded sources. The language version is explicit, so the
// `__METAL_VERSION__` paths the CI compiles (300, 310) are the ones a Mac runs: 3.1 (bfloat
// kernels) from macOS 14, 3.0 on macOS 13. Math: IEEE-conforming optimizations and precise
// exp/log/division, like the CPU reference. macOS 15 deprecates fastMathEnabled, and its
// default for the math functions is the fast variants, so there both new options are set.
// Returns a +1 object.
inline MTLCompileOptions* new_compile_options() {
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  if (@available(macOS 14.0, *)) {
    options.languageVersion = MTLLanguageVersion3_1;
  } else if (@available(macOS 13.0, *)) {
    options.languageVersion = MTLLanguageVersion3_0;
  } else {
#if !__has_feature(objc_arc)
    [options release];
#endif
    TORCH_CHECK(false, "rlx: the Metal kernels need macOS 13 or newer (Metal 3.0)");
  }
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
  } else {
    options.fastMathEnabled = NO;
  }
  return options;
}

// The pipeline of `kernel` (host name) in the embedded source `source` (file stem). The
// Objective-C temporaries (autoreleased strings, errors) are drained by a pool of our own:
// setup.py compiles without ARC and the caller may have no pool.
inline id<MTLComputePipelineState> pipeline(const char* source, const std::string& kernel) {
  static std::mutex mutex;
  static std::unordered_map<std::string, id<MTLLibrary>> libraries;
  static std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = std::string(source) + "/" + kernel;
  if (auto it = pipelines.find(key); it != pipelines.end()) return it->second;

  static id<MTLDevice> device = MTLCreateSystemDefaultDevice();
  TORCH_CHECK(device != nil, "rlx: no Metal device is available");
  std::string failure;
  id<MTLComputePipelineState> state = nil;
  @autoreleasepool {
    id<MTLLibrary> library = nil;
    if (auto it = libraries.find(source); it != libraries.end()) {
      library = it->second;
    } else if (const char* text = embedded_source(source); text == nullptr) {
      failure = std::string("rlx: no embedded Metal source named ") + source;
    } else {
      MTLCompileOptions* options = new_compile_options();
      NSError* error = nil;
      library = [device newLibraryWithSource:[NSString stringWithUTF8String:text]
                                     options:options
                                       error:&error];
#if !__has_feature(objc_arc)
      [options release];
#endif
      if (library == nil)
        failure = "rlx: compiling the Metal source " + std::string(source) +
                  ".metal failed: " + describe(error);
      else
        libraries.emplace(source, library);
    }
    if (library != nil) {
      id<MTLFunction> function =
          [library newFunctionWithName:[NSString stringWithUTF8String:kernel.c_str()]];
      if (function == nil) {
        // bfloat kernels are compiled only for Metal 3.1+ (`#if __METAL_VERSION__ >= 310`).
        failure = "rlx: Metal kernel " + kernel + " is missing from " + source + ".metal" +
                  (ends_with(kernel, "_bf16") ? "; bfloat16 needs Metal 3.1 (macOS 14 or newer)"
                                              : "");
      } else {
        NSError* error = nil;
        state = [device newComputePipelineStateWithFunction:function error:&error];
#if !__has_feature(objc_arc)
        [function release];
#endif
        if (state == nil)
          failure = "rlx: building the pipeline of " + kernel + " failed: " + describe(error);
      }
    }
  }
  TORCH_CHECK(state != nil, failure);
  pipelines.emplace(key, state);
  return state;
}

// The most threads per threadgroup `kernel`'s pipeline allows (at least 32 on Apple GPUs;
// lower than 1024 when the kernel needs many registers). Launch plans clamp to it.
inline uint32_t max_threads(const char* source, const std::string& kernel) {
  return uint32_t(pipeline(source, kernel).maxTotalThreadsPerThreadgroup);
}

// One dispatch: a plan, the tensors bound to [[buffer(i)]] slots, and the params bytes
// (bound with setBytes at launch.params_index).
struct Dispatch {
  Launch launch;
  std::vector<std::pair<int, at::Tensor>> buffers;
  std::vector<unsigned char> params;

  template <class Params>
  void set_params(const Params& p) {
    params.resize(sizeof(Params));
    std::memcpy(params.data(), &p, sizeof(Params));
  }
};

// Encodes the dispatches, in order, into the compute encoder of PyTorch's current MPS stream
// (a serial encoder: each dispatch sees the previous one's writes, and PyTorch's kernels
// before and after see ours, in stream order). Dispatches with an empty grid are skipped.
// Every bound tensor must be an MPS tensor.
//
// Why PyTorch's encoder: PyTorch keeps one compute encoder open across its own kernels
// ("kernel coalescing"). torch::mps::get_command_buffer() of torch 2.5-2.8 returns the
// command buffer with that encoder still open, and a second [computeCommandEncoder] on it
// fails Metal's "A command encoder is already encoding to this command buffer" assertion
// (torch 2.9 ends the encoder there). MPSStream::commandEncoder() returns the open encoder,
// or opens one, in every torch >= 2.5 (docs/macos.md lists what was checked), so we encode
// into it, as PyTorch's own kernels do. PyTorch ends it and commits the command buffer when
// it next needs to (a sync, a copy to the CPU, its commit policy): no endEncoding and no
// torch::mps::commit() here, which would also cost a command buffer per op.
inline void encode(const char* source, const std::vector<Dispatch>& dispatches) {
  struct Bound {
    id<MTLBuffer> buffer;
    NSUInteger offset;
    NSUInteger index;
  };
  struct Encoded {
    id<MTLComputePipelineState> state;
    const Dispatch* dispatch;
    std::vector<Bound> buffers;
  };
  std::vector<Encoded> work;
  for (const Dispatch& d : dispatches) {
    if (d.launch.threadgroups.count() == 0 || d.launch.threads.count() == 0) continue;
    Encoded e{pipeline(source, d.launch.kernel), &d, {}};
    TORCH_CHECK(d.launch.threads.count() <= e.state.maxTotalThreadsPerThreadgroup, "rlx: ",
                d.launch.kernel, " wants ", d.launch.threads.count(),
                " threads per threadgroup; its pipeline allows ",
                e.state.maxTotalThreadsPerThreadgroup);
    TORCH_CHECK(d.params.empty() || d.launch.params_index >= 0, "rlx: ", d.launch.kernel,
                " has params but no params_index");
    for (const auto& [index, tensor] : d.buffers) {
      TORCH_CHECK(tensor.is_mps(), "rlx: ", d.launch.kernel, " buffer ", index,
                  " must be an MPS tensor, got ", tensor.device());
      e.buffers.push_back({buffer_of(tensor), byte_offset_of(tensor), NSUInteger(index)});
    }
    work.push_back(std::move(e));
  }
  if (work.empty()) return;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  TORCH_CHECK(stream != nullptr, "rlx: PyTorch has no current MPS stream");
  const Encoded* items = work.data();
  const size_t n = work.size();
  dispatch_sync(stream->queue(), ^{
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      for (size_t i = 0; i < n; ++i) {
        const Encoded& e = items[i];
        const Launch& l = e.dispatch->launch;
        [encoder setComputePipelineState:e.state];
        for (const Bound& b : e.buffers)
          [encoder setBuffer:b.buffer offset:b.offset atIndex:b.index];
        if (!e.dispatch->params.empty())
          [encoder setBytes:e.dispatch->params.data()
                     length:e.dispatch->params.size()
                    atIndex:NSUInteger(l.params_index)];
        for (uint32_t t = 0; t < l.n_threadgroup_memory; ++t)
          [encoder setThreadgroupMemoryLength:l.threadgroup_memory[t] atIndex:t];
        [encoder dispatchThreadgroups:MTLSizeMake(l.threadgroups.x, l.threadgroups.y,
                                                  l.threadgroups.z)
                threadsPerThreadgroup:MTLSizeMake(l.threads.x, l.threads.y, l.threads.z)];
      }
    }
  });
}

}  // namespace rlx::mps
