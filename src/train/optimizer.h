// AdamW over the flat parameter buffer, the learning-rate schedule, and global-norm clipping.
#pragma once

#include <cstdint>
#include <functional>

#include "model/gpt2.h"

namespace headroom::train {

struct AdamWConfig {
  float lr = 6e-4f;  // peak learning rate
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;  // on 2-D tensors only (ParamDesc::decay)
  float grad_clip = 1.0f;     // global L2 norm; 0 disables clipping
};

// Where an AdamW step tells its caller what it is about to update and what it has updated, so
// that the caller can move each piece (optimizer offload: its gradients in, the updated weights
// back to the device) while the next is computed. The update runs in pieces of at most `chunk`
// floats (a multiple of 64, so that every piece but a range's last is whole vectors and the bits
// are the unsplit update's; 0: one piece per range), in order; `before(begin, count)` is called
// before each and `updated(begin, count)` after, with the piece's offset in the parameter buffer
// the step was given (the shard's local offset for sharded_adamw). Either may be empty.
struct UpdateSink {
  int64_t chunk = 0;
  std::function<void(int64_t begin, int64_t count)> before;
  std::function<void(int64_t begin, int64_t count)> updated;
  // Runs ops.adamw_update over [begin, begin + count) in pieces, calling `updated` after each
  // (sink may be null: one call). `run(offset, n)` updates n floats from begin + offset.
  static void split(const UpdateSink* sink, int64_t begin, int64_t count,
                    const std::function<void(int64_t offset, int64_t n)>& run);
};

// Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay to min_lr_ratio*lr at
// `total` steps (nanoGPT's schedule). `step` is 0-based.
float cosine_lr(int step, int total, int warmup, float lr, float min_lr_ratio);

// Global L2 norm of all gradients (double accumulation, deterministic).
// Every function here runs on the backend `ops` (the buffers are its memory).
double grad_norm(const model::ParamTable& table, const float* grads,
                 const backend::Ops& ops = backend::cpu_ops());

// One AdamW step (torch.optim.AdamW semantics, with clip_grad_norm_ folded in as a gradient
// scale). `step` is 1-based. m and v have the parameter buffer's layout. Returns the gradient
// norm before clipping. With params_bf16 (mixed precision), the updated parameters are also
// written there rounded to bf16, in the same pass.
// loss_scale > 0 (fp16, train/loss_scale.h): the gradients are multiplied by it. The returned
// norm is the unscaled one (the scaled norm / loss_scale, computed in the same pass as always);
// when it is not finite (an inf or NaN in some gradient) nothing is updated (params, m, v and
// params_bf16 untouched) and the caller skips the step. Otherwise the update unscales in the
// clipping factor (grad_scale = clip / loss_scale: exact for power-of-two scales).
// sink: see UpdateSink (null: the whole ranges, no calls).
double adamw_step(const model::ParamTable& table, float* params, const float* grads, float* m,
                  float* v, const AdamWConfig& config, float lr, int step,
                  bf16_t* params_bf16 = nullptr, float loss_scale = 0.0f,
                  const backend::Ops& ops = backend::cpu_ops(), const UpdateSink* sink = nullptr);

// adamw_step's update with the norm already known (`norm`: the unscaled global norm, finite):
// the same clipping factor and the same adamw_update calls, so adamw_step = grad_norm, then
// this, bit for bit. No bf16 copy.
void adamw_apply(const model::ParamTable& table, float* params, const float* grads, float* m,
                 float* v, const AdamWConfig& config, float lr, int step, double norm,
                 float loss_scale, const backend::Ops& ops = backend::cpu_ops(),
                 const UpdateSink* sink = nullptr);

// adamw_step that leaves the gradients zero for the next step, as a cpu::zero after adamw_step
// would: in AdamW's pass (Ops::adamw_update with zero_grads, one pass over them fewer) when the
// step is applied, with Ops::zero when loss scaling skips it. Params, m, v, params_bf16 and the
// returned norm are adamw_step's, bit for bit.
double adamw_step_and_zero(const model::ParamTable& table, float* params, float* grads, float* m,
                           float* v, const AdamWConfig& config, float lr, int step,
                           bf16_t* params_bf16 = nullptr, float loss_scale = 0.0f,
                           const backend::Ops& ops = backend::cpu_ops());

}  // namespace headroom::train
