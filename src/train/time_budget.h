// `train --minutes M`: the step count that fits a time budget, fixed from the first steps' times
// (docs/notes/first-run.md, "A time budget").
#pragma once

namespace headroom::train {

struct TimeBudget {
  double budget_s = 0;   // the whole budget, from the run's first validation or step
  double elapsed_s = 0;  // spent so far (the steps done, validations included)
  int steps_done = 0;
  double step_s = 0;   // a step's measured time (the median of the measured ones)
  double eval_s = 0;   // one validation's time (measured, or estimated)
  int eval_every = 0;  // 0: validation at the end only
  int max_steps = 0;   // --steps: the most the run may take
};

// The steps [the run's total] that fit the budget: `steps_done` plus the most k steps whose time,
// and that of the validations they bring (every eval_every-th step and the last), fit the rest
// of the budget; at least steps_done + 1, at most max_steps.
int steps_within(const TimeBudget& b);

// The step after which the count is first estimated (steps 2-4 timed; the first warms caches and
// pages) and the shortest warmup `--minutes` takes: the count is fixed after the warmup's last
// step, the last whose learning rate does not depend on it, so that the run is exactly
// `--steps N` with that N.
inline constexpr int kMinutesDecisionStep = 4;

}  // namespace headroom::train
