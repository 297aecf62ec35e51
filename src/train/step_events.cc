// The memory plan as the event recorder's schedule (step_events.h).
#include "train/step_events.h"

#include <fmt/format.h>

#include "core/check.h"
#include "plan/search.h"

namespace headroom::train {

void record_plan(const plan::MemoryPlan& plan, EventRecorder* recorder, double t_us,
                 bool persistent) {
  HR_CHECK(plan.placed);
  EventLog& log = recorder->log();
  auto category = [&](memory::Category c) { return log.intern(memory::category_name(c)); };
  std::vector<ScheduleOp> ops(plan.ops.size());
  for (size_t i = 0; i < plan.ops.size(); i++) {
    const model::OpDesc& op = plan.ops[i];
    ops[i].name = log.intern(op.name);
    ops[i].phase =
        op.phase == model::OpDesc::Phase::kForward ? EventPhase::kForward : EventPhase::kBackward;
    ops[i].layer = static_cast<int16_t>(op.layer);
  }
  const plan::Region& step = plan.step;
  const uint32_t step_region = log.intern(step.name);
  std::vector<ScheduleBuffer> buffers(step.buffers.size());
  for (size_t i = 0; i < step.buffers.size(); i++) {
    const memory::BufferDesc& b = step.buffers[i];
    buffers[i] = {log.intern(b.name),     category(b.category), step_region,    b.bytes(),
                  step.layout.offsets[i], plan.first_op[i],     plan.last_op[i]};
  }
  recorder->set_schedule(std::move(ops), std::move(buffers), t_us);
  if (!persistent) return;
  for (const plan::Region& reg : plan.persistent) {
    const uint32_t region = log.intern(reg.name);
    for (size_t i = 0; i < reg.buffers.size(); i++) {
      const memory::BufferDesc& b = reg.buffers[i];
      recorder->alloc(t_us, log.intern(b.name), category(b.category), region, b.bytes(),
                      reg.layout.offsets[i]);
    }
  }
}

void begin_micro_batch(EventRecorder* recorder, const plan::MemoryPlan& plan, int step,
                       int micro_batch, double t_us) {
  const std::vector<ScheduleBuffer>& have = recorder->buffers();
  bool same = have.size() == plan.step.buffers.size() && recorder->ops().size() == plan.ops.size();
  for (size_t i = 0; same && i < have.size(); i++) {
    same = have[i].bytes == plan.step.buffers[i].bytes() &&
           have[i].offset == plan.step.layout.offsets[i] && have[i].first_op == plan.first_op[i] &&
           have[i].last_op == plan.last_op[i];
  }
  const bool replanned = !same && !have.empty();
  // A re-plan that note_replan() recorded: a "re-plan" marker after the last op of a training
  // micro-batch (the search runs only when the schedule changed: rarely).
  bool noted = false;
  if (replanned) {
    const EventLog& log = recorder->log();
    const uint32_t name = log.find("re-plan");
    for (auto it = log.events().rbegin(); it != log.events().rend(); ++it) {
      if (it->kind == EventKind::kMarker && it->name == name && name != EventLog::kNoName) {
        noted = true;
        break;
      }
      if ((it->kind == EventKind::kOpEnd || it->kind == EventKind::kOpBegin) &&
          it->micro_batch >= 0) {
        break;
      }
    }
  }
  if (!same) record_plan(plan, recorder, t_us, false);
  recorder->begin_micro_batch(step, micro_batch);
  if (replanned && !noted) {
    recorder->marker(t_us, "re-plan",
                     fmt::format("step region re-planned: micro-batch {} ({}), {} buffers in {} "
                                 "bytes, planned peak {} bytes",
                                 plan.policy.micro_batch, plan::describe_exec(plan.policy.exec),
                                 plan.step.buffers.size(), plan.step.layout.size, plan.peak_bytes),
                     "unknown");
  }
}

void record_op(EventRecorder* recorder, std::string_view name, EventPhase phase, int step,
               double begin_us, double end_us, uint8_t thread) {
  const uint32_t id = recorder->log().intern(name);
  recorder->begin_op(begin_us, id, phase, step, thread);
  recorder->end_op(end_us, id, phase, step, thread);
}

std::string_view replan_cause_name(ReplanCause c) {
  switch (c) {
    case ReplanCause::kBudget:
      return "budget";
    case ReplanCause::kOutOfMemory:
      return "out of memory";
    case ReplanCause::kResume:
      return "resume";
    case ReplanCause::kCostModel:
      return "cost model";
  }
  return "unknown";
}

void note_replan(EventRecorder* recorder, ReplanCause cause, bool changed, std::string_view detail,
                 int step, double t_us) {
  const char* name = changed ? "re-plan" : cause == ReplanCause::kResume ? "resume" : "plan kept";
  recorder->marker(t_us, name, detail, replan_cause_name(cause), step);
}

std::function<void(const memory::PoolEvent&)> pool_observer(
    EventRecorder* recorder, std::string_view served_region,
    std::chrono::steady_clock::time_point origin, const memory::PoolStats& now, double t_us) {
  EventLog& log = recorder->log();
  const uint32_t region = log.intern("pool"), block = log.intern(served_region),
                 chunk = log.intern("chunk");
  if (now.reserved > 0) {
    recorder->pool_event(EventKind::kPoolReserve, t_us, chunk,
                         log.intern(memory::category_name(memory::Category::kActivations)), region,
                         now.reserved, 0);
  }
  // Category names interned once: the observer runs per acquisition and must not hash strings.
  std::vector<uint32_t> categories(memory::kNumCategories);
  for (size_t i = 0; i < categories.size(); i++) {
    categories[i] = log.intern(memory::category_name(static_cast<memory::Category>(i)));
  }
  return [recorder, origin, region, block, chunk,
          categories = std::move(categories)](const memory::PoolEvent& e) {
    const double t =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin)
            .count();
    EventKind kind = EventKind::kPoolAcquire;
    switch (e.kind) {
      case memory::PoolEvent::Kind::kAcquire:
        kind = EventKind::kPoolAcquire;
        break;
      case memory::PoolEvent::Kind::kRelease:
        kind = EventKind::kPoolRelease;
        break;
      case memory::PoolEvent::Kind::kReserve:
        kind = EventKind::kPoolReserve;
        break;
      case memory::PoolEvent::Kind::kUnreserve:
        kind = EventKind::kPoolUnreserve;
        break;
    }
    const bool is_block = kind == EventKind::kPoolAcquire || kind == EventKind::kPoolRelease;
    recorder->pool_event(kind, t, is_block ? block : chunk, categories[size_t(e.category)], region,
                         e.bytes, e.offset);
  };
}

