// A mock of the Foundation and Metal objects the host code uses, for Linux (GNU Objective-C
// runtime). It enforces Apple's documented rules -- one active encoder per command buffer,
// endEncoding before commit, no use of an ended encoder, threadgroup memory lengths that are
// multiples of 16 bytes and at most 32 KiB in total, threads per threadgroup within the
// pipeline's maxTotalThreadsPerThreadgroup, buffer offsets inside their buffer, setBytes up to
// 4 KiB -- and runs each dispatch through the emulator (tests/metal_emu): the library's
// source goes to a compiler callback that host.py installs, which returns the emulator build.
// Objects are reference counted as without ARC; an object autoreleased while no pool is in
// place is counted (it would never be freed on a Mac).
#include "mock_runtime.h"

#include <Metal/Metal.h>
#include <MetalPerformanceShaders/MetalPerformanceShaders.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <unwind.h>

// clang gives Objective-C++ frames GNU's Objective-C personality when it targets the GNU
// runtime, and that one lets C++ exceptions (TORCH_CHECK, the violations below) terminate.
// Apple's handles them; so that the mock behaves alike, these frames use the C++ one (the
// library links with -Bsymbolic, so this definition wins inside it; no @try/@catch is used).
extern "C" _Unwind_Reason_Code __gxx_personality_v0(int, _Unwind_Action, _Unwind_Exception_Class,
                                                    _Unwind_Exception*, _Unwind_Context*);
extern "C" _Unwind_Reason_Code __gnu_objc_personality_v0(int version, _Unwind_Action actions,
                                                         _Unwind_Exception_Class cls,
                                                         _Unwind_Exception* e,
                                                         _Unwind_Context* ctx) {
  return __gxx_personality_v0(version, actions, cls, e, ctx);
}

extern "C" id class_createInstance(Class cls, size_t extra_bytes);
extern "C" id object_dispose(id object);
extern "C" void* object_getIndexedIvars(id object);

@interface NSAutoreleasePool : NSObject
- (void)drain;
@end

@interface RlxMockDevice : NSObject <MTLDevice>
@end
@interface RlxMockLibrary : NSObject <MTLLibrary>
@end
@interface RlxMockFunction : NSObject <MTLFunction>
@end
@interface RlxMockPipeline : NSObject <MTLComputePipelineState>
@end
@interface RlxMockBuffer : NSObject <MTLBuffer>
@end
@interface RlxMockEncoder : NSObject <MTLComputeCommandEncoder>
@end

