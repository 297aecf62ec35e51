// Pruning the transformer's weights (docs/notes/pruning.md): unstructured magnitude masks, N:M
// semi-structured masks, and structured pruning of MLP channels or of attention heads / KV groups
// that writes a smaller model.
// Everything here works on the flat parameter buffer of a ParamTable; nothing allocates device
// memory (the caller owns the buffers).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/status.h"
#include "model/config.h"
#include "model/gpt2.h"

namespace headroom::model {

// The tensors pruning touches: every 2-D tensor of the blocks (GPT-2's c_attn, attn.c_proj,
// c_fc, mlp.c_proj weights; Llama's q, k, v, o, gate, up, down projections). Never the
// embeddings, an untied LM head, norm weights or biases. Indices into table.params, in order.
std::vector<size_t> prunable_tensors(const ParamTable& table);

// The dimension of a prunable tensor that its GEMM reduces over (the input features): 0 for
// GPT-2's Conv1D weights ([in, out]), 1 for Linear weights ([out, in]).
int input_dim(const TransformerConfig& config);

// A sparsity mask over the flat parameter buffer: one byte per float (table.total_floats bytes),
// 1 keep, 0 pruned. Padding and tensors that are not pruned are 1.
using SparsityMask = std::vector<uint8_t>;

// Unstructured magnitude pruning: zero-masks the round(sparsity x n) smallest |w| among the
// prunable tensors' n weights: globally (one ranking over all of them) or per layer (each
// block's prunable weights ranked alone, each losing the same share). Ties break towards the
// lower index (deterministic). REQUIRES: 0 <= sparsity < 1.
SparsityMask magnitude_mask(const ParamTable& table, const float* params, double sparsity,
                            bool per_layer);

// N:M semi-structured pruning: in every group of M consecutive weights along the input
// dimension of each output row, keeps the N of largest |w| (ties: the lower index) and masks
// the other M - N. Errors: InvalidArgument when N, M are not 0 < N < M, or M does not divide a
// prunable tensor's input dimension (naming the tensor).
Result<SparsityMask> nm_mask(const TransformerConfig& config, const ParamTable& table,
                             const float* params, int n, int m);

// The mask of a model whose pruned weights are exact zeros (a pruned model directory): 0 where
// a prunable tensor's weight is 0.0f (either sign), 1 elsewhere.
SparsityMask mask_from_zeros(const ParamTable& table, const float* params);

// buffer[i] = +0.0f where mask[i] == 0, for i < n (a parameter-shaped buffer: the weights,
// their gradients, AdamW's moments; n = table.total_floats). One pass, OpenMP: the CPU op
// table's apply_mask (a device buffer takes its backend's Ops::apply_mask).
void apply_mask(const uint8_t* mask, float* buffer, int64_t n);
inline void apply_mask(const SparsityMask& mask, float* buffer, int64_t n) {
  HR_CHECK_MSG(int64_t(mask.size()) >= n, "apply_mask: the mask is shorter than the buffer");
  apply_mask(mask.data(), buffer, n);
}

// An unstructured or N:M mask, as the command line names it: "magnitude" (with sparsity and
// global / per layer) or "N:M" (e.g. "2:4").
struct MaskSpec {
  enum class Kind : uint8_t { kMagnitude, kNM } kind = Kind::kNM;
  int n = 2, m = 4;
  double sparsity = 0.5;   // magnitude only
  bool per_layer = false;  // magnitude only
  // "2:4", "magnitude 50% global", "magnitude 30% per layer".
  std::string describe() const;
};
// Parses "magnitude", "n:m" (N:M from `nm`), or an "N:M" such as "2:4" given directly; `flag`
// names the option in errors.
Result<MaskSpec> parse_mask_spec(const std::string& method, const std::string& nm, double sparsity,
                                 bool per_layer, const std::string& flag);
// The spec's mask of `params`.
Result<SparsityMask> make_mask(const TransformerConfig& config, const ParamTable& table,
                               const float* params, const MaskSpec& spec);

// The mask's pruned weights (zeros) and the prunable weights it covers.
struct MaskCounts {
  int64_t pruned = 0, prunable = 0;
};
MaskCounts count_mask(const ParamTable& table, const SparsityMask& mask);

// Structured pruning of the MLP: removes the same number of hidden channels from every block
// (Hugging Face configs have one intermediate_size / n_inner), keeping in each block the
// round((1 - sparsity) x width) channels of the largest importance, in their original order.
// A channel's importance is the L2 norm of every weight and bias it owns across the projections
// it touches: GPT-2's c_fc column and bias and c_proj row; Llama's gate and up rows and down
// column. Errors: InvalidArgument for a sparsity outside [0, 1) or one that would keep no
// channel.
struct StructuredPrune {
  enum class Unit : uint8_t { kMlpChannel, kKvGroup } unit = Unit::kMlpChannel;  // what went
  TransformerConfig config;                   // intermediate_size (or the heads) updated
  ParamTable table;                           // the smaller model's table
  std::vector<float> params;                  // its flat buffer (table.total_floats)
  std::vector<std::vector<int64_t>> removed;  // per block: the removed channels (or KV groups),
                                              // ascending
};
Result<StructuredPrune> prune_mlp_channels(const TransformerConfig& config, const ParamTable& table,
                                           const float* params, double sparsity);

// Any parameter-shaped buffer of the unpruned model (weights, gradients, optimizer moments:
// table.total_floats) in the pruned model's layout (pruned.table.total_floats): what the removed
// units own is dropped, the rest moves where the pruned weights went.
std::vector<float> gather_kept(const TransformerConfig& config, const ParamTable& table,
                               const float* buffer, const StructuredPrune& pruned);

// For tests and reports: zeroes, in the unpruned model's buffer, the weights and biases of the
// channels `removed` (per block) owns, so that the unpruned model computes what the pruned one
// does.
void zero_mlp_channels(const TransformerConfig& config, const ParamTable& table, float* params,
                       const std::vector<std::vector<int64_t>>& removed);

// Structured pruning of the attention: removes the same number of KV groups from every block
// (one key/value head with the n_head / kv_heads query heads that read it; in GPT-2 and other
// MHA models a group is one head), keeping in each block the round((1 - sparsity) x kv_heads)
// groups of the largest importance, in their original order. A group's importance is the L2 norm
// of every weight and bias it owns: its query heads' q rows (GPT-2: c_attn columns) and their
// biases, its k and v rows and biases, and its query heads' columns of the output projection
// (GPT-2: c_proj rows). Removing whole groups keeps one group size in every block, as one
// num_key_value_heads requires. The result has n_head = kept groups x group size, kv heads (Llama
// family) = kept groups, and an explicit head_dim (the original head size): its attention is
// n_head x head_dim wide while the residual stream keeps n_embd. `removed` lists the removed
// groups per block. Errors: InvalidArgument for a sparsity outside [0, 1) or one that would keep
// no group (naming the count).
Result<StructuredPrune> prune_attention_heads(const TransformerConfig& config,
                                              const ParamTable& table, const float* params,
                                              double sparsity);

// For tests and reports, in the unpruned model's buffer: zero_attention_heads zeroes every
// weight and bias the groups `removed` (per block) own; zero_attention_output only their query
// heads' columns of the output projection (GPT-2: rows of c_proj), which alone makes the groups
// contribute nothing, so the unpruned model computes what the pruned one does.
void zero_attention_heads(const TransformerConfig& config, const ParamTable& table, float* params,
                          const std::vector<std::vector<int64_t>>& removed);
void zero_attention_output(const TransformerConfig& config, const ParamTable& table, float* params,
                           const std::vector<std::vector<int64_t>>& removed);

// The mean loss of `sequences` sequences of T tokens (inputs and targets, sequences x T each;
// targets -1 ignored) in micro-batches of B (the last may be shorter), forward only, with
// activations from a host arena made here. For reports and tests (validation before and after
// pruning). Errors: OutOfMemory from the arena.
Result<double> mean_loss(const TransformerConfig& config, const ParamTable& table,
                         const float* params, const int32_t* inputs, const int32_t* targets,
                         int64_t sequences, int B, int T);

}  // namespace headroom::model
