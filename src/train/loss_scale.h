// Dynamic loss scaling for fp16 mixed precision: f16 gradients underflow below 2^-24, so the
// loss gradient is multiplied by a scale S before the backward, and the fp32 gradients are
// unscaled before clipping and AdamW. An overflow (inf or NaN in a gradient) skips the step and
// halves S; after `growth_interval` good steps in a row S doubles. See Note [Loss scaling] in
// docs/notes/mixed-precision.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace headroom::train {

struct LossScaleConfig {
  bool dynamic = true;
  float initial = 65536.0f;       // 2^16 (dynamic: where S starts; fixed: S)
  int growth_interval = 2000;     // good steps in a row before S doubles (dynamic only)
  float min_scale = 1.0f;         // S never backs off below this
  float max_scale = 16777216.0f;  // 2^24: S never grows above this
};

// Parses --loss-scale: "dynamic" or a fixed scale (a finite number >= 1, e.g. 1024, 65536).
// The error names the flag, the value and what is expected.
Result<LossScaleConfig> parse_loss_scale(std::string_view flag);

// The scaler's state, as a checkpoint's trainer_state holds it (resume is exact).
struct LossScaleState {
  float scale = 65536.0f;
  int good_steps = 0;   // finite steps since the last overflow or growth
  int64_t skipped = 0;  // steps skipped so far in the run (overflows)
  bool operator==(const LossScaleState&) const = default;
};

// Not thread-safe; one per run. Every rank holds the same scaler and sees the same (reduced)
// gradient norm, so all ranks make the same decision.
class LossScaler {
 public:
  explicit LossScaler(const LossScaleConfig& config);

  // S: the factor the loss gradient is multiplied by this step.
  float scale() const { return state_.scale; }
  const LossScaleState& state() const { return state_; }
  const LossScaleConfig& config() const { return config_; }
  // REQUIRES: state.scale finite and >= 1.
  void restore(const LossScaleState& state) { state_ = state; }

  // After a step whose unscaled gradient norm was `norm`: returns true when the update was
  // applied (norm finite), false when the step is skipped (an overflow). Dynamic: an overflow
  // halves S (not below min_scale) and resets the count; growth_interval good steps in a row
  // double S (not above max_scale). A fixed scale never changes, but overflows are still
  // skipped.
  bool update(double norm);

 private:
  LossScaleConfig config_;
  LossScaleState state_;
};

}  // namespace headroom::train
