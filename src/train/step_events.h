// The plan in the event recorder's terms (core/event_log.h): the trainer hands its memory plan to
// the recorder once, and the model's op boundaries then produce every planned buffer's allocation
// and release as the step runs. See docs/notes/report.md.
#pragma once

#include "core/event_log.h"
#include "plan/memory_plan.h"

namespace headroom::train {

// Sets `recorder`'s schedule to `plan`'s micro-batch ops and step buffers (region "step", planned
// offsets and lifetimes), and records the allocation of every persistent region's buffers at
// `t_us` (parameters, gradients, optimizer state, staging: live for the whole run). Call it at
// setup and again after a re-plan (the new plan's persistent buffers are then recorded anew only
// when `persistent` is true). REQUIRES: plan.placed.
void record_plan(const plan::MemoryPlan& plan, EventRecorder* recorder, double t_us = 0,
                 bool persistent = true);

// Before each training micro-batch: when `plan`'s step region differs from the recorder's schedule
// (an elastic re-plan changed the micro-batch), sets the schedule from it first (at `t_us`, without
// the persistent regions) and records a "re-plan" marker; then begins micro-batch `micro_batch`
// of optimizer step `step`. Costs a comparison of the step buffers (hundreds), nothing per op.
void begin_micro_batch(EventRecorder* recorder, const plan::MemoryPlan& plan, int step,
                       int micro_batch, double t_us);

}  // namespace headroom::train