namespace rlx_mock {
namespace {

// Every object carries this after its ivars (class_createInstance's extra bytes): a reference
// count and a C++ state owned by the object.
struct Slot {
  int refs;
  void* state;
  void (*destroy)(void*);
};
Slot* slot(id o) { return static_cast<Slot*>(object_getIndexedIvars(o)); }
template <class T>
T& st(id o) { return *static_cast<T*>(slot(o)->state); }
template <class T>
T& attach(id o, T* s) {
  slot(o)->state = s;
  slot(o)->destroy = [](void* p) { delete static_cast<T*>(p); };
  return *s;
}

thread_local std::vector<std::vector<id>> pools;
std::atomic<long> live_objects{0};
std::string last_violation;

// The emulator's launch entry and its argument (tests/metal_emu/include/metal_emu/runtime.h).
struct LaunchDesc {
  uint32_t threadgroups[3];
  uint32_t threads[3];
  uint32_t n_buffers;
  void* const* buffers;
  const uint64_t* buffer_bytes;
  uint32_t n_threadgroup_memory;
  const uint64_t* threadgroup_memory_bytes;
  int32_t order;
  uint64_t seed;
  double timeout_s;
  uint64_t max_steps;
};
using LaunchFn = int (*)(const char*, const LaunchDesc*, char*, size_t);
using CompileFn = int (*)(const char* source, int metal_version, char* out, size_t out_len);

struct Config {
  CompileFn compile = nullptr;
  int order = 0;
  uint64_t seed = 0;
  double timeout_s = 120;
  uint32_t max_threads = 1024;
  std::map<std::string, uint32_t> max_threads_of;
} config;

struct CompileRecord {
  uint64_t language_version = 0;
  int language_version_set = 0;
  long math_mode = 2;
  long fp_functions = 0;
  int libraries = 0;
} compile_record;

constexpr uint32_t kMaxBindings = 31;
constexpr uint64_t kMaxThreadgroupMemory = 32768;
constexpr uint64_t kMaxSetBytes = 4096;

struct Options {
  uint64_t language_version = 0;
  bool language_version_set = false;
  long math_mode = 2;     // MTLMathModeFast: the default
  long fp_functions = 0;  // MTLMathFloatingPointFunctionsFast: the default
};
struct Library {
  LaunchFn launch = nullptr;
  std::set<std::string> kernels;
};
struct Function {
  std::string name;
  LaunchFn launch = nullptr;
};
struct Pipeline {
  std::string name;
  LaunchFn launch = nullptr;
  // Read at each use, so that a test can lower it for pipelines the host code has cached.
  uint32_t max_threads() const {
    auto it = config.max_threads_of.find(name);
    return it != config.max_threads_of.end() ? it->second : config.max_threads;
  }
};
struct Buffer {
  void* contents = nullptr;
  size_t length = 0;
  void (*on_free)(void*) = nullptr;
  void* ctx = nullptr;
  ~Buffer() {
    if (on_free) on_free(ctx);
  }
};
struct CommandBuffer {
  id active = nil;  // the encoder between computeCommandEncoder and endEncoding (not retained)
  bool committed = false;
};
struct Binding {
  bool bound = false;
  char* base = nullptr;
  uint64_t length = 0;
  std::vector<unsigned char> bytes;  // setBytes copies
};
struct Encoder {
  id command_buffer = nil;  // retained
  bool ended = false;
  id pipeline = nil;  // retained
  Binding buffers[kMaxBindings];
  uint64_t threadgroup_memory[kMaxBindings] = {};
  ~Encoder() {
    if (pipeline) [pipeline release];
    if (command_buffer) [command_buffer release];
  }
};

id make_error(const std::string& message) {
  NSError* e = [[NSError alloc] init];
  attach(e, new std::string(message));
  return [e autorelease];
}

Encoder& live_encoder(id self, const char* what) {
  Encoder& e = st<Encoder>(self);
  if (e.ended) violation(std::string(what) + " on a compute encoder after its endEncoding");
  return e;
}

}  // namespace

[[noreturn]] void violation(const std::string& what) {
  last_violation = what;
  counters().violations++;
  throw std::runtime_error("Metal rule: " + what);
}

Counters& counters() {
  static Counters c;
  return c;
}

void* buffer_new(void* contents, size_t length, void (*on_free)(void*), void* ctx) {
  RlxMockBuffer* b = [[RlxMockBuffer alloc] init];
  Buffer& s = attach(b, new Buffer);
  s.contents = contents;
  s.length = length;
  s.on_free = on_free;
  s.ctx = ctx;
  return (__bridge void*)b;
}
void* buffer_contents(void* b) { return st<Buffer>((__bridge id)b).contents; }
size_t buffer_length(void* b) { return st<Buffer>((__bridge id)b).length; }
void buffer_release(void* b) { [(__bridge id)b release]; }

}  // namespace rlx_mock

using namespace rlx_mock;

@implementation NSObject
+ (instancetype)alloc {
  id o = class_createInstance(self, sizeof(Slot));
  *slot(o) = Slot{1, nullptr, nullptr};
  live_objects++;
  return o;
}
- (instancetype)init {
  return self;
}
- (instancetype)retain {
  slot(self)->refs++;
  return self;
}
- (oneway void)release {
  Slot* s = slot(self);
  if (s->refs <= 0) violation("release of a deallocated object");
  if (--s->refs > 0) return;
  if (s->destroy) s->destroy(s->state);
  live_objects--;
  object_dispose(self);
}
- (instancetype)autorelease {
  if (pools.empty())
    counters().autoreleased_without_pool++;  // no pool: on a Mac this object is never freed
  else
    pools.back().push_back(self);
  return self;
}
@end

@implementation NSAutoreleasePool
- (instancetype)init {
  pools.emplace_back();
  return self;
}
- (void)drain {
  if (pools.empty()) violation("drain of an autorelease pool that is not in place");
  std::vector<id> objects = std::move(pools.back());
  pools.pop_back();
  for (id o : objects) [o release];
  [self release];
}
@end

@implementation NSString
+ (instancetype)stringWithUTF8String:(const char*)text {
  NSString* s = [[self alloc] init];
  attach(s, new std::string(text));
  return [s autorelease];
}
- (const char*)UTF8String {
  return st<std::string>(self).c_str();
}
@end

@implementation NSError
- (NSString*)localizedDescription {
  return [NSString stringWithUTF8String:st<std::string>(self).c_str()];
}
@end

@implementation MTLCompileOptions
- (instancetype)init {
  attach(self, new Options);
  return self;
}
- (BOOL)fastMathEnabled {
  return st<Options>(self).math_mode == 2 ? YES : NO;
}
- (void)setFastMathEnabled:(BOOL)on {  // Apple: NO is MTLMathModeSafe, YES MTLMathModeFast
  st<Options>(self).math_mode = on ? 2 : 0;
}
- (MTLLanguageVersion)languageVersion {
  return MTLLanguageVersion(st<Options>(self).language_version);
}
- (void)setLanguageVersion:(MTLLanguageVersion)v {
  st<Options>(self).language_version = uint64_t(v);
  st<Options>(self).language_version_set = true;
}
- (MTLMathMode)mathMode {
  return MTLMathMode(st<Options>(self).math_mode);
}
- (void)setMathMode:(MTLMathMode)m {
  st<Options>(self).math_mode = long(m);
}
- (MTLMathFloatingPointFunctions)mathFloatingPointFunctions {
  return MTLMathFloatingPointFunctions(st<Options>(self).fp_functions);
}
- (void)setMathFloatingPointFunctions:(MTLMathFloatingPointFunctions)f {
  st<Options>(self).fp_functions = long(f);
}
@end

@implementation RlxMockDevice
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error {
  Options defaults;
  const Options& o = options != nil ? st<Options>(options) : defaults;
  // Without an explicit version Metal compiles with the newest one the system has.
  const uint64_t v = o.language_version_set ? o.language_version : (3 << 16) + 2;
  compile_record = {o.language_version, o.language_version_set, o.math_mode, o.fp_functions,
                    compile_record.libraries + 1};
  const int metal_version = int((v >> 16) * 100 + (v & 0xffff) * 10);
  if (config.compile == nullptr) violation("no emulator compiler installed (host.py does it)");
  std::vector<char> out(1 << 16);
  const int rc = config.compile([source UTF8String], metal_version, out.data(), out.size());
  std::istringstream lines(std::string(out.data()));
  if (rc != 0) {
    if (error) *error = make_error(out.data());
    return nil;
  }
  std::string path, name;
  std::getline(lines, path);
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    if (error) *error = make_error(std::string("dlopen: ") + dlerror());
    return nil;
  }
  RlxMockLibrary* lib = [[RlxMockLibrary alloc] init];
  Library& l = attach(lib, new Library);
  l.launch = reinterpret_cast<LaunchFn>(dlsym(handle, "rlx_emu_launch"));
  while (std::getline(lines, name))
    if (!name.empty()) l.kernels.insert(name);
  return lib;
}
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)function
                                                             error:(NSError**)error {
  if (function == nil) violation("newComputePipelineStateWithFunction: with a nil function");
  const Function& f = st<Function>(function);
  RlxMockPipeline* p = [[RlxMockPipeline alloc] init];
  Pipeline& s = attach(p, new Pipeline);
  s.name = f.name;
  s.launch = f.launch;
  return p;
}
@end

@implementation RlxMockLibrary
- (id<MTLFunction>)newFunctionWithName:(NSString*)name {
  const Library& l = st<Library>(self);
  if (!l.kernels.count([name UTF8String])) return nil;
  RlxMockFunction* f = [[RlxMockFunction alloc] init];
  Function& s = attach(f, new Function);
  s.name = [name UTF8String];
  s.launch = l.launch;
  return f;
}
@end

@implementation RlxMockFunction
@end

