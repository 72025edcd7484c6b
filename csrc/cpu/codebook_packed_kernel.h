// The kernel of the packed 16-bit codebook forward (layout: codebook_packed.h), compiled in
// each ISA copy's region (cpu_isa.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "codebook_packed.h"
#include "vec.h"

#ifndef RLX_UNROLL
#if defined(__clang__)
#define RLX_UNROLL _Pragma("unroll")
#else
#define RLX_UNROLL _Pragma("GCC unroll 16")
#endif
#endif

// The AVX2 copy's float16 loader needs F16C: the per-block kernel takes the includer's target
// (a lambda would not, and would call the loader instead of inlining it).
#ifndef RLX_PACKED_TILE_TARGET
#define RLX_PACKED_TILE_TARGET
#endif

namespace rlx::codebook::cpu::RLX_ISA_NS {

using namespace ::rlx::RLX_ISA_NS;  // vec.h

using V8 = Vec<float, 8>;

// One codebook entry (D = 8) widened to float32.
struct LoadFloat {
  const float* cb;
  V8 operator()(uint32_t code) const {
    V8 c;
    std::memcpy(&c, cb + int64_t(code) * 8, sizeof(c));
    return c;
  }
};

// raw[b, n] (b < BT, row stride raw_stride) for every row, with xt [G + 1][BT][8] float32
// (group G and rows past the batch zero). Load(slice) gives the entry loader of a slice.
// Runs use 8 accumulators spread over the batch rows (8 / BT per row; BT <= 8).
// One block of rows: raw[b, n0 + i] for i < nb, yl a scratch of BT * nb floats.
template <int BT, typename MakeLoad>
RLX_PACKED_TILE_TARGET void packed_block(const PackedView& v, const float* xt, int64_t blk,
                                         float* yl, float* raw, int64_t raw_stride,
                                         const MakeLoad& make_load) {
  static_assert(BT >= 1 && BT <= 8 && 8 % BT == 0, "batch tile of 1, 2, 4 or 8 rows");
  constexpr int U = 8 / BT;  // accumulators per batch row
  const int64_t n0 = blk * v.block_rows;
  const int64_t nb = std::min(v.block_rows, v.rows - n0);
  std::fill_n(yl, BT * nb, 0.f);
  for (int64_t s = 0; s < v.slices; ++s) {
    const int64_t seg = blk * v.slices + s;
    const auto load = make_load(s * v.slice_entries);
    const uint32_t* e = v.codes + v.entry_offsets[seg];
    const uint32_t* r_end = v.runs + v.run_offsets[seg + 1];
    // The next slice's lines, one per 8 entries: the first block to read a slice finds it in
    // cache instead of fetching each line at the random reads' latency.
    const char* pf = s + 1 < v.slices ? make_load.next_slice(s + 1) : nullptr;
    const char* pf_end = pf ? pf + make_load.slice_bytes(s + 1) : nullptr;
    for (const uint32_t* r = v.runs + v.run_offsets[seg]; r < r_end; ++r) {
      const int64_t n = *r >> 16, groups = *r & 0xffff;
      V8 acc[BT][U] = {};
      for (int64_t q = 0; q < groups; ++q, e += 8) {
        if (pf < pf_end) {
          __builtin_prefetch(pf);
          pf += 64;
        }
        RLX_UNROLL
        for (int k = 0; k < 8; ++k) {
          const uint32_t w = e[k];
          const V8 c = load(w & 0xffff);
          const float* xg = xt + int64_t(w >> 16) * (BT * 8);
          RLX_UNROLL
          for (int b = 0; b < BT; ++b) {
            V8 xv;
            std::memcpy(&xv, xg + b * 8, sizeof(xv));
            acc[b][k % U] += xv * c;
          }
        }
      }
      RLX_UNROLL
      for (int b = 0; b < BT; ++b) {
        V8 t = acc[b][0];
        RLX_UNROLL
        for (int u = 1; u < U; ++u) t += acc[b][u];
        float sum = 0;
        for (int l = 0; l < 8; ++l) sum += t[l];
        yl[b * nb + n] += sum;
      }
    }
  }
  for (int b = 0; b < BT; ++b) std::copy_n(yl + b * nb, nb, raw + b * raw_stride + n0);
}

// raw[b, n] (b < BT, row stride raw_stride) for every row, with xt [G + 1][BT][8] float32
// (group G and rows past the batch zero). make_load(first entry) gives a slice's loader.
// Runs use 8 accumulators spread over the batch rows (8 / BT per row; BT <= 8). Blocks are
// claimed by whichever thread is free (each writes only its own rows).
template <int BT, typename MakeLoad>
void packed_forward_tile(const PackedView& v, const float* xt, float* raw, int64_t raw_stride,
                         const MakeLoad& make_load) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, v.blocks, 1, [&](int64_t, int64_t) {
    std::vector<float> yl(BT * v.block_rows);
    for (int64_t blk = next.fetch_add(1); blk < v.blocks; blk = next.fetch_add(1))
      packed_block<BT>(v, xt, blk, yl.data(), raw, raw_stride, make_load);
  });
}

// Batch tiles (1, 2, 4 or 8 rows): calls tile(bt, xt, dst) for each, bt a
// std::integral_constant, xt the tile's [G + 1][BT][8] copy of x, dst its [BT][N] output.
template <typename Tile>
void packed_forward_tiles(const PackedView& v, const float* x, int64_t B, float* raw,
                          const Tile& tile) {
  const int64_t G = v.groups, N = v.rows, K = G * 8;
  const auto run = [&](auto bt) {
    constexpr int BT = decltype(bt)::value;
    std::vector<float> xt((G + 1) * BT * 8), out;
    for (int64_t b0 = 0; b0 < B; b0 += BT) {
      const int64_t nb = std::min<int64_t>(BT, B - b0);
      std::fill(xt.begin(), xt.end(), 0.f);
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t g = 0; g < G; ++g)
          std::copy_n(x + (b0 + b) * K + g * 8, 8, xt.data() + (g * BT + b) * 8);
      float* dst = raw + b0 * N;
      if (nb < BT) {
        out.assign(BT * N, 0.f);
        dst = out.data();
      }
      tile(bt, xt.data(), dst);
      if (nb < BT) std::copy_n(out.data(), nb * N, raw + b0 * N);
    }
  };
  using std::integral_constant;
  if (B == 1) {
    run(integral_constant<int, 1>{});
  } else if (B == 2) {
    run(integral_constant<int, 2>{});
  } else if (B <= 4) {
    run(integral_constant<int, 4>{});
  } else {
    run(integral_constant<int, 8>{});
  }
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS
