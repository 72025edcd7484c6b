// Packed layouts of the gated delta rule, shared by every backend (CPU, MPS host code,
// the Metal emulator tests). Plain C++17, no torch dependency.
//
// 1. Backward buffer. rlx::gated_delta_bwd writes every gradient into ONE flat buffer of
//    the accumulation dtype (float32, or float64 for float64 inputs). Slices, in order,
//    each contiguous and row-major, no padding:
//      dq     [B, T, H,  K]
//      dk     [B, T, H,  K]
//      dv     [B, T, HV, V]
//      dg     [B, T, HV]        per-head gate (Gated DeltaNet)
//             [B, T, HV, K]     per-channel gate (KDA): only this slice widens
//      dbeta  [B, T, HV]
//      dstate [N, HV, K, V]     only when an initial state is carried (else numel 0)
//    B*T is the packed token count; N = B, or the number of varlen sequences.
//
// 2. Forward checkpoints. rlx::gated_delta_fwd keeps the state before token j*C of every
//    sequence (j = 0, 1, ..., ceil(T_n / C) - 1) in a [slots, HV, K, V] buffer. Sequence n,
//    starting at packed token bos_n, uses slots checkpoint_base(n, bos_n) + j. The base
//    n + bos_n / C never overlaps the previous sequence's slots (because
//    floor(a + b) >= floor(a) + floor(b) and ceil(x) <= floor(x) + 1), and the slot count
//    depends only on N and the token count, so it is known without reading cu_seqlens.
//    Slots no sequence uses are zero, except the first 4 bytes of the last slot, which no
//    sequence ever uses (its last slot is at most N - 2 + ceil(total / C)): the CPU forward
//    tags it there (gdn_checkpoint_tag, gdn_checks.h). chunk_size = 0 keeps no checkpoints
//    (0 slots): for forward passes that no backward will follow.
#pragma once

#include <cstdint>

namespace rlx {

struct GdnSlice {
  int64_t offset = 0;  // in elements of the buffer dtype
  int64_t numel = 0;
  int64_t end() const { return offset + numel; }
};

struct GdnBackwardLayout {
  int64_t batch = 0, seq_len = 0;           // B, T (B = 1 when varlen)
  int64_t num_qk_heads = 0, num_v_heads = 0;  // H, HV (HV % H == 0)
  int64_t head_k_dim = 0, head_v_dim = 0;     // K, V
  int64_t num_states = 0;                     // N
  bool gate_per_channel = false;
  bool has_initial_state = false;
  GdnSlice dq, dk, dv, dg, dbeta, dstate;
  int64_t total = 0;

  static GdnBackwardLayout make(int64_t batch, int64_t seq_len, int64_t num_qk_heads,
                                int64_t num_v_heads, int64_t head_k_dim, int64_t head_v_dim,
                                int64_t num_states, bool gate_per_channel,
                                bool has_initial_state) {
    GdnBackwardLayout l;
    l.batch = batch;
    l.seq_len = seq_len;
    l.num_qk_heads = num_qk_heads;
    l.num_v_heads = num_v_heads;
    l.head_k_dim = head_k_dim;
    l.head_v_dim = head_v_dim;
    l.num_states = num_states;
    l.gate_per_channel = gate_per_channel;
    l.has_initial_state = has_initial_state;
    const int64_t tokens = batch * seq_len;
    int64_t at = 0;
    auto take = [&at](int64_t numel) {
      GdnSlice s;
      s.offset = at;
      s.numel = numel;
      at += numel;
      return s;
    };
    l.dq = take(tokens * num_qk_heads * head_k_dim);
    l.dk = take(tokens * num_qk_heads * head_k_dim);
    l.dv = take(tokens * num_v_heads * head_v_dim);
    l.dg = take(tokens * num_v_heads * (gate_per_channel ? head_k_dim : 1));
    l.dbeta = take(tokens * num_v_heads);
    l.dstate = take(has_initial_state ? num_states * num_v_heads * head_k_dim * head_v_dim : 0);
    l.total = at;
    return l;
  }
};

// Forward checkpoint slots (see 2. above).
inline int64_t gdn_checkpoint_slots(int64_t num_seqs, int64_t total_tokens, int64_t chunk) {
  if (chunk <= 0) return 0;
  return num_seqs + (total_tokens + chunk - 1) / chunk;
}
inline int64_t gdn_checkpoint_base(int64_t seq, int64_t bos, int64_t chunk) {
  return chunk > 0 ? seq + bos / chunk : 0;
}
inline int64_t gdn_num_chunks(int64_t seq_tokens, int64_t chunk) {
  return chunk > 0 ? (seq_tokens + chunk - 1) / chunk : 0;
}

// Default checkpoint interval: the backward recomputes at most this many states per chunk
// into a C x K x V scratch (C = 64, K = V = 128: 4 MiB float32, per worker thread).
constexpr int64_t kGdnDefaultChunk = 64;

// Whether the forward returns vw ([B, T, HV, V], v - P^T k per token) rather than an empty
// tensor: with checkpoints and one gate per head, on every backend (the CPU's chunked
// backward reads it).
inline bool gdn_keeps_vw(int64_t chunk, bool gate_per_channel) {
  return chunk > 0 && !gate_per_channel;
}

}  // namespace rlx
