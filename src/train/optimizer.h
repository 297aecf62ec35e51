// AdamW over the flat parameter buffer, the learning-rate schedule, and global-norm clipping.
#pragma once

#include <cstdint>

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

// Linear warmup from lr/warmup to lr over `warmup` steps, then cosine decay to min_lr_ratio*lr at
// `total` steps (nanoGPT's schedule). `step` is 0-based.
float cosine_lr(int step, int total, int warmup, float lr, float min_lr_ratio);

// Global L2 norm of all gradients (double accumulation, deterministic).
double grad_norm(const model::ParamTable& table, const float* grads);

// One AdamW step (torch.optim.AdamW semantics, with clip_grad_norm_ folded in as a gradient
// scale). `step` is 1-based. m and v have the parameter buffer's layout. Returns the gradient
// norm before clipping. With params_bf16 (mixed precision), the updated parameters are also
// written there rounded to bf16, in the same pass.
double adamw_step(const model::ParamTable& table, float* params, const float* grads, float* m,
                  float* v, const AdamWConfig& config, float lr, int step,
                  bf16_t* params_bf16 = nullptr);

}  // namespace headroom::train
