// Dynamic loss scaling (see loss_scale.h and Note [Loss scaling] in
// docs/notes/mixed-precision.md).
#include "train/loss_scale.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace headroom::train {

Result<LossScaleConfig> parse_loss_scale(std::string_view flag) {
  LossScaleConfig c;
  if (flag == "dynamic") return c;
  double v = 0;
  const char* end = flag.data() + flag.size();
  auto [ptr, ec] = std::from_chars(flag.data(), end, v);
  if (flag.empty() || ec != std::errc() || ptr != end) {
    return Status::invalid_argument(
        fmt::format("--loss-scale {}: expected dynamic or a number >= 1 (a fixed scale, e.g. "
                    "1024); dynamic is the default",
                    flag));
  }
  if (!std::isfinite(v) || v < 1.0 || v > 16777216.0) {
    return Status::invalid_argument(
        fmt::format("--loss-scale {}: a fixed loss scale must be between 1 and 2^24 (16777216); "
                    "use --loss-scale dynamic to let it adapt",
                    flag));
  }
  c.dynamic = false;
  c.initial = float(v);
  return c;
}

LossScaler::LossScaler(const LossScaleConfig& config) : config_(config) {
  state_.scale = config.initial;
}

bool LossScaler::update(double norm) {
  if (!std::isfinite(norm)) {
    state_.skipped++;
    state_.good_steps = 0;
    if (config_.dynamic) state_.scale = std::max(config_.min_scale, state_.scale * 0.5f);
    return false;
  }
  if (config_.dynamic && ++state_.good_steps >= config_.growth_interval) {
    state_.scale = std::min(config_.max_scale, state_.scale * 2.0f);
    state_.good_steps = 0;
  } else if (!config_.dynamic) {
    state_.good_steps++;
  }
  return true;
}

}  // namespace headroom::train
