// Shared declarations of the mock Metal runtime (mock_metal.mm), the mock of PyTorch's MPS
// stream (mock_torch_mps.mm) and the mock MPS tensor backend (mock_mps_backend.cpp). Linux
// test builds only: tests/metal_emu/host.py compiles them with csrc/mps/*.mm into one library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace rlx_mock {

// A broken rule of Apple's Metal API (Metal's validation layer or driver would assert or
// abort there): recorded, then thrown as std::runtime_error("Metal rule: ...").
[[noreturn]] void violation(const std::string& what);

// Buffers as opaque handles (id<MTLBuffer>) for the C++ side.
void* buffer_new(void* contents, size_t length, void (*on_free)(void*), void* ctx);
void* buffer_contents(void* buffer);
size_t buffer_length(void* buffer);
void buffer_release(void* buffer);

// PyTorch's stream, as the mock backend's "PyTorch kernels" use it.
void stream_pytorch_kernel();  // leaves PyTorch's coalesced encoder open, as its kernels do
void stream_synchronize();     // a copy to the CPU: end the encoder, commit and wait

struct Counters {
  uint64_t commits = 0;              // command buffers committed
  uint64_t user_commits = 0;         // torch::mps::commit() calls
  uint64_t dispatches = 0;           // dispatchThreadgroups through the emulator
  uint64_t encoders_created = 0;     // computeCommandEncoder calls that succeeded
  uint64_t autoreleased_without_pool = 0;
  uint64_t violations = 0;
};
Counters& counters();

}  // namespace rlx_mock
