// The one-row gather of the codebook forward with AVX-512 VBMI byte permutes (the AVX-512 copy
// of codebook.cpp only; elsewhere this header defines nothing): 64 output rows' lookups of one
// table step at a time, exact float32 values. gather_one_row_avx512 takes it on CPUs with
// VBMI (Ice Lake, Sapphire Rapids, Zen 4) and the float permutes of codebook_permute_lookup.h
// elsewhere.
//
// A step's table (E <= 256 floats) is split into its four byte planes: plane p holds byte p of
// every entry, 256 bytes = 4 zmm registers. vpermt2b picks 64 bytes from a pair of registers
// by the low 7 bits of 64 codes, so two permutes and a blend on the code's bit 7 give plane p's
// byte for 64 rows; the four planes' bytes, interleaved (vpunpck{l,h}bw, then {l,h}wd), are the
// 64 table values, bit for bit. Per 64 lookups: 8 byte permutes, 4 blends, 8 unpacks and 4
// adds, where the float permutes (codebook_permute_lookup.h) take 8 permutes, 7 blends and 3
// bit tests per 16.
//
// The codes of 64 rows for one step are bytes of four 16-row transposes (transpose_codes: dword
// i of vector w = row i's codes of steps 4w .. 4w+3): one byte permute per pair of them and a
// blend gather byte b of every dword into one vector, lane r = row r.
//
// The interleave leaves row 16L + 4k + i in dword i of 128-bit lane L of vector k, so the
// accumulators live in that order (a 4 x 4 transpose of 128-bit lanes away from the rows'
// order) between loading and storing them. Each output row's sum runs over the steps in order,
// starting from acc, as in every other copy: results are bitwise those of the float permutes.
#pragma once

#include <rlx/codebook.h>

#include <cstdint>
#include <cstdlib>

#include "codebook_lut.h"  // LineVector
#include "codebook_permute_lookup.h"
#include "cpu_isa.h"

#if RLX_ISA_AVX512
#include <immintrin.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define RLX_VBMI __attribute__((target("avx512vbmi")))

namespace rlx::codebook::cpu::RLX_ISA_NS {

// RLX_NO_VBMI=1 keeps the float permutes (tests compare the two paths).
inline bool cpu_has_vbmi() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi") &&
                         !(std::getenv("RLX_NO_VBMI") && std::getenv("RLX_NO_VBMI")[0] == '1');
  return ok;
}

// The 4 x 4 transpose of 128-bit lanes: rows' order <-> the interleave's order.
inline void transpose_lanes(__m512 (&v)[4]) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);  // v0.L0 v0.L1 v1.L0 v1.L1
  const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);  // v0.L2 v0.L3 v1.L2 v1.L3
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);  // v0.L0 v1.L0 v2.L0 v3.L0
  v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);  // v0.L1 v1.L1 v2.L1 v3.L1
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// Byte index vectors: lane q of half_select(b) picks byte 4 (q % 16) + b of the first
// (q % 32 < 16) or second source of a two-register byte permute.
inline __m512i half_select(int b) {
  alignas(64) uint8_t lanes[64];
  for (int q = 0; q < 64; ++q) {
    lanes[q] = static_cast<uint8_t>((q % 32 < 16 ? 0 : 64) + 4 * (q % 16) + b);
  }
  return _mm512_load_si512(lanes);
}

// planes[(s * 4 + p) * 4 + Q] = byte p of entries 64Q .. 64Q + 63 of step s's table (entries
// past E read as zero).
template <bool kFull>
RLX_VBMI void build_planes(const float* L, int64_t E, int64_t steps, const __mmask16* part_mask,
                           __m512i* planes) {
  __m512i sel[4];
  for (int p = 0; p < 4; ++p) {
    // lanes 0-31: byte p of floats 0..31 of the pair; lanes 32-63 the same of the next pair
    alignas(64) uint8_t lanes[64];
    for (int q = 0; q < 64; ++q) lanes[q] = static_cast<uint8_t>(4 * (q % 32) + p);
    sel[p] = _mm512_load_si512(lanes);
  }
  const __mmask64 upper = ~__mmask64(0) << 32;
  for (int64_t s = 0; s < steps; ++s) {
    const float* t = L + s * E;
    for (int Q = 0; Q < 4; ++Q) {
      __m512i f[4];
      for (int i = 0; i < 4; ++i) {
        const int q = 4 * Q + i;
        f[i] = kFull ? _mm512_loadu_si512(t + 16 * q)
                     : _mm512_castps_si512(_mm512_maskz_loadu_ps(part_mask[q], t + 16 * q));
      }
      for (int p = 0; p < 4; ++p) {
        const __m512i lo = _mm512_permutex2var_epi8(f[0], sel[p], f[1]);
        const __m512i hi = _mm512_permutex2var_epi8(f[2], sel[p], f[3]);
        planes[(s * 4 + p) * 4 + Q] = _mm512_mask_blend_epi8(upper, lo, hi);
      }
    }
  }
}

