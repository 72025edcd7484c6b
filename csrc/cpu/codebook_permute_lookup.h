// The one-row gather of the codebook forward's lookup-table path with AVX-512 (the AVX-512
// copy of codebook.cpp only; elsewhere this header defines nothing): table lookups done 16
// output rows at a time by register permutes instead of one scalar load each.
//
// For one batch row, step s of a table block (s = g*M + m) has a table of E <= 256 floats,
// L[s][c] = x_g . C[m, c]. Sixteen output rows j..j+15 look up their codes idx[j+i, s] at once:
// the table's 256 floats are 16 zmm registers, and vpermt2ps picks from a pair of them by the
// low 5 bits of each code, so 8 permutes cover the 8 pairs, and the code's bits 5, 6, 7 choose
// among the 8 results (7 masked blends). That is about 20 vector instructions per 16
// lookups, against 16 scalar loads and adds (and the byte extractions) in the scalar gather.
//
// The codes of 16 rows are 16 strided slices of the [N, groups*M] index matrix: each 32-step
// chunk of a block is read as 16 rows of 32 bytes and transposed in registers (a 16 x 8 dword
// transpose), so that dword i of vector w holds row i's codes of steps 4w..4w+3, one per
// byte; a shift moves step 4w+b's code into the low byte, and the permutes and bit tests
// ignore the bytes above it.
//
// Accumulation order: for each output row, the sum runs over the steps in order, starting
// from acc, as the other copies' one-row gathers do (codebook_one_row.h calls this, through
// gather_one_row_avx512 of codebook_byte_lookup.h, with its tables, stride E, per 512-row chunk
// of a 64-step work item; on CPUs with VBMI only for the rows after the last whole 64).
#pragma once

#include <rlx/codebook.h>

#include <cstdint>

#include "cpu_isa.h"

#if RLX_ISA_AVX512
#include <immintrin.h>

// GCC 12 warns inside its own intrinsics (their _mm512_undefined_* operands) wherever they
// are inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace rlx::codebook::cpu::RLX_ISA_NS {

// Register q (entries 16q..16q+15) of a step's table; masked (zeros past E) unless kFull,
// so that a short table never reads past its end. (Codes are < E: check_index_range.)
template <bool kFull>
inline __m512 table_part(const float* table, int q, const __mmask16* part_mask) {
  if constexpr (kFull) {
    return _mm512_loadu_ps(table + 16 * q);
  } else {
    return _mm512_maskz_loadu_ps(part_mask[q], table + 16 * q);
  }
}

// part_mask[q]: the entries 16q .. 16q + 15 that exist in a table of E.
inline void entry_masks(int64_t E, __mmask16 (&part_mask)[16]) {
  for (int q = 0; q < 16; ++q) {
    const int64_t left = E - 16 * q;
    part_mask[q] = left >= 16 ? __mmask16(0xffff) : left <= 0 ? 0 : (__mmask16(1) << left) - 1;
  }
}

