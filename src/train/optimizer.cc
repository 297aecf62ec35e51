// AdamW, clipping and the cosine schedule.
#include "train/optimizer.h"

#include <cmath>

#include "backend/cpu/kernels.h"

namespace headroom::train {

float cosine_lr(int step, int total, int warmup, float lr, float min_lr_ratio) {
  if (warmup > 0 && step < warmup) return lr * float(step + 1) / float(warmup);
  if (total <= warmup) return lr;
  float progress = float(step - warmup) / float(std::max(1, total - warmup));
  progress = std::min(std::max(progress, 0.0f), 1.0f);
  float min_lr = lr * min_lr_ratio;
  return min_lr + 0.5f * (1.0f + std::cos(float(M_PI) * progress)) * (lr - min_lr);
}

double grad_norm(const model::ParamTable& table, const float* grads) {
  double sum = 0.0;
  for (const model::ParamDesc& p : table.params) {
    sum += cpu::sum_squares(grads + p.offset, p.shape.numel());
  }
  return std::sqrt(sum);
}

double adamw_step(const model::ParamTable& table, float* params, const float* grads, float* m,
                  float* v, const AdamWConfig& config, float lr, int step) {
  const double norm = grad_norm(table, grads);
  float scale = 1.0f;
  // torch.nn.utils.clip_grad_norm_: multiply by max_norm / (norm + 1e-6) when that is below 1.
  if (config.grad_clip > 0) {
    double coef = double(config.grad_clip) / (norm + 1e-6);
    if (coef < 1.0) scale = float(coef);
  }
  for (const model::ParamDesc& p : table.params) {
    cpu::AdamWParams ap{lr,    config.beta1, config.beta2, config.eps,
                        p.decay ? config.weight_decay : 0.0f, step, scale};
    cpu::adamw_update(params + p.offset, grads + p.offset, m + p.offset, v + p.offset,
                      p.shape.numel(), ap);
  }
  return norm;
}

}  // namespace headroom::train
