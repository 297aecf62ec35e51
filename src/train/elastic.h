// Elastic micro-batching (issue #5): the step region's plan, re-chosen while training runs when
// the budget changes or an allocation fails, keeping the effective batch. The step region is
// acquired from a pool once per micro-batch, so an allocation failure surfaces at a micro-batch
// boundary, before any compute of that micro-batch. See docs/notes/elastic.md.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "memory/adaptors.h"
#include "memory/arena.h"
#include "memory/pool_resource.h"
#include "model/config.h"
#include "plan/device_spec.h"
#include "plan/memory_plan.h"
#include "plan/search.h"

namespace headroom::train {

// Reads a budget file: one size as `--device-memory` takes it ("2GiB", "512MiB"), surrounding
// whitespace ignored. Errors name the file and what it holds.
Result<uint64_t> read_budget_file(const std::string& path);

// The budget file of one rank: `path` with every `{rank}` replaced by the rank's number
// (`budget-{rank}.txt` -> `budget-1.txt`); a path without the placeholder is one file that every
// rank reads. See docs/notes/elastic.md, "Several ranks".
std::string budget_file_for_rank(const std::string& path, int rank);

// The device spec the trainer prices plans with when none is given (the planner's ranking only
// needs ratios; figures of a small CPU).
plan::DeviceSpec nominal_cpu_spec();

// Owns the pool that serves the step region, the current plan, and re-planning.
// Not thread-safe: the training thread calls it.
class ElasticStep {
 public:
  struct Setup {
    model::Gpt2Config config;
    plan::DeviceSpec device;
    int seq = 0;
    int global_batch = 0;  // G: sequences per optimizer step, fixed for the run
    // The validation staging's batch, in sequences (the run's first micro-batch); validation
    // runs it in pieces of any micro-batch (train/trainer.cc), so re-plans may grow past it.
    int max_micro_batch = 0;
    int head_chunk = 256;  // for a fused LM head
    // Tests: the 0-based indices of step-region acquisitions that fail as out of memory.
    std::vector<uint64_t> fail_acquisitions;
  };

  // `upstream` (the budgeted, tracked resource) must outlive this. `initial` is the plan the run
  // starts with; its persistent regions are allocated by the caller and stay for the run.
  ElasticStep(Setup setup, memory::MemoryResource* upstream, plan::MemoryPlan initial);

  const plan::MemoryPlan& plan() const { return plan_; }
  int micro_batch() const { return plan_.policy.micro_batch; }
  int accumulation() const { return plan_.policy.accumulation; }
  // The persistent regions as allocated plus the current step region.
  uint64_t planned_peak() const { return persistent_bytes_ + plan_.step_bytes; }
  double predicted_step_ms() const { return predicted_ms_; }
  // The device the plans are priced with; set_device() prices the current plan again (a
  // self-correction of the cost model: the next replan() ranks candidates with it).
  const plan::DeviceSpec& device() const { return setup_.device; }
  void set_device(const plan::DeviceSpec& device);
  memory::PoolStats pool_stats() const { return pool_.stats(); }
  uint64_t release_unused() { return pool_.release_unused(); }
  // Observes the step region's pool (memory::PoolResource::set_observer; the profiler's events).
  void set_pool_observer(std::function<void(const memory::PoolEvent&)> observer) {
    pool_.set_observer(std::move(observer));
  }
  uint64_t injected_failures() const { return failing_.failures(); }

  // The step region of the current plan, from the pool (through the failure injection, if set).
  // A release returns it to the pool, still reserved.
  Result<memory::Arena> acquire();
  // As acquire(), but never through the failure injection (the warm-up before step one).
  Result<memory::Arena> acquire_uninjected();
  // The step region of another plan of the same policy: a micro-batch shape of bucketed batching
  // (train/shape_plans.h), carved from the pool's free region when it fits there. `inject`:
  // through the failure injection, as acquire().
  Result<memory::Arena> acquire_shape(const plan::MemoryPlan& shape, bool inject = true);
  uint64_t persistent_bytes() const { return persistent_bytes_; }

  struct Replan {
    std::string change;        // "micro-batch 8 x 1 -> 4 x 2 (recompute none -> selective), ..."
    std::string alternatives;  // the plans that fit under the ceiling, one per line
    bool changed = false;      // the policy differs from the one before
  };
  // Chooses the fastest plan whose peak (with the persistent regions as allocated) is at most
  // `ceiling` and whose micro-batch divides `remaining` (the sequences of the step still to run).
  // Hands unused pool memory back when the new step region differs from the reserved one.
  // OutOfMemory, with the planner's advice, when nothing fits (the plan is kept).
  Result<Replan> replan(uint64_t ceiling, int remaining);

  // Issue #7's report of an allocation of the current plan that failed: what was asked for, the
  // budget, bytes live by category, the largest live buffers with their owners. (The planner's
  // alternatives come from replan(), which the caller runs next and appends.)
  std::string oom_report(const Status& cause, const std::string& where, uint64_t budget,
                         const memory::MemoryStats& live) const;

 private:
  std::string describe_policy(const plan::Policy& p) const;

  Setup setup_;
  memory::PoolResource pool_;
  memory::FailingResource failing_;
  plan::MemoryPlan plan_;
  uint64_t persistent_bytes_ = 0;
  double predicted_ms_ = 0;
  struct LiveBuffer {
    std::string name, owner;
    memory::Category category;
    uint64_t bytes;
  };
  std::vector<LiveBuffer> persistent_buffers_;  // largest first
};

}  // namespace headroom::train
