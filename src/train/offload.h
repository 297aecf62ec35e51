// Optimizer offload (ZeRO-Offload style) in the trainer: the optimizer step that runs on the
// offload tier's optimizer regions (train/offload_tier.h holds them, next to any offloaded
// activations). See docs/notes/offload.md ("Note [Optimizer offload]").
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend/ops.h"
#include "core/status.h"
#include "dist/communicator.h"
#include "dist/shard.h"
#include "plan/memory_plan.h"
#include "train/offload_tier.h"
#include "train/optimizer.h"

namespace headroom::train {

// The optimizer's regions of the offload tier (OffloadTier, plan::kOffloadMasterRegion,
// kOffloadOptimizerRegion, kOffloadGradientsRegion): the fp32 master weights, AdamW's m and v,
// and the gradient copy the update reads, each this rank's shard (the whole buffer at ZeRO-0).
// On the CPU the tier is host memory like the device, and every copy between the two is a real
// memcpy, so the path is exercised and measured. On a backend whose memory the host cannot
// address (a GPU, the fenced device) the copies are the op table's (copy_to_host for the
// gradients and the master weights at load, copy_to_device for the updated weights) and the
// bf16 cast is its op; AdamW runs on the host over the tier (docs/notes/device-trainer.md).
//
// The step (ZeRO stages 0-3):
//   1. reduce on the device: all-reduce the gradients (stage 0), or reduce-scatter them into
//      the device's gradient shard (stages 1-2);
//   2. copy this rank's reduced gradients device -> offload tier;
//   3. AdamW on the offload tier (master, m, v), with the global norm's clipping;
//   4. copy the updated master device <- offload tier into the device parameters (this rank's
//      piece), all-gather the pieces (stages 1-2), and cast the bf16 copy on the device.
//      Stage 3 keeps only its shard on the device: the master goes back into that shard, which
//      the forward gathers unit by unit as without offload.
//      Steps 2-4 overlap on a device the host cannot address: the global norm is computed on the
//      device (the same sum over the same values), the gradients are queued out in pieces on the
//      device-to-host stream, the update runs piece by piece (UpdateSink) as each piece lands,
//      and each updated piece is queued back on the host-to-device stream while the host
//      computes the next; every copy is waited for before the all-gather and the cast. On the
//      CPU backend a copy is a memcpy on the same cores, which pieces only slow (4 MiB pieces
//      miss the large copy's streaming stores: GPT-2 124M's step 9% slower,
//      docs/notes/offload.md), so there it stays one copy out, the update, one copy back.
// The arithmetic is adamw_step's / ZeroOptimizer::step's on the same values in the same order,
// so weights, m and v are bit-identical to the run without offload (tested).
//
// Not thread-safe: the training thread calls it, with no communication in flight.
class OptimizerOffload {
 public:
  // Runs on `tier`'s optimizer regions (the tier made from `plan`, which holds them).
  // `layout`: the optimizer's shard layout (ZeroOptimizer::layout(): the flat one-unit layout
  // of stages 0-2, the model's units at stage 3). Errors: InvalidArgument for a stage not 0-3.
  // `ops`: the table whose memory the device buffers passed to load_master and step are.
  // REQUIRES: plan.policy.offload_optimizer; tier, comm, table, layout and ops outlive this
  // object.
  static Result<std::unique_ptr<OptimizerOffload>> create(
      const plan::MemoryPlan& plan, const OffloadTier& tier, dist::Communicator* comm, int stage,
      const dist::ShardLayout* layout, const backend::Ops& ops = backend::cpu_ops());

  float* master() const { return master_; }
  float* m() const { return m_; }
  float* v() const { return v_; }
  float* grads() const { return grads_; }
  int64_t shard_floats() const { return shard_floats_; }  // floats of each offload buffer

  // Sets the master weights from the device parameters (the full buffer at stages 0-2, the
  // device's shard at stage 3): this rank's piece. Call after initialisation and after loading
  // a checkpoint.
  void load_master(const float* device_params);

  // One optimizer step (see the class comment). `params`: as for load_master. `grad_shard` is
  // the device's reduced-gradient shard (stages 1-3), null at stage 0; `params_bf16` the
  // device's bf16 copy or null (null at stage 3). Returns
  // the global gradient norm before clipping. A collective with several ranks.
  // loss_scale > 0 (fp16): the gradients are scaled by it; on an overflow (a non-finite
  // unscaled norm) nothing is updated or copied and the norm is returned, as adamw_step does.
  // grads_reduced: the reduction already ran during backward (dist::BucketReducer at stages
  // 0-1, ZeRO-2/3's gradient windows): grads holds the sum (stage 0) or grad_shard does (1-3).
  Result<double> step(float* params, float* grads, float* grad_shard, bf16_t* params_bf16,
                      const AdamWConfig& config, float lr, int step, bool grads_reduced = false,
                      float loss_scale = 0.0f);

  // Bytes copied per step each way, and the time the copies of the last step took on the
  // training thread (the updated weights' copies: the time to queue them plus the final wait,
  // what the overlap with AdamW did not hide).
  uint64_t bytes_to_offload() const { return uint64_t(piece_floats()) * 4; }
  uint64_t bytes_to_device() const { return uint64_t(piece_floats()) * 4; }
  double last_copy_ms() const { return last_copy_ms_; }

  // The pieces the update is computed and copied back in (floats, a multiple of 64). By default
  // 4 MiB on a device the host cannot address (large enough for a copy engine's full rate, small
  // enough that 124M parameters make 119 of them) and one piece on the CPU backend. Tests set
  // small pieces so that a tiny model runs the pipeline (on the CPU too: the same bits).
  static constexpr int64_t kDefaultUploadChunkFloats = int64_t(1) << 20;
  void set_upload_chunk_floats(int64_t n);
  int64_t upload_chunk_floats() const;

 private:
  OptimizerOffload(dist::Communicator* comm, const model::ParamTable* table, int stage,
                   const dist::ShardLayout* layout, const backend::Ops* ops)
      : comm_(comm), table_(table), stage_(stage), layout_(layout), ops_(ops) {}
  // The copies between the device's buffers and the tier's (offload.cc).
  void to_offload(float* dst, const float* device_src, int64_t n) const;
  void to_device(float* device_dst, const float* src, int64_t n) const;
  int64_t piece_floats() const;
  int64_t device_begin() const;

  float *master_ = nullptr, *m_ = nullptr, *v_ = nullptr, *grads_ = nullptr;  // the tier's
  dist::Communicator* comm_;
  const model::ParamTable* table_;
  int stage_;
  const dist::ShardLayout* layout_;
  const backend::Ops* ops_;
  int64_t shard_floats_ = 0;
  double last_copy_ms_ = 0;
  int64_t upload_chunk_ = 0;  // 0: the default above
};

}  // namespace headroom::train