// acc[j - j0] += sum_{s < ng*M} L[s][idx[j, g0*M + s]] for j in [j0, j1), one batch row, for
// the whole blocks of 64 rows, from the byte planes of the tables L (build_planes); returns
// the first row not done (the caller's float permutes take the rest, summing in the same
// order).
RLX_VBMI int64_t gather_one_row_bytes(const Dims& d, const uint8_t* idx, const __m512i* planes,
                                      int64_t g0, int64_t ng, int64_t j0, int64_t j1,
                                      float* acc) {
  const int64_t M = d.num_codebooks, row_stride = d.groups * M;
  const int64_t steps = ng * M;
  const __m512i sel[4] = {half_select(0), half_select(1), half_select(2), half_select(3)};
  const __mmask64 upper = ~__mmask64(0) << 32;
  // The index lines of the next 64 rows are prefetched one per step, spread over the block's
  // work: 64 prefetches in a row that miss (after a large GEMM, say) wait for line-fill
  // buffers and held the block up (17% of this function's samples at the burst).
  constexpr int64_t kAhead = 64;  // rows prefetched ahead
  int64_t j = j0;
  for (; j + 64 <= j1; j += 64) {
    const bool ahead = j + kAhead + 64 <= j1;
    const uint8_t* next = idx + (j + kAhead) * row_stride + g0 * M;
    __m512 a[4];
    for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_ps(acc + (j - j0) + 16 * k);
    transpose_lanes(a);
    for (int64_t s0 = 0; s0 < steps; s0 += 32) {
      const int n = static_cast<int>(steps - s0 < 32 ? steps - s0 : 32);
      __m512i codes16[4][8];
      for (int g = 0; g < 4; ++g) {
        const uint8_t* chunk[16];
        for (int i = 0; i < 16; ++i) chunk[i] = idx + (j + 16 * g + i) * row_stride + g0 * M + s0;
        transpose_codes(chunk, n, codes16[g]);
      }
      for (int s = 0; s < n; ++s) {
        if (ahead && s0 + s < 64) __builtin_prefetch(next + (s0 + s) * row_stride);
        const int w = s / 4, b = s % 4;
        const __m512i codes = _mm512_mask_blend_epi8(
            upper, _mm512_permutex2var_epi8(codes16[0][w], sel[b], codes16[1][w]),
            _mm512_permutex2var_epi8(codes16[2][w], sel[b], codes16[3][w]));
        const __mmask64 high = _mm512_movepi8_mask(codes);  // bit 7: entries 128..255
        const __m512i* pl = planes + (s0 + s) * 16;
        __m512i v[4];
        for (int p = 0; p < 4; ++p) {
          v[p] = _mm512_mask_blend_epi8(
              high, _mm512_permutex2var_epi8(pl[4 * p], codes, pl[4 * p + 1]),
              _mm512_permutex2var_epi8(pl[4 * p + 2], codes, pl[4 * p + 3]));
        }
        const __m512i lo01 = _mm512_unpacklo_epi8(v[0], v[1]);
        const __m512i hi01 = _mm512_unpackhi_epi8(v[0], v[1]);
        const __m512i lo23 = _mm512_unpacklo_epi8(v[2], v[3]);
        const __m512i hi23 = _mm512_unpackhi_epi8(v[2], v[3]);
        a[0] = _mm512_add_ps(a[0], _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23)));
        a[1] = _mm512_add_ps(a[1], _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23)));
        a[2] = _mm512_add_ps(a[2], _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23)));
        a[3] = _mm512_add_ps(a[3], _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23)));
      }
    }
    if (ahead) {
      for (int64_t i = steps; i < 64; ++i) __builtin_prefetch(next + i * row_stride);
    }
    transpose_lanes(a);
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc + (j - j0) + 16 * k, a[k]);
  }
  return j;
}

// Byte planes of the tables L (ng*M steps, stride E) for gather_one_row_avx512, into `out`
// (1 KiB a step, 64-byte aligned); nullptr where the CPU has no VBMI (then the float
// permutes run).
inline const __m512i* one_row_planes(const Dims& d, const float* L, int64_t steps,
                                     LineVector<uint32_t>& out) {
  if (!cpu_has_vbmi()) return nullptr;
  const int64_t E = d.num_entries;
  __mmask16 part_mask[16];
  entry_masks(E, part_mask);
  if (out.size() < size_t(steps * 256)) out.resize(steps * 256);
  auto* planes = reinterpret_cast<__m512i*>(out.data());
  if (E >= 256) {
    build_planes<true>(L, E, steps, part_mask, planes);
  } else {
    build_planes<false>(L, E, steps, part_mask, planes);
  }
  return planes;
}

// The AVX-512 copy's one-row gather: the byte planes (when built) for the whole blocks of 64
// rows, the float permutes for the rest; both sum each row in step order, so the results are
// the same bits either way.
inline void gather_one_row_avx512(const Dims& d, const uint8_t* idx, const float* L,
                                  const __m512i* planes, int64_t g0, int64_t ng, int64_t j0,
                                  int64_t j1, float* acc) {
  const int64_t j = planes ? gather_one_row_bytes(d, idx, planes, g0, ng, j0, j1, acc) : j0;
  if (j == j1) return;
  if (d.num_entries >= 256) {
    gather_one_row_permute_impl<true>(d, idx, L, g0, ng, j, j1, acc + (j - j0));
  } else {
    gather_one_row_permute_impl<false>(d, idx, L, g0, ng, j, j1, acc + (j - j0));
  }
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS

#undef RLX_VBMI

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
