// The measured terms of the cost model (docs/notes/cost-model.md, "Measured terms"): what each kind
// of op costs on this machine, fitted from `headroom calibrate`'s timings of the backend's own
// kernels, and the per-kind correction a training run measures on itself (self-correction).
// Plain values and pure functions: no timing happens here.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace headroom::plan {

// The kinds the executor times (model::OpKind, in the same order) plus the optimizer step.
enum class CostKind {
  kGemm,
  kAttention,
  kNorm,
  kElementwise,
  kLoss,
  kEmbedding,
  kOptimizer,
  kCount
};
inline constexpr size_t kCostKinds = size_t(CostKind::kCount);
std::string_view cost_kind_name(CostKind k);  // "gemm", ..., "optimizer"

// y = intercept + slope * x, least squares. With fewer than two distinct x, or a negative
// intercept (noise at small sizes), the line through the origin that fits best (intercept 0).
struct LineFit {
  double intercept = 0;
  double slope = 0;
};
LineFit fit_line(const std::vector<std::pair<double, double>>& xy);

// A class of GEMMs (small, large, LM head): a GEMM of `flops` FLOPs over `rows` rows takes
// flops / (rate * rows / (rows + half_rows)) seconds. rate: FLOP/s at many rows; half_rows: the
// rows at which it runs at half that rate (per-call overhead and short-row inefficiency together).
struct GemmTerm {
  double rate = 0;  // 0: not measured
  double half_rows = 0;
  // The forward's share of a forward + backward's time (what a recomputation re-runs): a third
  // by the FLOPs; measured, less where the backward's kernels run slower than the forward's.
  double forward_share = 1.0 / 3.0;
  double seconds(double flops, double rows) const;
};
struct GemmSample {
  double flops, rows, seconds;
  double forward_seconds = 0;  // the forward alone; 0: not timed
};
// Fits rate and half_rows: seconds / flops = 1/rate + (half_rows/rate) / rows is a line in 1/rows;
// forward_share: the samples' forward time over their forward + backward time (a third where no
// sample timed its forward), clamped to [0.15, 0.6].
// REQUIRES: at least one sample with flops, rows and seconds > 0.
GemmTerm fit_gemm(const std::vector<GemmSample>& samples);

// A memory-bound kernel (a forward and backward pair, timed together): `pairs` pairs over `units`
// elements take pairs * call_seconds + units * unit_seconds.
struct KernelTerm {
  double call_seconds = 0;
  double unit_seconds = 0;  // 0: not measured
  double seconds(double pairs, double units) const {
    return pairs * call_seconds + units * unit_seconds;
  }
};
// From (units, seconds) samples of one pair each.
KernelTerm fit_kernel(const std::vector<std::pair<double, double>>& units_seconds);

// The tiled attention: a forward and backward over `heads` (sequence, head) pairs and `units`
// FLOP units takes heads * call_seconds + units * unit_seconds, call_seconds being the cost of one
// (sequence, head) pair beyond its FLOPs (packing its rows, the partial tiles of a short
// sequence). Fitted to minimise the relative error of the samples (each is weighted by its own
// time, so the short sequences count as much as the long ones); neither cost is negative.
struct AttentionSample {
  double heads, units, seconds;
};
KernelTerm fit_attention(const std::vector<AttentionSample>& samples);

// Where a GEMM of in_cols x out_cols weights falls: the LM head (out_cols or in_cols at least
// kHeadCols; narrow when its other side is at most kSmallCols), small (the narrower side at most
// kSmallCols), or large.
enum class GemmClass { kSmall, kLarge, kHeadSmall, kHead };
inline constexpr int64_t kSmallCols = 256;
inline constexpr int64_t kHeadCols = 8192;
GemmClass gemm_class(int64_t in_cols, int64_t out_cols);

// Everything calibrate fits (index 0: fp32, 1: bf16; bf16 terms are 0 where the CPU has no bf16
// kernels). The memory-bound kernels are the backend's fp32 ones; see the note for what a bf16
// step's are priced with.
struct CostTerms {
  bool fitted = false;
  std::array<GemmTerm, 2> gemm_small, gemm_large, gemm_head_small, gemm_head;
  // Forward + backward; calls: (sequence, head) pairs, units: 12 T A FLOPs per token.
  std::array<KernelTerm, 2> attention;
  KernelTerm norm;       // layernorm forward + backward, units: rows x C
  KernelTerm gelu;       // GELU forward + backward, units: elements
  KernelTerm residual;   // residual add forward + backward, units: elements
  KernelTerm loss;       // the one-pass cross-entropy, units: rows x V
  KernelTerm embedding;  // token (+ position) lookup forward + backward, units: rows x C
  // AdamW with the gradients' zeroing and their norm, units: parameters; [1]: also writing the
  // bf16 copy of the weights in the same pass (bf16 with bf16_weight_copy).
  std::array<KernelTerm, 2> optimizer;
  const GemmTerm& gemm(GemmClass c, bool bf16) const;
};

// A run's measurement of itself: each kind's measured time over the model's time for the same
// plan (1 where the kind was not measured or predicted 0), and what the step spent outside the
// kinds (data, zeroing, allocation), per token. See Note [Self-correction].
struct CostCorrection {
  std::array<double, kCostKinds> scale;
  double other_seconds_per_token = 0;
  int steps = 0;  // steps it was measured over; 0: no correction
  CostCorrection() { scale.fill(1.0); }
  bool active() const { return steps > 0; }
};

// The correction that makes `predicted` (seconds per kind of one optimizer step, uncorrected)
// equal `measured` (seconds per kind, averaged over steps) and `measured_step_seconds`. A kind
// predicted at 0 keeps scale 1 and its measured time goes to the per-token rest, as does the step's
// time outside every kind. Scales are clamped to [1/20, 20] (a kind timed at almost nothing).
// `fused_head_gemm` (seconds, part of predicted loss): the fused LM head's GEMMs, which the
// executor times as the loss; they are corrected by the GEMM scale, the rest of the loss by its
// own, so that a correction measured with either head applies to the other.
CostCorrection correction_from(const std::array<double, kCostKinds>& predicted,
                               const std::array<double, kCostKinds>& measured,
                               double measured_step_seconds, double tokens, int steps,
                               double fused_head_gemm = 0);

// The cache of corrections next to the calibration (corrections.json in the calibration's
// directory): one object per machine ("<cpu model>|<threads> threads"), holding one correction per
// model shape and precision (`key`, e.g. "L4-C128-V50257-fp32"). Written atomically.
std::string corrections_path(const std::string& calibration_path);
std::string correction_machine_key(const std::string& cpu_model, int threads);
// NotFound when the file or the entry is absent; Corrupt naming the file and field otherwise.
Result<CostCorrection> load_correction(const std::string& path, const std::string& machine,
                                       const std::string& key);
Status save_correction(const std::string& path, const std::string& machine, const std::string& key,
                       const CostCorrection& correction);

}  // namespace headroom::plan
