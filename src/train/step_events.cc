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
  if (!same) record_plan(plan, recorder, t_us, false);
  recorder->begin_micro_batch(step, micro_batch);
  if (replanned) {
    recorder->marker(t_us, "re-plan",
                     fmt::format("step region re-planned: micro-batch {} ({}), {} buffers in {} "
                                 "bytes, planned peak {} bytes",
                                 plan.policy.micro_batch, plan::describe_exec(plan.policy.exec),
                                 plan.step.buffers.size(), plan.step.layout.size, plan.peak_bytes));
  }
}

}  // namespace headroom::train
