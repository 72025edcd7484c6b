// Kernels that exercise the emulator itself: correct ones, and ones with planted bugs that the
// emulator must catch (tests/test_metal_emulator.py). Not part of the library.
#include <metal_stdlib>
using namespace metal;

struct CountParams {
  uint n;
  float scale;
};

// out[g] = reversed copy of x within each threadgroup, through threadgroup memory.
kernel void tg_reverse(device const float* x [[buffer(0)]],
                       device float* out [[buffer(1)]],
                       threadgroup float* tile [[threadgroup(0)]],
                       uint gid [[thread_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint n [[threads_per_threadgroup]]) {
  tile[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tile[n - 1 - tid];
}

// Planted bug: the barrier between the write and the read is missing.
kernel void tg_reverse_no_barrier(device const float* x [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  threadgroup float* tile [[threadgroup(0)]],
                                  uint gid [[thread_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint n [[threads_per_threadgroup]]) {
  tile[tid] = x[gid];
  out[gid] = tile[n - 1 - tid];
}

// Planted bug: a tree reduction whose second barrier (inside the loop) is missing, so a
// thread may read a partial sum before its producer has written it.
kernel void tree_sum_missing_barrier(device const float* x [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     threadgroup float* tile [[threadgroup(0)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint n [[threads_per_threadgroup]]) {
  tile[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (tid < stride) tile[tid] += tile[tid + stride];
  }
  if (tid == 0) out[0] = tile[0];
}

kernel void tree_sum(device const float* x [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     threadgroup float* tile [[threadgroup(0)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint n [[threads_per_threadgroup]]) {
  tile[tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = n / 2; stride > 0; stride /= 2) {
    if (tid < stride) tile[tid] += tile[tid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) out[0] = tile[0];
}

// Planted bug: only half of the threads reach the barrier.
kernel void divergent_barrier(device float* out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]]) {
  if (tid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// Planted bug: the two halves wait at two different barriers.
kernel void two_barriers(device float* out [[buffer(0)]],
                         uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[tid] = 1.0f;
}

// Planted bug: reads one element past the end for the last thread.
kernel void neighbour_diff(device const float* x [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  out[gid] = x[gid + 1] - x[gid];
}

// Planted bug: lanes 0..15 do a simd_sum while the other lanes go to a threadgroup barrier.
kernel void divergent_simd(device float* out [[buffer(0)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  float v = 1.0f;
  if (lane < 16) v = simd_sum(v);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = v;
}

// Simdgroup collectives; works for partial simdgroups (threads not a multiple of 32).
kernel void simd_ops(device const float* x [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const float v = x[tid];
  out[8 * tid + 0] = simd_sum(v);
  out[8 * tid + 1] = simd_max(v);
  out[8 * tid + 2] = simd_prefix_exclusive_sum(v);
  out[8 * tid + 3] = simd_prefix_inclusive_sum(v);
  out[8 * tid + 4] = simd_shuffle_down(v, 1);
  out[8 * tid + 5] = simd_broadcast(v, 0);
  out[8 * tid + 6] = simd_shuffle_xor(v, 1);
  out[8 * tid + 7] = float(simd_sum(float4(v, 1.0f, 2.0f, v)).w);
}

// Reads lane 31, which does not exist in a partial simdgroup (undefined: poison).
kernel void shuffle_inactive(device float* out [[buffer(0)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = simd_shuffle(float(tid), 31);
}

// Histogram with device atomics, scaled sums with a float atomic.
kernel void histogram(device const uint* keys [[buffer(0)]],
                      device atomic_uint* counts [[buffer(1)]],
                      device atomic_float* total [[buffer(2)]],
                      constant CountParams& p [[buffer(3)]],
                      uint gid [[thread_position_in_grid]]) {
  if (gid >= p.n) return;
  atomic_fetch_add_explicit(&counts[keys[gid]], 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(total, p.scale, memory_order_relaxed);
}

// Conversions: y16 = T(x) for half / bfloat, then back to float.
template <typename T>
kernel void round_trip(device const float* x [[buffer(0)]],
                       device T* y [[buffer(1)]],
                       device float* back [[buffer(2)]],
                       uint gid [[thread_position_in_grid]]) {
  const T h = T(x[gid]);
  y[gid] = h;
  back[gid] = float(h);
}
template [[host_name("round_trip_half")]] kernel void round_trip<half>(
    device const float*, device half*, device float*, uint);
template [[host_name("round_trip_bfloat")]] kernel void round_trip<bfloat>(
    device const float*, device bfloat*, device float*, uint);

// Half arithmetic rounds after every operation: a*b+c in half vs float differ.
kernel void half_madd(device const half* a [[buffer(0)]],
                      device const half* b [[buffer(1)]],
                      device half* out [[buffer(2)]],
                      uint gid [[thread_position_in_grid]]) {
  const half prod = a[gid] * b[gid];
  out[gid] = prod + 1.0h;
}

// Every built-in position, for a 3-D grid.
kernel void positions(device uint* out [[buffer(0)]],
                      uint3 gpos [[thread_position_in_grid]],
                      uint3 lpos [[thread_position_in_threadgroup]],
                      uint3 tgpos [[threadgroup_position_in_grid]],
                      uint3 ntg [[threadgroups_per_grid]],
                      uint3 tpg [[threads_per_grid]],
                      uint index [[thread_index_in_threadgroup]],
                      ushort sg [[simdgroup_index_in_threadgroup]]) {
  const uint linear = (gpos.z * tpg.y + gpos.y) * tpg.x + gpos.x;
  device uint* o = out + 8 * linear;
  o[0] = gpos.x;
  o[1] = gpos.y;
  o[2] = gpos.z;
  o[3] = lpos.x + 100 * lpos.y + 10000 * lpos.z;
  o[4] = tgpos.x + 100 * tgpos.y + 10000 * tgpos.z;
  o[5] = ntg.x + 100 * ntg.y + 10000 * ntg.z;
  o[6] = index;
  o[7] = sg;
}

// Reads a threadgroup allocation the host made too small.
kernel void uses_tg_memory(device float* out [[buffer(0)]],
                           threadgroup float* scratch [[threadgroup(0)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  scratch[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = scratch[tid];
}

// Sums each row of x (rows x threads) through one simd_sum per simdgroup whose results meet in
// threadgroup memory; lane 0 of every simdgroup writes its view of the row total to
// out[row * simdgroups + sg]. With kSecondBarrier false (planted bug), a simdgroup that runs
// ahead overwrites partial[] with the next row's sum while others still read the current one.
template <bool kSecondBarrier>
kernel void simd_row_sums(device const float* x [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          constant uint& rows [[buffer(2)]],
                          threadgroup float* partial [[threadgroup(0)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint n [[threads_per_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint nsg [[simdgroups_per_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  for (uint r = 0; r < rows; ++r) {
    const float s = simd_sum(x[r * n + tid]);
    if (lane == 0) partial[sg] = s;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint m = 0; m < nsg; ++m) total += partial[m];
    if (lane == 0) out[r * nsg + sg] = total;
    if (kSecondBarrier) threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
template [[host_name("simd_row_sums")]] kernel void simd_row_sums<true>(
    device const float*, device float*, constant uint&, threadgroup float*, uint, uint, uint,
    uint, uint);
template [[host_name("simd_row_sums_missing_barrier")]] kernel void simd_row_sums<false>(
    device const float*, device float*, constant uint&, threadgroup float*, uint, uint, uint,
    uint, uint);

// Which thread ran when: a ticket before and after one simd_sum. A simdgroup's collective
// waits only for its own lanes, so (in forward order) simdgroup 0 takes both tickets before
// simdgroup 1 takes its first.
kernel void simd_tickets(device atomic_uint* counter [[buffer(0)]],
                         device uint* tickets [[buffer(1)]],
                         uint tid [[thread_index_in_threadgroup]]) {
  tickets[2 * tid] = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  (void)simd_sum(1u);
  tickets[2 * tid + 1] = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
}

// Planted bug: i only takes even values, so `i != 7` never ends the loop (no barrier, no
// simd call, no memory access inside it).
kernel void spin_forever(device float* out [[buffer(0)]],
                         uint tid [[thread_index_in_threadgroup]]) {
  float acc = 0.0f;
  for (uint i = 0; i != 7; i += 2) acc += 1.0f;
  out[tid] = acc;
}

// Planted bug: thread 0 spin-waits on a flag that thread 1 only sets after a barrier thread
// 0 never reaches (a GPU hang; a threadgroup has no forward-progress guarantee).
kernel void spin_wait(device atomic_uint* flag [[buffer(0)]],
                      uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) {
    while (atomic_load_explicit(flag, memory_order_relaxed) == 0u) {
    }
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_store_explicit(flag, 1u, memory_order_relaxed);
}

// Loops inside a constexpr helper evaluated at compile time must still compile (the watchdog's
// tick is a no-op in constant evaluation); bounded loops of every kind run normally.
constexpr uint ceil_log2(uint n) {
  uint r = 0;
  while ((1u << r) < n) ++r;
  return r;
}
constant constexpr uint kLog2Of40 = ceil_log2(40);

kernel void bounded_loops(device uint* out [[buffer(0)]],
                          uint tid [[thread_index_in_threadgroup]]) {
  uint a = 0, b = 0;
  for (;;) {
    if (++a == tid + 3) break;
  }
  do {
    b += 2;
  } while (b < tid);
  out[3 * tid] = a;
  out[3 * tid + 1] = b;
  out[3 * tid + 2] = kLog2Of40 + ceil_log2(tid + 1);
}

// Vector swizzles (read, write, compound assignment, through a pointer), component-wise
// comparisons with all / any / select, and vector clamp / mix / fma. Eight floats per thread.
template <typename T>
kernel void vector_ops(device const float4* x [[buffer(0)]],
                       device float4* out [[buffer(1)]],
                       uint gid [[thread_position_in_grid]]) {
  const vec<T, 4> v = vec<T, 4>(x[gid]);
  vec<T, 4> w = v.wzyx;
  w.xy = v.zz;
  w.zw += v.xy;
  w.yx *= T(2);
  const vec<T, 3> c = v.bgr;
  const bool4 gt = v > T(0);
  const vec<T, 4> pos = select(vec<T, 4>(T(0)), v, gt);
  float4 r1 = float4(w);
  r1.w += float(c.x + c.y) + x[gid].xy.y;
  float4 r2 = float4(clamp(v, T(-0.5), T(0.5)));
  r2.xy = float2(mix(v.xy, w.xy, T(0.25)));
  r2.z = float(pos.x + pos.y + pos.z + pos.w) + (all(gt) ? 100.0f : 0.0f) +
         (any(v.xyz < T(-1)) ? 1000.0f : 0.0f);
  out[2 * gid] = r1;
  out[2 * gid + 1] = r2;
}
template [[host_name("vector_ops_float")]] kernel void vector_ops<float>(
    device const float4*, device float4*, uint);
template [[host_name("vector_ops_half")]] kernel void vector_ops<half>(
    device const float4*, device float4*, uint);

// Private arrays: initialised 1-d and 2-d arrays, a file-scope constant table, arrays and a
// scalar's address passed to helpers as `thread float*`. `limit` past the array sizes is a
// planted out-of-bounds bug (in the kernel, or inside the helper).
constant float kWeights[4] = {1.0f, 2.0f, 3.0f, 4.0f};

inline void fill_squares(thread float* out, uint n) {
  for (uint i = 0; i < n; ++i) out[i] = float(i * i);
}

inline void add_one(thread float* x) { *x += 1.0f; }

kernel void private_arrays(device float* out [[buffer(0)]],
                           constant uint& limit [[buffer(1)]],
                           constant uint& helper_limit [[buffer(2)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  float sq[4];
  fill_squares(sq, helper_limit);
  float grid[2][3] = {{1.0f, 2.0f, 3.0f}, {4.0f, 5.0f, 6.0f}};
  float one = float(tid);
  add_one(&one);
  float s = one;
  for (uint i = 0; i < limit; ++i) s += sq[i] * kWeights[i];
  out[tid] = s + grid[1][tid % 3] * 10.0f;
}

// Planted bugs: an integer division by zero (thread 3), and more private memory than a thread
// has (a GPU would fail to build the pipeline or spill; the emulator reports it).
kernel void divide_by_zero(device int* out [[buffer(0)]],
                           uint tid [[thread_index_in_threadgroup]]) {
  out[tid] = 100 / (int(tid) - 3);
}

kernel void huge_private_array(device float* out [[buffer(0)]],
                               uint tid [[thread_index_in_threadgroup]]) {
  float big[100000];
  for (uint i = 0; i < 100000; ++i) big[i] = float(i + tid);
  out[tid] = big[(tid * 7919) % 100000];
}
