// ZeRO stages 0-3 for AdamW over the flat parameter buffer: which buffers are sharded, the
// reduction each stage needs, and the sharded optimizer step. See docs/notes/zero.md.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "model/gpt2.h"
#include "train/optimizer.h"

namespace headroom::train {

// GPT-2's ZeRO-3 units: per group (embeddings; each block; ln_f) its decayed tensors and its
// other tensors, each a contiguous range of the flat buffer (ParamTable puts decayed tensors
// first), sorted by offset. They cover [0, table.total_floats).
std::vector<dist::Range> gpt2_zero_units(const model::ParamTable& table);

// The same units in the order backward finishes their gradients: ln_f, the blocks from last to
// first (decayed tensors, then the others), the embeddings last (wte's gradient is final only
// after the embedding backward). With dist::make_buckets: the gradient buckets.
std::vector<dist::Range> gpt2_backward_order(const model::ParamTable& table);

// Stages 1-3's pieces of the optimizer step, shared by ZeroOptimizer::step and optimizer offload
// (OptimizerOffload::step runs them on the offload tier's copy), so that both are the same bits.
// Reduce-scatters each unit of `grads` (full buffer) into its local place in `grad_shard`.
Status reduce_scatter_units(dist::Communicator* comm, const dist::ShardLayout& layout, float* grads,
                            float* grad_shard);
// The global gradient norm of the shards: each piece's double sum of squares in unit order,
// summed over the ranks (a collective), then unscaled by loss_scale (> 0: fp16).
// The shards are the backend `ops`'s memory (sharded_adamw's too).
Result<double> sharded_grad_norm(dist::Communicator* comm, const dist::ShardLayout& layout,
                                 const float* grad_shard, float loss_scale,
                                 const backend::Ops& ops = backend::cpu_ops());
// Clip-scaled AdamW on this rank's pieces, per unit and decay part (the decay split is a
// multiple of 16 floats, like every piece boundary). params index the full buffer's coordinates
// (params_full) or the shard's; grad_shard, m and v the shard's. sink (optimizer.h): told each
// updated piece in the shard's local coordinates.
void sharded_adamw(const dist::ShardLayout& layout, const model::ParamTable& table, float* params,
                   bool params_full, const float* grad_shard, float* m, float* v,
                   const AdamWConfig& config, float lr, int step, double norm, float loss_scale,
                   const backend::Ops& ops = backend::cpu_ops(), const UpdateSink* sink = nullptr);

// The buffers of one rank. "full" = table.total_floats floats; "shard" =
// layout().local_floats() floats.
struct ZeroBuffers {
  // Stages 0-2: full, identical on every rank. Stage 3: this rank's shard (the fp32 master copy;
  // forward/backward read units gathered from it by dist::ParamGatherer).
  float* params = nullptr;
  // This rank's own full gradient (summed over its micro-batches), reduced by step() unless
  // grads_reduced. May be null in stages 1-3 when grads_reduced.
  float* grads = nullptr;
  // Stages 1-3: the reduced gradient shard (shard floats); null in stage 0.
  float* grad_shard = nullptr;
  // AdamW moments: full in stage 0, shards in stages 1-3.
  float* m = nullptr;
  float* v = nullptr;
  // The reduction already ran (a dist::BucketReducer during backward): grads holds the sum
  // (stage 0) or grad_shard does (stages 1-3).
  bool grads_reduced = false;
  // Stage 0 only: step() also zeroes grads for the next step, in AdamW's pass
  // (adamw_step_and_zero; with cpu::zero when loss scaling skips the step).
  bool zero_grads = false;
};

// The optimizer step of a ZeRO stage on one rank:
//   0: all-reduce grads, AdamW on everything (every rank the same).
//   1, 2: reduce-scatter grads into grad_shard, AdamW on this rank's piece of params with
//      sharded m/v, all-gather params. Reduce-scatter + all-gather sends 2(R-1)/R x the buffer,
//      like stage 0's all-reduce (the ZeRO paper's P_os and P_os+g); an all-reduce followed by
//      the gather would send 3(R-1)/R. The stages differ in what the executor keeps: stage 1 a
//      full gradient accumulation buffer, stage 2 only gradient windows that ZeroWindows
//      reduce-scatters during backward (train/zero_windows.h; then grads_reduced).
//   3: reduce-scatter grads into grad_shard, AdamW on the sharded params; no gather (the next
//      forward gathers per unit with dist::ParamGatherer).
// Stages 1-2 shard the flat buffer as one unit; stage 3 per unit (gpt2_zero_units by default).
//
// Equality with single-process adamw_step on the summed gradient: the AdamW update is
// elementwise and every piece boundary is a multiple of 16 floats, so params, m and v are
// bit-identical whenever the clipping scale is. Stage 0 computes the norm exactly as
// adamw_step does (bit-identical). Stages 1-3 add per-piece double sums of squares across ranks:
// the norm differs from the single-process one by double rounding (relative ~1e-16), so the
// float clipping scale, hence the update, is identical except when it falls on a float rounding
// boundary, and always identical with clipping off or inactive. The gradient sum is
// bit-identical to a sequential sum for 2 ranks (fp32 addition is commutative); with more ranks
// MPI's reduction order applies (deterministic for a given job shape, not sequential).
//
// Thread safety: one step at a time, from the thread that owns the communicator (no CommQueue
// work in flight).
class ZeroOptimizer {
 public:
  // units: the stage-3 units (sorted, disjoint, covering the buffer; empty = gpt2_zero_units).
  // The buffers of step() are the memory of `ops`, which runs the update.
  ZeroOptimizer(dist::Communicator* comm, const model::ParamTable* table, int stage,
                std::vector<dist::Range> units = {}, const backend::Ops& ops = backend::cpu_ops());

  int stage() const { return stage_; }
  const dist::ShardLayout& layout() const { return layout_; }

  // Floats this rank allocates for each buffer of ZeroBuffers (0 = not used).
  struct Sizes {
    int64_t params, grads, grad_shard, m, v;
  };
  Sizes sizes() const;

  // One optimizer step (step is 1-based, lr the scheduled rate). Returns the global gradient
  // norm before clipping, the same on every rank. A collective: every rank calls it.
  // With params_bf16 (mixed precision, stages 0-2): the bf16 copy of the full updated
  // parameters is written too, as adamw_step writes it (round to nearest even of each updated
  // float), so the bf16 weights are bit-identical to a single process's.
  // loss_scale > 0 (fp16): as adamw_step's: the returned norm is unscaled, and when it is not
  // finite no rank updates anything (the norm is reduced across ranks first, so all agree).
  Result<double> step(const ZeroBuffers& b, const AdamWConfig& config, float lr, int step,
                      bf16_t* params_bf16 = nullptr, float loss_scale = 0.0f);

  // Stage 3: gathers every unit of the sharded params into `full` (table.total_floats floats),
  // e.g. for evaluation or a checkpoint. A collective.
  Status gather_params(const float* shard, float* full);
  // Copies this rank's pieces of `full` (host memory) into its shard: the memory of `ops`
  // (copy_to_device), or host memory (with optimizer offload, the tier's m and v), after
  // initialisation or a checkpoint load, which produce full buffers on every rank.
  void scatter_params(const float* full, float* shard) const;

 private:
  dist::Communicator* comm_;
  const model::ParamTable* table_;
  int stage_;
  dist::ShardLayout layout_;
  const backend::Ops* ops_;
};

}  // namespace headroom::train
