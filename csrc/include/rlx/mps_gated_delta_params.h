// The params struct of the gated delta rule Metal kernels: the one definition, included by the
// kernel source (csrc/mps/kernels/gated_delta.metal) and by the host side (its launch plans,
// rlx/mps_gated_delta_plan.h). Written in what both languages accept: the Metal Shading
// Language (C++14; the kernel includes <metal_stdlib> first, which provides the fixed-width
// integer types) and host C++. Fixed-width fields only, 8-byte ones first, so both compilers
// lay it out alike with no padding (tests/test_metal_params.py compares the two layouts).
// tools/embed_metal.py inlines this file into the embedded kernel source.
#pragma once

#ifndef __METAL_VERSION__
#include <cstdint>
#endif

namespace rlx {
namespace mps {

struct GdnParams {
  uint64_t tokens;  // B * T (the packed token count)
  // packed backward buffer slices (float offsets), from rlx::GdnBackwardLayout
  uint64_t dq_offset, dk_offset, dv_offset, dg_offset, dbeta_offset, dstate_offset;
  // backward partial sums (float offsets into the partials buffer)
  uint64_t part_dk_offset, part_dg_offset, part_dbeta_offset;
  uint32_t seq_len;   // T
  uint32_t num_seqs;  // N
  uint32_t num_qk_heads, num_v_heads, head_k_dim, head_v_dim;
  uint32_t group;       // HV / H
  uint32_t k_per_lane;  // ceil(K / 32)
  uint32_t gate_per_channel, has_initial_state, has_grad_final, varlen;
  uint32_t chunk;       // checkpoint interval C
  uint32_t simdgroups;  // per threadgroup = state columns per V-block
  uint32_t num_vblocks;
  uint32_t sub;                   // backward: states kept in threadgroup memory per sub-chunk
  uint32_t window_lo, window_hi;  // backward: chunk indices (per sequence) of this dispatch
  uint32_t window_chunks;         // chunks per window: partial rows = N * window_chunks * C
  uint32_t reduce_simdgroups;     // simdgroups per threadgroup of the reduction kernel
  uint32_t qk_l2norm;             // L2-normalize each q and k row as it is read
  uint32_t keeps_vw;              // forward: write vw (rlx::gdn_keeps_vw)
  float l2norm_eps;               // rows become x / sqrt(sum(x^2) + l2norm_eps)
  float scale;
};

static_assert(sizeof(GdnParams) == 176, "GdnParams: 10 8-byte fields, then 24 4-byte ones");

}  // namespace mps
}  // namespace rlx
