// The plan in the event recorder's terms (core/event_log.h): the trainer hands its memory plan to
// the recorder once, and the model's op boundaries then produce every planned buffer's allocation
// and release as the step runs. See docs/notes/report.md.
#pragma once

#include <chrono>
#include <functional>
#include <string_view>

#include "core/event_log.h"
#include "dist/communicator.h"
#include "memory/pool_resource.h"
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
// the persistent regions) and, unless note_replan() recorded the re-plan since the last
// micro-batch, records a "re-plan" marker of cause "unknown"; then begins micro-batch
// `micro_batch` of optimizer step `step`. Costs a comparison of the step buffers (hundreds),
// nothing per op.
void begin_micro_batch(EventRecorder* recorder, const plan::MemoryPlan& plan, int step,
                       int micro_batch, double t_us);

// An op outside the schedule, begun at `begin_us` and ended at `end_us` (the optimizer step, the
// data wait, the loader's fill): its op_begin and op_end events, with `phase`, optimizer step
// `step` and `thread`. Interns `name` (a hash lookup): for a few ops per step.
void record_op(EventRecorder* recorder, std::string_view name, EventPhase phase, int step,
               double begin_us, double end_us, uint8_t thread = kEventThreadTraining);

// Why the plan changed while the run went on (docs/notes/elastic.md).
enum class ReplanCause { kBudget, kOutOfMemory, kResume, kCostModel };
std::string_view replan_cause_name(
    ReplanCause c);  // "budget", "out of memory", "resume", "cost model"

// Records a marker for a re-plan of optimizer step `step` (0-based) at `t_us`: named "re-plan"
// when the plan changed, "plan kept" when it did not (a budget change the plan still fits),
// "resume" for a run resumed from a checkpoint with the checkpoint's plan, with
// its cause and `detail` (the trainer's log line: old -> new budget, old -> new plan).
void note_replan(EventRecorder* recorder, ReplanCause cause, bool changed, std::string_view detail,
                 int step, double t_us);

// An observer for the pool that serves the step region (memory::PoolResource::set_observer):
// records every block acquired and released and every chunk reserved and handed back as pool
// events (region "pool"; a block is named after the region it serves, `served_region`, so the
// report knows which planned buffers lie inside pool blocks; a chunk is "chunk"), at the time since
// `origin`, with the recorder's pool context (EventRecorder::set_pool_context). Also records, at
// `t_us`, the chunks `now` says the pool holds already (one reserve event of now.reserved bytes),
// so the reserved bytes in the log are the pool's from the start of the recording.
// REQUIRES: the pool is used from one thread (the recorder is not thread-safe).
std::function<void(const memory::PoolEvent&)> pool_observer(
    EventRecorder* recorder, std::string_view served_region,
    std::chrono::steady_clock::time_point origin, const memory::PoolStats& now, double t_us);

// A communicator that forwards every call to `inner` and, while tracing, records each collective
// as an op ("all-reduce", "reduce-scatter", "all-gather", "broadcast", "barrier") of the given
// phase and step: the optimizer's ZeRO collectives inside its "optimizer step" op, without the
// optimizer knowing. Not tracing, it costs one pointer test a call. Thread safety: as `inner`,
// and tracing requires the recorder's thread.
class TracedCommunicator final : public dist::Communicator {
 public:
  explicit TracedCommunicator(dist::Communicator* inner) : inner_(inner) {}

  // Records the collectives that follow into `recorder` (times since `origin`) as ops of `phase`
  // in optimizer step `step`; a null recorder stops.
  void trace(EventRecorder* recorder, std::chrono::steady_clock::time_point origin,
             EventPhase phase, int step);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return inner_->name(); }
  Status all_reduce(float* data, int64_t n) override;
  Status all_reduce(double* data, int64_t n) override;
  Status all_reduce_min(int64_t* data, int64_t n) override;
  Status reduce_scatter(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status all_gather(const float* send, float* recv, std::span<const int64_t> counts) override;
  Status broadcast(void* data, int64_t bytes, int root) override;
  Status barrier() override;
  using dist::Communicator::broadcast;

 private:
  template <typename F>
  Status traced(uint32_t name, F&& call);

  dist::Communicator* inner_;
  EventRecorder* recorder_ = nullptr;
  std::chrono::steady_clock::time_point origin_;
  EventPhase phase_ = EventPhase::kNone;
  int step_ = -1;
  uint32_t all_reduce_ = EventLog::kNoName, reduce_scatter_ = EventLog::kNoName,
           all_gather_ = EventLog::kNoName, broadcast_ = EventLog::kNoName,
           barrier_ = EventLog::kNoName;
};

}  // namespace headroom::train
