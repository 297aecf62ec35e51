// AdamW, clipping and the cosine schedule.
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

namespace headroom::train {

float cosine_lr(int step, int total, int warmup, float lr, float min_lr_ratio) {
  if (warmup > 0 && step < warmup) return lr * float(step + 1) / float(warmup);
  if (total <= warmup) return lr;
  float progress = float(step - warmup) / float(std::max(1, total - warmup));
  progress = std::min(std::max(progress, 0.0f), 1.0f);
  float min_lr = lr * min_lr_ratio;
  return min_lr + 0.5f * (1.0f + std::cos(float(M_PI) * progress)) * (lr - min_lr);
}

double grad_norm(const model::ParamTable& table, const float* grads, const backend::Ops& ops) {
  // One pass over the flat buffer: the alignment padding between tensors is zero.
  return std::sqrt(ops.sum_squares(grads, table.total_floats));
}

namespace {

// The update of adamw_step_impl with its norm known.
void adamw_update_all(const model::ParamTable& table, float* params, const float* grads,
                      float* grads_out, float* m, float* v, const AdamWConfig& config, float lr,
                      int step, double norm, bf16_t* params_bf16, float loss_scale,
                      const backend::Ops& ops, const UpdateSink* sink) {
  float scale = 1.0f;
  // torch.nn.utils.clip_grad_norm_: multiply by max_norm / (norm + 1e-6) when that is below 1.
  if (config.grad_clip > 0) {
    double coef = double(config.grad_clip) / (norm + 1e-6);
    if (coef < 1.0) scale = float(coef);
  }
  if (loss_scale > 0) scale /= loss_scale;
  // Two contiguous ranges (ParamTable puts decayed tensors first). The padding between tensors
  // has zero gradient and zero parameter, so AdamW leaves it zero.
  const int64_t split = table.decay_floats;
  backend::AdamWParams ap{lr,   config.beta1, config.beta2, config.eps, config.weight_decay,
                          step, scale};
  const auto update = [&](int64_t begin, int64_t count) {
    UpdateSink::split(sink, begin, count, [&](int64_t off, int64_t n) {
      const int64_t b = begin + off;
      bf16_t* copy = params_bf16 == nullptr ? nullptr : params_bf16 + b;
      // adamw_update reads grads and, with zero_grads, zeroes them: grads_out is grads then.
      ops.adamw_update(params + b, const_cast<float*>(grads) + b, m + b, v + b, n, ap, copy,
                       grads_out != nullptr);
    });
  };
  update(0, split);
  ap.weight_decay = 0.0f;
  update(split, table.total_floats - split);
}

// adamw_step (grads_out null) and adamw_step_and_zero (grads_out == grads).
double adamw_step_impl(const model::ParamTable& table, float* params, const float* grads,
                       float* grads_out, float* m, float* v, const AdamWConfig& config, float lr,
                       int step, bf16_t* params_bf16, float loss_scale, const backend::Ops& ops,
                       const UpdateSink* sink) {
  const double norm = grad_norm(table, grads, ops) / (loss_scale > 0 ? double(loss_scale) : 1.0);
  if (loss_scale > 0 && !std::isfinite(norm)) {  // overflow: the caller skips the step
    if (grads_out != nullptr) ops.zero(grads_out, table.total_floats);
    return norm;
  }
  adamw_update_all(table, params, grads, grads_out, m, v, config, lr, step, norm, params_bf16,
                   loss_scale, ops, sink);
  return norm;
}

}  // namespace

double adamw_step(const model::ParamTable& table, float* params, const float* grads, float* m,
                  float* v, const AdamWConfig& config, float lr, int step, bf16_t* params_bf16,
                  float loss_scale, const backend::Ops& ops, const UpdateSink* sink) {
  return adamw_step_impl(table, params, grads, nullptr, m, v, config, lr, step, params_bf16,
                         loss_scale, ops, sink);
}

double adamw_step_and_zero(const model::ParamTable& table, float* params, float* grads, float* m,
                           float* v, const AdamWConfig& config, float lr, int step,
                           bf16_t* params_bf16, float loss_scale, const backend::Ops& ops) {
  return adamw_step_impl(table, params, grads, grads, m, v, config, lr, step, params_bf16,
                         loss_scale, ops, nullptr);
}

void adamw_apply(const model::ParamTable& table, float* params, const float* grads, float* m,
                 float* v, const AdamWConfig& config, float lr, int step, double norm,
                 float loss_scale, const backend::Ops& ops, const UpdateSink* sink) {
  adamw_update_all(table, params, grads, nullptr, m, v, config, lr, step, norm, nullptr, loss_scale,
                   ops, sink);
}

void UpdateSink::split(const UpdateSink* sink, int64_t begin, int64_t count,
                       const std::function<void(int64_t offset, int64_t n)>& run) {
  if (count <= 0) return;
  if (sink == nullptr || sink->chunk <= 0 || sink->chunk >= count) {
    if (sink != nullptr && sink->before) sink->before(begin, count);
    run(0, count);
    if (sink != nullptr && sink->updated) sink->updated(begin, count);
    return;
  }
  HR_CHECK_MSG(sink->chunk % 64 == 0, "UpdateSink::chunk must be a multiple of 64 floats");
  for (int64_t off = 0; off < count; off += sink->chunk) {
    const int64_t n = std::min(sink->chunk, count - off);
    if (sink->before) sink->before(begin + off, n);
    run(off, n);
    if (sink->updated) sink->updated(begin + off, n);
  }
}

}  // namespace headroom::train
