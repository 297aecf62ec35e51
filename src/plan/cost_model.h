// Predicted time of a training step: FLOPs and bytes of each part of the step, priced with a
// device's GEMM speed and memory bandwidth (measured by `headroom calibrate` on the CPU, or a
// named GPU's spec). A model for ranking plans, not a promise: `headroom bench` measures.
#pragma once

#include <array>
#include <string>

#include "plan/cost_terms.h"
#include "plan/device_spec.h"
#include "plan/memory_plan.h"
#include "plan/zero.h"

namespace headroom::plan {

struct StepCost {
  double gemm_flops = 0;    // matmul and attention FLOPs of one optimizer step
  double model_flops = 0;   // 6N + 12 L T C per token (N without position embeddings)
  double memory_bytes = 0;  // bytes moved by memory-bound work (norms, activations, optimizer)
  double gemm_seconds = 0;
  double memory_seconds = 0;
  double comm_bytes = 0;    // bytes each rank sends per optimizer step (ZeRO collectives)
  double comm_seconds = 0;  // comm_bytes at the device's interconnect bandwidth, not overlapped
  // Offload (docs/notes/offload.md, offload-activations.md). Optimizer offload: gradients to the
  // offload tier and updated weights back over the host link, and AdamW's pass over master, m, v
  // and gradients at the host's memory bandwidth, not overlapped with compute. Activation
  // offload: the saved activations out and back, and the part of their transfer time not hidden
  // behind compute. offload_bytes and offload_seconds count both: the two kinds share the host
  // link, and neither is hidden behind the other (the optimizer's copies run after the last
  // backward, the activations' during forward and backward), so their times add up.
  // activation_offload_*: the activations' part.
  double offload_bytes = 0;
  double offload_seconds = 0;
  double activation_offload_bytes = 0;
  double activation_offload_seconds = 0;
  double host_optimizer_seconds = 0;
  // On a GPU, optimizer offload's gradients out, AdamW on the host and the weights back run as a
  // pipeline of pieces (OptimizerOffload, docs/notes/offload.md): all but the longest of the
  // three, hidden, is subtracted from the step (0 on the CPU backend, where the copies are
  // memcpys on the same cores before and after the update).
  double optimizer_overlap_seconds = 0;
  // Seconds of one optimizer step per kind of op as the executor times them (CostKind; the fused
  // LM head's GEMMs are "loss", as the executor times them), after the device's correction, and
  // before it. step_seconds = sum(by_kind) + other_seconds + comm + offload + host optimizer -
  // optimizer overlap.
  std::array<double, kCostKinds> by_kind{};
  std::array<double, kCostKinds> uncorrected_by_kind{};
  double other_seconds = 0;  // the correction's time outside every kind (0 without one)
  // The fused LM head's GEMMs (uncorrected), inside uncorrected_by_kind's loss: corrected with the
  // GEMM scale (CostCorrection, correction_from).
  double fused_head_gemm_seconds = 0;
  double step_seconds = 0;  // gemm + memory + comm + offload + host optimizer seconds
  double tokens_per_s = 0;  // all ranks together: ranks x tokens per rank / step_seconds
};

// GEMMs with few rows run below peak; rows / (rows + kGemmHalfRows) is the fraction of the
// large-GEMM speed a micro-batch of `rows` tokens reaches on a device without measured terms (an
// assumption; a calibrated CPU uses its fitted GemmTerm::half_rows per shape class instead: see
// docs/notes/cost-model.md, "Measured terms").
constexpr double kGemmHalfRows = 64;

// `zero`, when given with ranks > 1, adds the step's collectives (zero_traffic) at
// device.interconnect_bandwidth, counted as not hidden by compute (no overlap is modelled: see
// docs/notes/cost-model.md, "Planning over devices"), and prices the optimizer on the shard.
// REQUIRES: device.interconnect_bandwidth > 0 when zero->ranks > 1.
// Activation offload per micro-batch: every offloaded block's bytes out (hidden behind the next
// op's forward) and back (hidden behind the previous op's backward), at `bandwidth`, each
// direction counted as max(0, transfer - compute it overlaps). See
// docs/notes/offload-activations.md. Returns the exposed seconds per micro-batch; 0 without
// offload. REQUIRES: bandwidth > 0 when a block is offloaded.
double offload_exposed_seconds(const model::Gpt2Config& config, const MemoryPlan& plan,
                               const DeviceSpec& device, double bandwidth);

// The key of a model shape and precision in the corrections cache: "L4-C128-H4-V50257-fp32".
std::string correction_model_key(const model::Gpt2Config& config, const std::string& precision);

StepCost estimate_step(const model::Gpt2Config& config, const MemoryPlan& plan,
                       const DeviceSpec& device, const ZeroSpec* zero = nullptr);

}  // namespace headroom::plan
