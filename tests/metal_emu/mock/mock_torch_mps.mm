// A mock of PyTorch's MPS stream for Linux: at::mps::MPSStream (ATen/mps/MPSStream.h) and
// torch::mps (torch/mps.h), over the mock Metal runtime (mock_metal.mm). As in PyTorch, the
// stream keeps one compute encoder open across kernels ("coalescing") until a sync or commit
// ends it. torch::mps::get_command_buffer() behaves as in torch 2.5-2.8 (it returns the
// command buffer with that encoder still open) or as from 2.9 (it ends the encoder first):
// rlx_mock_set_torch_mode(205 or 209). dispatch_sync runs the block at once on the calling
// thread; encoding on the stream outside a dispatch_sync on its queue, or a dispatch_sync
// from inside one (a deadlock on a serial queue), is a violation.
#include <ATen/mps/MPSStream.h>
#include <torch/mps.h>

#include <string>

#include "mock_runtime.h"

struct dispatch_queue_s {
  const char* label;
};

namespace {

dispatch_queue_s stream_queue{"rlx_mock.mps_stream"};
thread_local int on_stream_queue = 0;
int torch_mode = 209;
bool coalesced_open = false;  // the stream's _commandEncoder is set

void require_on_queue(const char* what) {
  if (!on_stream_queue)
    rlx_mock::violation(std::string(what) +
                        " outside dispatch_sync on the MPS stream's queue (PyTorch's encoder "
                        "state is guarded by that serial queue)");
}

}  // namespace

extern "C" void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block) {
  if (queue == nullptr) rlx_mock::violation("dispatch_sync on a null queue");
  if (queue == &stream_queue && on_stream_queue)
    rlx_mock::violation("dispatch_sync onto the serial queue it is already running on "
                        "(a deadlock)");
  struct Depth {
    bool mine;
    explicit Depth(bool m) : mine(m) { on_stream_queue += mine; }
    ~Depth() { on_stream_queue -= mine; }
  } depth(queue == &stream_queue);
  block();
}

namespace at::mps {

MPSStream::MPSStream(Stream stream) : _stream(stream) { _serialQueue = &stream_queue; }

MPSStream::~MPSStream() = default;

MPSCommandBuffer_t MPSStream::commandBuffer() {
  if (_commandBuffer == nil) _commandBuffer = [[MPSCommandBuffer alloc] init];
  return _commandBuffer;
}

MTLComputeCommandEncoder_t MPSStream::commandEncoder() {
  require_on_queue("MPSStream::commandEncoder()");
  if (_commandEncoder == nil) _commandEncoder = [[commandBuffer() computeCommandEncoder] retain];
  coalesced_open = true;
  return _commandEncoder;
}

void MPSStream::endKernelCoalescing() {
  if (_commandEncoder != nil) {
    [_commandEncoder endEncoding];
    [_commandEncoder release];
    _commandEncoder = nil;
  }
  coalesced_open = false;
}

void MPSStream::synchronize(SyncType syncType) {
  endKernelCoalescing();
  switch (syncType) {
    case SyncType::NONE: break;
    case SyncType::COMMIT:
    case SyncType::COMMIT_ADAPTIVE: commit(); break;
    case SyncType::COMMIT_AND_WAIT: commitAndWait(); break;
    case SyncType::COMMIT_AND_CONTINUE: commitAndContinue(); break;
  }
}

void MPSStream::commit() { flush(); }
void MPSStream::commitAndWait() { flush(); }  // dispatches already ran in the emulator
void MPSStream::commitAndContinue() { flush(); }

void MPSStream::flush() {
  if (_commandBuffer != nil) {
    [_commandBuffer commit];
    [_commandBuffer release];
    _commandBuffer = nil;
  }
}

MPSStream* getDefaultMPSStream() {
  static MPSStream* stream =
      new MPSStream(c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::MPS, 0), 0));
  return stream;
}

MPSStream* getCurrentMPSStream() { return getDefaultMPSStream(); }

MPSStream* MPSStreamImpl::getInstance() { return getDefaultMPSStream(); }

}  // namespace at::mps

namespace torch::mps {

bool is_available() { return true; }

// As PyTorch's MPS hooks: straight to the stream, without dispatch_sync (so PyTorch's own
// custom-kernel example may call commit() inside its block).
void synchronize() {
  at::mps::getDefaultMPSStream()->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
}

void commit() {
  rlx_mock::counters().user_commits++;
  at::mps::getDefaultMPSStream()->synchronize(at::mps::SyncType::COMMIT);
}

MTLCommandBuffer_t get_command_buffer() {
  at::mps::MPSStream* stream = at::mps::getDefaultMPSStream();
  if (torch_mode >= 209) stream->endKernelCoalescing();  // pytorch/pytorch#164093
  return stream->commandBuffer();
}

DispatchQueue_t get_dispatch_queue() { return at::mps::getDefaultMPSStream()->queue(); }

}  // namespace torch::mps

namespace rlx_mock {

void stream_pytorch_kernel() {
  dispatch_sync(torch::mps::get_dispatch_queue(), ^{
    @autoreleasepool {
      at::mps::getDefaultMPSStream()->commandEncoder();
    }
  });
}

void stream_synchronize() {  // PyTorch's copies to the CPU sync on the stream's queue
  dispatch_sync(torch::mps::get_dispatch_queue(), ^{
    at::mps::getDefaultMPSStream()->synchronize(at::mps::SyncType::COMMIT_AND_WAIT);
  });
}

}  // namespace rlx_mock

extern "C" void rlx_mock_drain_stale_pools();

extern "C" {

void rlx_mock_set_torch_mode(int mode) { torch_mode = mode; }

// Ends PyTorch's encoder and commits, then zeroes the counters (between tests), except
// autoreleased_without_pool, which counts since the library was loaded.
void rlx_mock_reset() {
  on_stream_queue = 0;
  rlx_mock_drain_stale_pools();
  try {
    rlx_mock::stream_synchronize();
  } catch (const std::exception&) {
  }
  const uint64_t orphans = rlx_mock::counters().autoreleased_without_pool;
  rlx_mock::counters() = rlx_mock::Counters{};
  rlx_mock::counters().autoreleased_without_pool = orphans;
}

// Whether PyTorch's coalesced encoder is open now.
int rlx_mock_coalescing_open() { return coalesced_open; }

// The pattern of PyTorch's custom-kernel example before torch 2.9: an encoder of our own on
// get_command_buffer(). Returns 0, or 1 with the error in `err`.
int rlx_mock_encode_on_own_encoder(char* err, size_t len) {
  try {
    dispatch_sync(torch::mps::get_dispatch_queue(), ^{
      @autoreleasepool {
        id<MTLCommandBuffer> cb = torch::mps::get_command_buffer();
        id<MTLComputeCommandEncoder> encoder = [cb computeCommandEncoder];
        [encoder endEncoding];
      }
    });
  } catch (const std::exception& e) {
    std::snprintf(err, len, "%s", e.what());
    return 1;
  }
  return 0;
}

// A PyTorch kernel on the stream (leaves the coalesced encoder open).
void rlx_mock_pytorch_kernel() { rlx_mock::stream_pytorch_kernel(); }
}
