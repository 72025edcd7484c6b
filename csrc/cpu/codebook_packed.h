// The packed index layout of the 16-bit (1x16) codebook forward on CPU, and its kernel.
//
// The plain gather kernel (codebook_gather.h) walks each output row's codes in order and reads
// the entries they select at random from the whole table (1 MiB in float16, 2 MiB in float32
// for E = 65536, D = 8): almost every read misses L1 and most miss L2. The indices are fixed
// for a given weight (inference, PV-tuning), so they can be reordered once:
//   - rows are cut into blocks of `block_rows` (the unit of parallel work: each block writes
//     only its own outputs), and the table into slices of `slice_entries` entries (small
//     enough to stay in L2 while a block reads it; the kernel prefetches the next slice);
//   - within (block, slice) the (row n, group g, code) triples are sorted by n, then g, and
//     every row's run is padded to a multiple of 8 entries;
//   - the kernel accumulates a run in vector registers (acc += x_g * C[code], 8 independent
//     accumulators, no horizontal sum per code) and adds one horizontal sum per (row, slice)
//     into the block's outputs.
// Padding entries name group G, a zero group appended to x, and the run's first code (an
// entry the run reads anyway): they add exact zeros, unless that entry holds inf or NaN, in
// which case the row's output is NaN where the plain kernel may give inf (the row is not
// finite either way).
//
// Layout: one int32 tensor, a header of kPackedHeader words, then
//   run_offsets[segments + 1]    (segment = block * num_slices + slice; indices into runs)
//   entry_offsets[segments + 1]  (indices into entries)
//   runs[num_runs]               n_local << 16 | groups_of_8   (longer runs are split)
//   entries[num_entries]         g << 16 | (code - slice * slice_entries)
// Determinism: each output is summed by one work item, slices in order, a run's entries in
// order; the result does not depend on the thread count.
#pragma once

#include <cstdint>

#include "cpu_isa.h"

namespace rlx::codebook::cpu {

enum PackedHeaderField : int {
  kPackedMagic = 0,  // kPackedMagicValue
  kPackedRows,       // N
  kPackedGroups,     // G = K / D
  kPackedEntries,    // E
  kPackedSliceEntries,
  kPackedBlockRows,
  kPackedBlocks,
  kPackedSlices,
  kPackedRuns,
  kPackedEntryCount,
  kPackedHeader = 16,
};
inline constexpr int32_t kPackedMagicValue = 0x31504252;  // "RBP1"
inline constexpr int64_t kPackedMaxRows = 16;             // batch rows the packed kernel takes

// A view of a packed layout (pointers into the int32 tensor).
struct PackedView {
  int64_t rows, groups, entries, slice_entries, block_rows, blocks, slices;
  const int32_t* run_offsets;
  const int32_t* entry_offsets;
  const uint32_t* runs;
  const uint32_t* codes;
};

inline PackedView packed_view(const int32_t* p) {
  PackedView v;
  v.rows = p[kPackedRows];
  v.groups = p[kPackedGroups];
  v.entries = p[kPackedEntries];
  v.slice_entries = p[kPackedSliceEntries];
  v.block_rows = p[kPackedBlockRows];
  v.blocks = p[kPackedBlocks];
  v.slices = p[kPackedSlices];
  const int64_t segs = v.blocks * v.slices;
  v.run_offsets = p + kPackedHeader;
  v.entry_offsets = v.run_offsets + segs + 1;
  v.runs = reinterpret_cast<const uint32_t*>(v.entry_offsets + segs + 1);
  v.codes = v.runs + p[kPackedRuns];
  return v;
}

// The kernels' entry points (codebook_packed.cpp): raw [B, N] float32 = x [B, K] float32 times
// the dequantized weight; cb [E, 8] float32, or float16/bfloat16 (cb_half = 1 / 2) where
// packed_reads_half says this copy reads them.
RLX_ISA_DECLARE(void packed_forward(const int32_t* packed, const float* x, int64_t B, const void* cb,
                    int cb_half, float* raw);
bool packed_reads_half(int cb_half);)


}  // namespace rlx::codebook::cpu