@implementation RlxMockPipeline
- (NSUInteger)maxTotalThreadsPerThreadgroup {
  return st<Pipeline>(self).max_threads();
}
@end

@implementation RlxMockBuffer
- (void*)contents {
  return st<Buffer>(self).contents;
}
- (NSUInteger)length {
  return st<Buffer>(self).length;
}
@end

@implementation MPSCommandBuffer
- (instancetype)init {
  attach(self, new CommandBuffer);
  return self;
}
- (id<MTLComputeCommandEncoder>)computeCommandEncoder {
  CommandBuffer& cb = st<CommandBuffer>(self);
  if (cb.committed) violation("computeCommandEncoder on a committed command buffer");
  if (cb.active != nil)
    violation("A command encoder is already encoding to this command buffer "
              "(computeCommandEncoder before the previous encoder's endEncoding)");
  RlxMockEncoder* enc = [[RlxMockEncoder alloc] init];
  Encoder& e = attach(enc, new Encoder);
  e.command_buffer = [self retain];
  cb.active = enc;
  counters().encoders_created++;
  return [enc autorelease];
}
- (void)commit {
  CommandBuffer& cb = st<CommandBuffer>(self);
  if (cb.committed) violation("commit of a command buffer that was already committed");
  if (cb.active != nil) violation("commit while a command encoder has not called endEncoding");
  cb.committed = true;
  counters().commits++;
}
@end

@implementation RlxMockEncoder
- (void)endEncoding {
  Encoder& e = live_encoder(self, "endEncoding");
  e.ended = true;
  st<CommandBuffer>(e.command_buffer).active = nil;
}
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state {
  Encoder& e = live_encoder(self, "setComputePipelineState:");
  if (state == nil) violation("setComputePipelineState: nil");
  [state retain];
  if (e.pipeline) [e.pipeline release];
  e.pipeline = state;
}
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index {
  Encoder& e = live_encoder(self, "setBuffer:offset:atIndex:");
  if (index >= kMaxBindings) violation("setBuffer: index " + std::to_string(index) + " >= 31");
  Binding& b = e.buffers[index];
  b = Binding{};
  if (buffer == nil) return;  // unbinds
  const Buffer& s = st<Buffer>(buffer);
  if (offset > s.length)
    violation("setBuffer: offset " + std::to_string(offset) + " past the end of a buffer of " +
              std::to_string(s.length) + " bytes (index " + std::to_string(index) + ")");
  b.bound = true;
  b.base = static_cast<char*>(s.contents) + offset;
  b.length = s.length - offset;
}
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index {
  Encoder& e = live_encoder(self, "setBytes:length:atIndex:");
  if (index >= kMaxBindings) violation("setBytes: index " + std::to_string(index) + " >= 31");
  if (length > kMaxSetBytes)
    violation("setBytes: " + std::to_string(length) + " bytes; Metal allows at most 4 KiB");
  Binding& b = e.buffers[index];
  b = Binding{};
  b.bound = true;
  b.bytes.assign(static_cast<const unsigned char*>(bytes),
                 static_cast<const unsigned char*>(bytes) + length);
  b.length = length;
}
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index {
  Encoder& e = live_encoder(self, "setThreadgroupMemoryLength:atIndex:");
  if (index >= kMaxBindings) violation("setThreadgroupMemoryLength: index >= 31");
  if (length % 16 != 0)
    violation("setThreadgroupMemoryLength: " + std::to_string(length) +
              " bytes is not a multiple of 16 (index " + std::to_string(index) + ")");
  if (length > kMaxThreadgroupMemory)
    violation("setThreadgroupMemoryLength: " + std::to_string(length) + " bytes > 32 KiB");
  e.threadgroup_memory[index] = length;
}
- (void)dispatchThreadgroups:(MTLSize)grid threadsPerThreadgroup:(MTLSize)threads {
  Encoder& e = live_encoder(self, "dispatchThreadgroups:threadsPerThreadgroup:");
  if (e.pipeline == nil) violation("dispatch without a compute pipeline state");
  const Pipeline& p = st<Pipeline>(e.pipeline);
  const uint64_t count = uint64_t(threads.width) * threads.height * threads.depth;
  if (count == 0 || grid.width * grid.height * grid.depth == 0)
    violation(p.name + ": dispatch of an empty grid or threadgroup");
  if (count > p.max_threads())
    violation(p.name + ": " + std::to_string(count) + " threads per threadgroup > the " +
              "pipeline's maxTotalThreadsPerThreadgroup " + std::to_string(p.max_threads()));
  uint64_t total = 0;
  uint32_t n_tg = 0;
  for (uint32_t i = 0; i < kMaxBindings; ++i) {
    total += e.threadgroup_memory[i];
    if (e.threadgroup_memory[i]) n_tg = i + 1;
  }
  if (total > kMaxThreadgroupMemory)
    violation(p.name + ": " + std::to_string(total) + " bytes of threadgroup memory > 32 KiB");
  void* ptrs[kMaxBindings] = {};
  uint64_t sizes[kMaxBindings] = {};
  uint32_t n = 0;
  for (uint32_t i = 0; i < kMaxBindings; ++i) {
    Binding& b = e.buffers[i];
    if (!b.bound) continue;
    ptrs[i] = b.bytes.empty() ? static_cast<void*>(b.base) : b.bytes.data();
    sizes[i] = b.length;
    n = i + 1;
  }
  LaunchDesc d{};
  d.threadgroups[0] = uint32_t(grid.width);
  d.threadgroups[1] = uint32_t(grid.height);
  d.threadgroups[2] = uint32_t(grid.depth);
  d.threads[0] = uint32_t(threads.width);
  d.threads[1] = uint32_t(threads.height);
  d.threads[2] = uint32_t(threads.depth);
  d.n_buffers = n;
  d.buffers = ptrs;
  d.buffer_bytes = sizes;
  d.n_threadgroup_memory = n_tg;
  d.threadgroup_memory_bytes = e.threadgroup_memory;
  d.order = config.order;
  d.seed = config.seed + counters().dispatches;
  d.timeout_s = config.timeout_s;
  char err[4096] = {0};
  counters().dispatches++;
  if (p.launch(p.name.c_str(), &d, err, sizeof(err)) != 0)
    throw std::runtime_error("emulator: " + std::string(err));
}
@end

id<MTLDevice> MTLCreateSystemDefaultDevice(void) {
  static RlxMockDevice* device = [[RlxMockDevice alloc] init];
  return [device retain];
}

extern "C" {

void rlx_mock_set_compiler(CompileFn fn) { config.compile = fn; }
void rlx_mock_configure(int order, uint64_t seed, double timeout_s) {
  config.order = order;
  config.seed = seed;
  config.timeout_s = timeout_s;
}
// maxTotalThreadsPerThreadgroup of every pipeline (kernel == "") or of one kernel's.
void rlx_mock_set_max_threads(const char* kernel, uint32_t n) {
  if (kernel == nullptr || !*kernel)
    config.max_threads = n;
  else
    config.max_threads_of[kernel] = n;
}
// Drains pools left in place by an exception thrown inside @autoreleasepool (between tests).
void rlx_mock_drain_stale_pools() {
  while (!pools.empty()) {
    std::vector<id> objects = std::move(pools.back());
    pools.pop_back();
    for (id o : objects) [o release];
  }
}
void rlx_mock_clear_max_threads() {
  config.max_threads = 1024;
  config.max_threads_of.clear();
}
void rlx_mock_compile_record(uint64_t* language_version, int* language_version_set,
                             long* math_mode, long* fp_functions, int* libraries) {
  *language_version = compile_record.language_version;
  *language_version_set = compile_record.language_version_set;
  *math_mode = compile_record.math_mode;
  *fp_functions = compile_record.fp_functions;
  *libraries = compile_record.libraries;
}
void rlx_mock_counters(uint64_t* out) {  // in the order of rlx_mock::Counters
  const Counters& c = counters();
  const uint64_t v[] = {c.commits, c.user_commits, c.dispatches, c.encoders_created,
                        c.autoreleased_without_pool, c.violations};
  std::memcpy(out, v, sizeof(v));
}
long rlx_mock_live_objects() { return live_objects.load(); }
void rlx_mock_last_violation(char* out, size_t len) {
  std::snprintf(out, len, "%s", last_violation.c_str());
}
}
