// ZeRO-3 parameter gathering: each unit (a layer's parameters) is all-gathered from the ranks'
// shards just before use, released after, and the next unit is prefetched on the communication
// thread while the current one computes.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "core/status.h"
#include "dist/comm_queue.h"
#include "dist/communicator.h"
#include "dist/shard.h"

namespace headroom::dist {

// Usage in a forward over units 0..L-1:
//   for (u = 0; u < L; ++u) { HR_RETURN_IF_ERROR(g.acquire(u, u + 1 < L ? u + 1 : none));
//                             run(u); g.release(u); }
// and in backward the same in reverse order. Every rank must acquire/prefetch the same units in
// the same order (they become collectives on the shared CommQueue, in submission order). So a
// rank whose step fails midway (out of memory) does not return at once: it acquires and
// releases the schedule's remaining units without computing, then the ranks agree() on the
// step's status (docs/notes/zero.md, "Failure").
//
// Not thread-safe: called from the training thread; the gathers run on the queue's thread and
// write only into the destination of the unit being gathered.
class ParamGatherer {
 public:
  // dst(u) is where unit u's full parameters go (layout.units()[u].size() floats): a slot of a
  // planned window, or full_params + unit.begin when the model reads one full-size buffer.
  // local_params: this rank's shard (layout.local_floats()); it must not change while a gather
  // is in flight (the optimizer runs after backward, when nothing is).
  ParamGatherer(CommQueue* queue, Communicator* comm, const ShardLayout* layout,
                const float* local_params, std::function<float*(size_t unit)> dst);
  // Waits for gathers still in flight (they write into dst and this object).
  ~ParamGatherer();
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  // Starts gathering unit u unless it is resident or in flight.
  void prefetch(size_t unit);
  // Returns once unit u is resident (gathering it now if nobody prefetched it); then starts the
  // prefetch of `next`. The status is the gather's.
  Status acquire(size_t unit, std::optional<size_t> next = std::nullopt);
  // Unit u's destination may be reused. REQUIRES: u resident (acquired), not in flight.
  void release(size_t unit);
  bool resident(size_t unit) const { return state_[unit] == State::kResident; }
  // Gathers, in flight or resident now (what the plan must hold at this moment).
  int live_units() const;
  // Total floats gathered so far (for communication accounting and tests).
  int64_t gathered_floats() const { return gathered_floats_; }

 private:
  enum class State { kReleased, kInFlight, kResident };

  CommQueue* queue_;
  Communicator* comm_;
  const ShardLayout* layout_;
  const float* local_;
  std::function<float*(size_t)> dst_;
  std::vector<State> state_;
  std::vector<CommQueue::Ticket> ticket_;
  std::vector<Status> result_;  // written by the queue's thread before its ticket completes
  int64_t gathered_floats_ = 0;
};

}  // namespace headroom::dist