void TracedCommunicator::trace(EventRecorder* recorder,
                               std::chrono::steady_clock::time_point origin, EventPhase phase,
                               int step) {
  recorder_ = recorder;
  origin_ = origin;
  phase_ = phase;
  step_ = step;
  if (!recorder) return;
  EventLog& log = recorder->log();
  all_reduce_ = log.intern("all-reduce");
  reduce_scatter_ = log.intern("reduce-scatter");
  all_gather_ = log.intern("all-gather");
  broadcast_ = log.intern("broadcast");
  barrier_ = log.intern("barrier");
}

template <typename F>
Status TracedCommunicator::traced(uint32_t name, F&& call) {
  if (!recorder_) return call();
  auto us = [&] {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - origin_)
        .count();
  };
  recorder_->begin_op(us(), name, phase_, step_);
  Status s = call();
  recorder_->end_op(us(), name, phase_, step_);
  return s;
}

Status TracedCommunicator::all_reduce(float* data, int64_t n) {
  return traced(all_reduce_, [&] { return inner_->all_reduce(data, n); });
}
Status TracedCommunicator::all_reduce(double* data, int64_t n) {
  return traced(all_reduce_, [&] { return inner_->all_reduce(data, n); });
}
Status TracedCommunicator::all_reduce_min(int64_t* data, int64_t n) {
  return traced(all_reduce_, [&] { return inner_->all_reduce_min(data, n); });
}
Status TracedCommunicator::reduce_scatter(const float* send, float* recv,
                                          std::span<const int64_t> counts) {
  return traced(reduce_scatter_, [&] { return inner_->reduce_scatter(send, recv, counts); });
}
Status TracedCommunicator::all_gather(const float* send, float* recv,
                                      std::span<const int64_t> counts) {
  return traced(all_gather_, [&] { return inner_->all_gather(send, recv, counts); });
}
Status TracedCommunicator::broadcast(void* data, int64_t bytes, int root) {
  return traced(broadcast_, [&] { return inner_->broadcast(data, bytes, root); });
}
Status TracedCommunicator::barrier() {
  return traced(barrier_, [&] { return inner_->barrier(); });
}

}  // namespace headroom::train
