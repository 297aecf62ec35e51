// Predicted time of a training step: FLOPs and bytes of each part of the step, priced with a
// device's GEMM speed and memory bandwidth (measured by `headroom calibrate` on the CPU, or a
// named GPU's spec). A model for ranking plans, not a promise: `headroom bench` measures.
#pragma once

#include "plan/device_spec.h"
#include "plan/memory_plan.h"

namespace headroom::plan {

struct StepCost {
  double gemm_flops = 0;    // matmul and attention FLOPs of one optimizer step
  double model_flops = 0;   // 6N + 12 L T C per token (N without position embeddings)
  double memory_bytes = 0;  // bytes moved by memory-bound work (norms, activations, optimizer)
  double gemm_seconds = 0;
  double memory_seconds = 0;
  double step_seconds = 0;
  double tokens_per_s = 0;
};

// GEMMs with few rows run below peak; rows / (rows + kGemmHalfRows) is the fraction of the
// large-GEMM speed a micro-batch of `rows` tokens reaches (a fit to this machine's oneDNN:
// see docs/notes/cost-model.md).
constexpr double kGemmHalfRows = 64;

StepCost estimate_step(const model::Gpt2Config& config, const MemoryPlan& plan,
                       const DeviceSpec& device);

}  // namespace headroom::plan
