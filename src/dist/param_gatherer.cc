// ZeRO-3 gather/release with prefetch.
#include "dist/param_gatherer.h"

#include "core/check.h"

namespace headroom::dist {

ParamGatherer::ParamGatherer(CommQueue* queue, Communicator* comm, const ShardLayout* layout,
                             const float* local_params, std::function<float*(size_t)> dst)
    : queue_(queue), comm_(comm), layout_(layout), local_(local_params), dst_(std::move(dst)) {
  HR_CHECK(queue_ && comm_ && layout_ && dst_);
  HR_CHECK_MSG(layout_->ranks() == comm_->size() && layout_->rank() == comm_->rank(),
               "ParamGatherer: layout is not for this communicator");
  const size_t n = layout_->units().size();
  state_.assign(n, State::kReleased);
  ticket_.assign(n, 0);
  result_.assign(n, Status::ok());
}

ParamGatherer::~ParamGatherer() {
  for (size_t u = 0; u < state_.size(); ++u) {
    if (state_[u] == State::kInFlight) queue_->wait(ticket_[u]);
  }
}

void ParamGatherer::prefetch(size_t unit) {
  HR_CHECK(unit < state_.size());
  if (state_[unit] != State::kReleased) return;
  state_[unit] = State::kInFlight;
  float* dst = dst_(unit);
  const float* send = local_ + layout_->local_offset(unit);
  const std::vector<int64_t> counts = layout_->counts(unit);
  gathered_floats_ += layout_->units()[unit].size();
  ticket_[unit] = queue_->submit([this, unit, dst, send, counts] {
    Status s = comm_->all_gather(send, dst, counts);
    result_[unit] = s;
    return s;
  });
}

Status ParamGatherer::acquire(size_t unit, std::optional<size_t> next) {
  HR_CHECK(unit < state_.size());
  prefetch(unit);
  if (state_[unit] == State::kInFlight) {
    queue_->wait(ticket_[unit]);
    state_[unit] = State::kResident;
  }
  if (next) prefetch(*next);
  return result_[unit];
}

void ParamGatherer::release(size_t unit) {
  HR_CHECK(unit < state_.size());
  HR_CHECK_MSG(state_[unit] == State::kResident, "ParamGatherer::release: unit not acquired");
  state_[unit] = State::kReleased;
  result_[unit] = Status::ok();
}

int ParamGatherer::live_units() const {
  int n = 0;
  for (State s : state_) n += s != State::kReleased;
  return n;
}

}  // namespace headroom::dist
