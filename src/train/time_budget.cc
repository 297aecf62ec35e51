#include "train/time_budget.h"

#include <algorithm>
#include <cstdint>

namespace headroom::train {

int steps_within(const TimeBudget& b) {
  const int lo = std::min(b.max_steps, b.steps_done + 1);
  if (b.max_steps <= b.steps_done + 1) return lo;
  const double rest = b.budget_s - b.elapsed_s;
  // The time of k more steps, with the validations of the steps (steps_done, steps_done + k]:
  // each eval_every-th, and the last unless it is one of those.
  auto cost = [&](int64_t k) {
    const int64_t last = b.steps_done + k;
    int64_t evals = 1;
    if (b.eval_every > 0) {
      evals = last / b.eval_every - b.steps_done / b.eval_every + (last % b.eval_every ? 1 : 0);
    }
    return double(k) * b.step_s + double(evals) * b.eval_s;
  };
  // cost is increasing in k: the largest k in [1, max_steps - steps_done] that fits.
  int64_t good = 1, bad = int64_t(b.max_steps) - b.steps_done + 1;
  if (cost(good) > rest) return lo;
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    (cost(mid) <= rest ? good : bad) = mid;
  }
  return int(b.steps_done + good);
}

}  // namespace headroom::train
