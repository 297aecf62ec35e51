// The event log and the recorder that turns op boundaries into memory events (event_log.h).
#include "core/event_log.h"

#include "core/check.h"

namespace headroom {

std::string_view event_kind_name(EventKind k) {
  switch (k) {
    case EventKind::kAlloc:
      return "alloc";
    case EventKind::kFree:
      return "free";
    case EventKind::kOpBegin:
      return "op_begin";
    case EventKind::kOpEnd:
      return "op_end";
    case EventKind::kMarker:
      return "marker";
    case EventKind::kPoolAcquire:
      return "pool_acquire";
    case EventKind::kPoolRelease:
      return "pool_release";
    case EventKind::kPoolReserve:
      return "pool_reserve";
    case EventKind::kPoolUnreserve:
      return "pool_unreserve";
  }
  return "?";
}

std::string_view event_phase_name(EventPhase p) {
  switch (p) {
    case EventPhase::kNone:
      return "";
    case EventPhase::kForward:
      return "forward";
    case EventPhase::kBackward:
      return "backward";
    case EventPhase::kOptimizer:
      return "optimizer";
    case EventPhase::kValidation:
      return "validation";
    case EventPhase::kData:
      return "data";
  }
  return "?";
}

uint32_t EventLog::intern(std::string_view s) {
  auto it = ids_.find(std::string(s));
  if (it != ids_.end()) return it->second;
  const uint32_t id = static_cast<uint32_t>(names_.size());
  names_.emplace_back(s);
  ids_.emplace(names_.back(), id);
  return id;
}

uint32_t EventLog::find(std::string_view s) const {
  auto it = ids_.find(std::string(s));
  return it == ids_.end() ? kNoName : it->second;
}

const std::string& EventLog::name(uint32_t id) const {
  static const std::string kEmpty;
  if (id == kNoName) return kEmpty;
  HR_CHECK(id < names_.size());
  return names_[id];
}

void EventRecorder::set_schedule(std::vector<ScheduleOp> ops, std::vector<ScheduleBuffer> buffers,
                                 double t_us) {
  release_live(t_us);
  in_micro_batch_ = false;
  cur_op_ = -1;
  ops_ = std::move(ops);
  buffers_ = std::move(buffers);
  const size_t n = ops_.size();
  // Counting sort of the buffers by first and by last op.
  begin_start_.assign(n + 1, 0);
  end_start_.assign(n + 1, 0);
  for (const ScheduleBuffer& b : buffers_) {
    HR_CHECK(0 <= b.first_op && b.first_op <= b.last_op && size_t(b.last_op) < n);
    begin_start_[size_t(b.first_op) + 1]++;
    end_start_[size_t(b.last_op) + 1]++;
  }
  for (size_t i = 0; i < n; i++) {
    begin_start_[i + 1] += begin_start_[i];
    end_start_[i + 1] += end_start_[i];
  }
  begin_list_.resize(buffers_.size());
  end_list_.resize(buffers_.size());
  std::vector<uint32_t> bfill(begin_start_.begin(), begin_start_.end() - 1);
  std::vector<uint32_t> efill(end_start_.begin(), end_start_.end() - 1);
  for (uint32_t i = 0; i < buffers_.size(); i++) {
    begin_list_[bfill[size_t(buffers_[i].first_op)]++] = i;
    end_list_[efill[size_t(buffers_[i].last_op)]++] = i;
  }
  live_.assign(buffers_.size(), 0);
  live_count_ = 0;
}

Event EventRecorder::context(double t_us, EventKind kind) const {
  Event e;
  e.t_us = t_us;
  e.kind = kind;
  e.step = step_;
  e.micro_batch = static_cast<int16_t>(in_micro_batch_ ? micro_batch_ : -1);
  e.op = cur_op_;
  e.op_name = EventLog::kNoName;
  if (cur_op_ >= 0 && size_t(cur_op_) < ops_.size()) {
    const ScheduleOp& op = ops_[size_t(cur_op_)];
    e.op_name = op.name;
    e.layer = op.layer;
    e.phase = in_micro_batch_ ? op.phase : EventPhase::kValidation;
  }
  return e;
}

void EventRecorder::append_buffer_event(EventKind kind, double t_us, const ScheduleBuffer& b) {
  Event e = context(t_us, kind);
  e.name = b.name;
  e.category = b.category;
  e.region = b.region;
  e.bytes = b.bytes;
  e.offset = b.offset;
  log_.append(e);
}

void EventRecorder::release_live(double t_us) {
  if (live_count_ == 0) return;
  for (uint32_t i = 0; i < buffers_.size(); i++) {
    if (!live_[i]) continue;
    append_buffer_event(EventKind::kFree, t_us, buffers_[i]);
    live_[i] = 0;
  }
  live_count_ = 0;
}

void EventRecorder::begin_micro_batch(int step, int micro_batch) {
  release_live(log_.empty() ? 0.0 : log_.events().back().t_us);
  step_ = step;
  micro_batch_ = micro_batch;
  in_micro_batch_ = true;
}

void EventRecorder::op_boundary(int ended, int next, double t_us) {
  if (ended >= 0 && size_t(ended) < ops_.size()) {
    cur_op_ = ended;
    if (in_micro_batch_) {
      for (uint32_t k = end_start_[size_t(ended)]; k < end_start_[size_t(ended) + 1]; k++) {
        const uint32_t i = end_list_[k];
        if (!live_[i]) continue;
        append_buffer_event(EventKind::kFree, t_us, buffers_[i]);
        live_[i] = 0;
        live_count_--;
      }
    }
    Event e = context(t_us, EventKind::kOpEnd);
    e.name = ops_[size_t(ended)].name;
    e.category = e.region = EventLog::kNoName;
    log_.append(e);
    // The schedule's last op ends the micro-batch: what follows (validation) is not training.
    if (in_micro_batch_ && size_t(ended) + 1 == ops_.size()) in_micro_batch_ = false;
  }
  cur_op_ = next >= 0 && size_t(next) < ops_.size() ? next : -1;
  if (cur_op_ < 0) return;
  Event e = context(t_us, EventKind::kOpBegin);
  e.name = ops_[size_t(next)].name;
  e.category = e.region = EventLog::kNoName;
  log_.append(e);
  if (!in_micro_batch_) return;
  for (uint32_t k = begin_start_[size_t(next)]; k < begin_start_[size_t(next) + 1]; k++) {
    const uint32_t i = begin_list_[k];
    if (live_[i]) continue;
    append_buffer_event(EventKind::kAlloc, t_us, buffers_[i]);
    live_[i] = 1;
    live_count_++;
  }
}

void EventRecorder::alloc(double t_us, uint32_t name, uint32_t category, uint32_t region,
                          uint64_t bytes, uint64_t offset) {
  Event e = context(t_us, EventKind::kAlloc);
  e.name = name;
  e.category = category;
  e.region = region;
  e.bytes = bytes;
  e.offset = offset;
  log_.append(e);
}

void EventRecorder::free(double t_us, uint32_t name, uint32_t category, uint32_t region,
                         uint64_t bytes, uint64_t offset) {
  Event e = context(t_us, EventKind::kFree);
  e.name = name;
  e.category = category;
  e.region = region;
  e.bytes = bytes;
  e.offset = offset;
  log_.append(e);
}

void EventRecorder::marker(double t_us, std::string_view name, std::string_view detail,
                           std::string_view cause, int step) {
  Event e = context(t_us, EventKind::kMarker);
  if (step != kCurrentStep) e.step = step;
  e.name = log_.intern(name);
  e.category = log_.intern(detail);
  e.region = cause.empty() ? EventLog::kNoName : log_.intern(cause);
  log_.append(e);
}

namespace {
Event unscheduled_op(EventKind kind, double t_us, uint32_t name, EventPhase phase, int step,
                     uint8_t thread) {
  Event e;
  e.t_us = t_us;
  e.kind = kind;
  e.name = name;
  e.op_name = name;
  e.phase = phase;
  e.step = step;
  e.thread = thread;
  return e;
}
}  // namespace

void EventRecorder::begin_op(double t_us, uint32_t name, EventPhase phase, int step,
                             uint8_t thread) {
  log_.append(unscheduled_op(EventKind::kOpBegin, t_us, name, phase, step, thread));
}

void EventRecorder::end_op(double t_us, uint32_t name, EventPhase phase, int step, uint8_t thread) {
  log_.append(unscheduled_op(EventKind::kOpEnd, t_us, name, phase, step, thread));
}

void EventRecorder::pool_event(EventKind kind, double t_us, uint32_t name, uint32_t category,
                               uint32_t region, uint64_t bytes, uint64_t offset) {
  HR_CHECK(is_pool_event(kind));
  Event e;
  e.t_us = t_us;
  e.kind = kind;
  e.name = name;
  e.category = category;
  e.region = region;
  e.bytes = bytes;
  e.offset = offset;
  e.step = pool_step_;
  e.micro_batch = static_cast<int16_t>(pool_micro_batch_);
  log_.append(e);
}

}  // namespace headroom
