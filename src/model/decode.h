// Generation with a KV cache: the transformer's forward for new tokens only, attending over the
// cached keys and values of every earlier position (docs/notes/generation.md). fp32, batch 1.
// The model's other forward (Gpt2::forward) recomputes the whole window; this one runs each
// sampled token through the blocks once.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/ops.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/gpt2.h"

namespace headroom::model {

// The buffers of generation over a context of `context` positions, in two tables the planner
// lays out (plan::plan_generation): the cache (category kv_cache: keys and values of every layer,
// [n_layer][n_kv_head][context][head_size] each) and one pass's working buffers for up to `rows`
// new tokens (category activations, the logits of the pass's last token category logits). A
// prompt is one pass of its length (the prefill); each sampled token one pass of one row.
struct DecodeTable {
  int context = 0, rows = 0;
  std::vector<memory::BufferDesc> cache;  // k, v
  std::vector<memory::BufferDesc> work;
  // Indices into `work`.
  size_t x = 0, xn = 0, qkv = 0, att = 0, fc = 0, fc_act = 0, logits = 0, rope = 0, stats = 0;
  uint64_t cache_bytes() const;
  uint64_t work_bytes() const;
};
// REQUIRES: 1 <= rows <= context <= config.n_positions.
DecodeTable decode_table(const TransformerConfig& config, int context, int rows);

// Runs passes over a bound cache and work arena (laid out from a DecodeTable). Not thread-safe.
class Decoder {
 public:
  // `params`: the flat fp32 parameter buffer of `table`, read only.
  Decoder(const TransformerConfig& config, const ParamTable* table, const float* params,
          const DecodeTable* decode, memory::Arena* cache, memory::Arena* work,
          const backend::Ops& ops = backend::cpu_ops());

  // Forgets the cache and runs tokens[0 .. n) at positions 0 .. n-1. Returns the logits of the
  // last one (vocab_size floats, valid until the next pass). REQUIRES: 1 <= n <= rows.
  const float* prefill(const int32_t* tokens, int n);
  // Runs one token at the next position. REQUIRES: position() < context.
  const float* step(int32_t token);
  // The positions cached so far.
  int position() const { return pos_; }

 private:
  const float* pass(const int32_t* tokens, int n);
  void norm(float* out, const float* inp, const float* w, const float* b, int n);

  TransformerConfig config_;
  const ParamTable* table_;
  const float* params_;
  const DecodeTable* decode_;
  memory::Arena* cache_;
  memory::Arena* work_;
  const backend::Ops* ops_;
  int pos_ = 0;
};

}  // namespace headroom::model