// lane i: table[codes_i & 255] (codes_i's bits above 7 are ignored).
template <bool kFull>
inline __m512 lookup16(const float* table, __m512i codes, const __mmask16* part_mask) {
  __m512 r[8];
  for (int p = 0; p < 8; ++p) {
    r[p] = _mm512_permutex2var_ps(table_part<kFull>(table, 2 * p, part_mask), codes,
                                  table_part<kFull>(table, 2 * p + 1, part_mask));
  }
  const __mmask16 b5 = _mm512_test_epi32_mask(codes, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(codes, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(codes, _mm512_set1_epi32(128));
  const __m512 s0 = _mm512_mask_blend_ps(b5, r[0], r[1]);
  const __m512 s1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
  const __m512 s2 = _mm512_mask_blend_ps(b5, r[4], r[5]);
  const __m512 s3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
  const __m512 u0 = _mm512_mask_blend_ps(b6, s0, s1);
  const __m512 u1 = _mm512_mask_blend_ps(b6, s2, s3);
  return _mm512_mask_blend_ps(b7, u0, u1);
}

// out[w] dword i = bytes 4w..4w+3 of rows[i] (w < 8): rows are 16 pointers to n <= 32 code
// bytes (bytes past n read as zero).
inline void transpose_codes(const uint8_t* const* rows, int n, __m512i* out) {
  const __mmask32 m = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
  __m512i z[8];
  for (int i = 0; i < 8; ++i) {  // rows i (low half) and i + 8 (high half)
    const __m256i lo = _mm256_maskz_loadu_epi8(m, rows[i]);
    const __m256i hi = _mm256_maskz_loadu_epi8(m, rows[i + 8]);
    z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // An 8 x 8 dword transpose in each 256-bit half. a[2i], a[2i+1]: rows 2i, 2i+1 interleaved
  // (dwords 4h, 4h+1 and 4h+2, 4h+3 of 128-bit lane h).
  __m512i a[8], b[8];
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  // b[4i + e], lane h: dword 4h + e of rows 4i..4i+3.
  for (int i = 0; i < 2; ++i) {
    for (int u = 0; u < 2; ++u) {
      b[4 * i + 2 * u] = _mm512_unpacklo_epi64(a[4 * i + u], a[4 * i + 2 + u]);
      b[4 * i + 2 * u + 1] = _mm512_unpackhi_epi64(a[4 * i + u], a[4 * i + 2 + u]);
    }
  }
  // out[e] = lane 0 of b[e] and of b[4 + e] in each half, out[4 + e] = their lanes 1.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm512_permutex2var_epi64(b[e], first, b[4 + e]);
    out[4 + e] = _mm512_permutex2var_epi64(b[e], second, b[4 + e]);
  }
}

// acc[j - j0] += sum_{s < ng*M} L[s][idx[j, g0*M + s]] for j in [j0, j1), one batch row (the
// tables L: [ng*M][E] floats, as build_one_row_tables writes them with stride E).
template <bool kFull>
void gather_one_row_permute_impl(const Dims& d, const uint8_t* idx, const float* L, int64_t g0,
                                 int64_t ng, int64_t j0, int64_t j1, float* acc) {
  const int64_t M = d.num_codebooks, E = d.num_entries, row_stride = d.groups * M;
  const int64_t steps = ng * M;
  __mmask16 part_mask[16];
  entry_masks(E, part_mask);
  constexpr int64_t kAhead = 32;  // rows prefetched ahead (see prefetch_rows)
  int64_t j = j0;
  for (; j + 16 <= j1; j += 16) {
    const uint8_t* rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = idx + (j + i) * row_stride + g0 * M;
    if (j + kAhead + 16 <= j1) {
      for (int i = 0; i < 16; ++i) {
        const uint8_t* p = rows[i] + kAhead * row_stride;
        for (int64_t off = 0; off < steps; off += 64) __builtin_prefetch(p + off);
        __builtin_prefetch(p + steps - 1);
      }
    }
    __m512 a = _mm512_loadu_ps(acc + (j - j0));
    for (int64_t s0 = 0; s0 < steps; s0 += 32) {
      const int n = static_cast<int>(steps - s0 < 32 ? steps - s0 : 32);
      const uint8_t* chunk[16];
      for (int i = 0; i < 16; ++i) chunk[i] = rows[i] + s0;
      __m512i codes[8];
      transpose_codes(chunk, n, codes);
      const float* table = L + s0 * E;
      for (int w = 0; w * 4 < n; ++w) {
        const __m512i c = codes[w];
        a = _mm512_add_ps(a, lookup16<kFull>(table, c, part_mask));
        if (4 * w + 1 < n)
          a = _mm512_add_ps(a, lookup16<kFull>(table + E, _mm512_srli_epi32(c, 8), part_mask));
        if (4 * w + 2 < n)
          a = _mm512_add_ps(a, lookup16<kFull>(table + 2 * E, _mm512_srli_epi32(c, 16),
                                               part_mask));
        if (4 * w + 3 < n)
          a = _mm512_add_ps(a, lookup16<kFull>(table + 3 * E, _mm512_srli_epi32(c, 24),
                                               part_mask));
        table += 4 * E;
      }
    }
    _mm512_storeu_ps(acc + (j - j0), a);
  }
  for (; j < j1; ++j) {
    float a = acc[j - j0];
    const uint8_t* ip = idx + j * row_stride + g0 * M;
    for (int64_t s = 0; s < steps; ++s) a += L[s * E + ip[s]];
    acc[j - j0] = a;
  }
}

}  // namespace rlx::codebook::cpu::RLX_ISA_NS

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif
