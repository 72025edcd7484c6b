// The params structs of the codebook matmul Metal kernels: the one definition of each,
// included by the kernel sources (csrc/mps/kernels/codebook.metal, codebook_sorted.metal) and
// by the host side (their launch plans, rlx/mps_codebook_plan.h). Written in what both
// languages accept: the Metal Shading Language (C++14; the kernels include <metal_stdlib>
// first, which provides the fixed-width integer types) and host C++. All fields are 32-bit,
// so both compilers lay them out alike (tests/test_metal_params.py compares the layouts).
// tools/embed_metal.py inlines this file into the embedded kernel sources.
#pragma once

#ifndef __METAL_VERSION__
#include <cstdint>
#endif

namespace rlx {
namespace mps {

// codebook.metal and codebook_sorted.metal (the latter reads the shape, has_scales and
// sorted_count)
struct CodebookParams {
  uint32_t rows;              // B
  uint32_t in_features;       // K
  uint32_t out_features;      // N
  uint32_t groups;            // G = K / D
  uint32_t num_codebooks;     // M
  uint32_t num_entries;       // E
  uint32_t entry_dim;         // D
  uint32_t has_scales;        // forward / dx: multiply by s_j; dscale kernel: grad_scales
  uint32_t has_bias;          // forward: add bias_j; dscale kernel: compute grad_bias
  uint32_t codebook_in_tg;    // the codebook is staged (as float) in threadgroup memory
  uint32_t t_block;           // dcodebook: entry components per threadgroup
  uint32_t groups_per_block;  // dcodebook: groups g per threadgroup
  uint32_t num_gblocks;       // dcodebook: number of group blocks (partials)
  uint32_t lut_scan;          // dcodebook: small batch, scan codes once per batch row
  uint32_t sorted_count;      // sorted dcodebook (16-bit codes): N * G * M sorted codes
};

static_assert(sizeof(CodebookParams) == 60, "CodebookParams: 15 4-byte fields");

}  // namespace mps
}  // namespace rlx
