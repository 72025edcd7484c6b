// Glue between a translated kernel function and the launcher: builds each kernel argument from
// its [[buffer(i)]] / [[threadgroup(i)]] / built-in attribute (recorded by translate.py) and the
// C type of the parameter, then calls the kernel once per emulated thread.
#pragma once

#include <tuple>
#include <utility>

#include "metal_stdlib.h"

namespace metal_emu {

enum class Builtin : int {
  thread_position_in_grid,
  thread_position_in_threadgroup,
  threadgroup_position_in_grid,
  threads_per_threadgroup,
  threadgroups_per_grid,
  threads_per_grid,
  thread_index_in_threadgroup,
  thread_index_in_simdgroup,
  simdgroup_index_in_threadgroup,
  threads_per_simdgroup,
  simdgroups_per_threadgroup,
  thread_execution_width,
  dispatch_threads_per_threadgroup,
};

enum class BindKind : int { Buffer, Threadgroup, Builtin };

struct Binding {
  BindKind kind;
  int index;  // buffer / threadgroup slot, or a Builtin
  const char* label;
};

template <class T>
struct is_ptr : std::false_type {};
template <class T>
struct is_ptr<metal::Ptr<T>> : std::true_type {};

inline metal::uint3 builtin_value(const Runtime& rt, Builtin b) {
  const uint32_t t = uint32_t(rt.current);
  const uint32_t* tg = rt.launch->threads;
  const uint32_t* ng = rt.launch->threadgroups;
  const metal::uint3 local(t % tg[0], (t / tg[0]) % tg[1], t / (tg[0] * tg[1]));
  const uint32_t n = tg[0] * tg[1] * tg[2];
  switch (b) {
    case Builtin::thread_position_in_grid:
      return metal::uint3(rt.tg_pos[0] * tg[0] + local.x, rt.tg_pos[1] * tg[1] + local.y,
                          rt.tg_pos[2] * tg[2] + local.z);
    case Builtin::thread_position_in_threadgroup: return local;
    case Builtin::threadgroup_position_in_grid:
      return metal::uint3(rt.tg_pos[0], rt.tg_pos[1], rt.tg_pos[2]);
    case Builtin::threads_per_threadgroup:
    case Builtin::dispatch_threads_per_threadgroup: return metal::uint3(tg[0], tg[1], tg[2]);
    case Builtin::threadgroups_per_grid: return metal::uint3(ng[0], ng[1], ng[2]);
    case Builtin::threads_per_grid:
      return metal::uint3(ng[0] * tg[0], ng[1] * tg[1], ng[2] * tg[2]);
    case Builtin::thread_index_in_threadgroup: return metal::uint3(t, 0, 0);
    case Builtin::thread_index_in_simdgroup: return metal::uint3(t % kSimdWidth, 0, 0);
    case Builtin::simdgroup_index_in_threadgroup: return metal::uint3(t / kSimdWidth, 0, 0);
    case Builtin::threads_per_simdgroup:
    case Builtin::thread_execution_width: return metal::uint3(kSimdWidth, 0, 0);
    case Builtin::simdgroups_per_threadgroup:
      return metal::uint3((n + kSimdWidth - 1) / kSimdWidth, 0, 0);
  }
  return metal::uint3(0u);
}

inline void* bound_memory(Runtime& rt, const Binding& b, int64_t& bytes) {
  if (b.kind == BindKind::Buffer) {
    if (b.index < 0 || uint32_t(b.index) >= rt.launch->n_buffers ||
        rt.launch->buffers[b.index] == nullptr)
      fail(std::string("buffer(") + std::to_string(b.index) + ") for parameter '" + b.label +
           "' is not bound");
    bytes = int64_t(rt.launch->buffer_bytes[b.index]);
    return rt.launch->buffers[b.index];
  }
  if (b.index < 0 || size_t(b.index) >= rt.tg_memory.size() || rt.tg_memory[b.index].empty())
    fail(std::string("threadgroup(") + std::to_string(b.index) + ") memory for parameter '" +
         b.label + "' is not set (or has size 0)");
  bytes = int64_t(rt.tg_memory[b.index].size());
  return rt.tg_memory[b.index].data();
}

template <class P>
P make_arg(Runtime& rt, const Binding& b) {
  using V = std::remove_cvref_t<P>;
  if constexpr (is_ptr<V>::value) {
    if (b.kind == BindKind::Builtin) fail(std::string("parameter '") + b.label + "' is a pointer");
    int64_t bytes = 0;
    void* mem = bound_memory(rt, b, bytes);
    return V(mem, bytes, b.label);
  } else if constexpr (std::is_reference_v<P>) {
    if (b.kind == BindKind::Builtin) fail(std::string("parameter '") + b.label + "' is a reference");
    int64_t bytes = 0;
    void* mem = bound_memory(rt, b, bytes);
    if (bytes < int64_t(sizeof(V)))
      fail(std::string("buffer for parameter '") + b.label + "' holds " + std::to_string(bytes) +
           " bytes, the kernel reads " + std::to_string(sizeof(V)));
    return *static_cast<V*>(mem);
  } else {
    if (b.kind != BindKind::Builtin)
      fail(std::string("parameter '") + b.label + "' is passed by value but bound to memory");
    const metal::uint3 v = builtin_value(rt, Builtin(b.index));
    if constexpr (metal::is_vec<V>::value) {
      V r;
      for (int i = 0; i < int(sizeof(V) / sizeof(r[0])) && i < 3; ++i) r[i] = std::remove_cvref_t<decltype(r[0])>(v[i]);
      return r;
    } else {
      return V(v.x);
    }
  }
}

template <class... P, size_t... I>
void invoke_impl(void (*fn)(P...), Runtime& rt, const Binding* b, std::index_sequence<I...>) {
  fn(make_arg<P>(rt, b[I])...);
}

template <class... P>
void invoke(void (*fn)(P...), Runtime& rt, const Binding* b) {
  invoke_impl(fn, rt, b, std::index_sequence_for<P...>{});
}

struct KernelEntry {
  const char* name;
  KernelBody body;
};

}  // namespace metal_emu
