// ZeRO-2/3 in the executor: gradient windows reduce-scattered on the communication thread while
// backward continues, and (stage 3) parameters gathered per block into window slots just before
// use, with the next block prefetched. See docs/notes/zero.md, "Windows in the executor".
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "core/status.h"
#include "dist/bucket_reducer.h"
#include "dist/comm_queue.h"
#include "dist/communicator.h"
#include "dist/param_gatherer.h"
#include "dist/shard.h"
#include "model/gpt2.h"
#include "plan/memory_plan.h"

namespace headroom::train {

// The six windows of one kind (sizes: plan::gpt2_zero_window_sizes), in this order: embedding
// (an untied LM head's unit takes turns with it there), ln_f, slot 0 decayed, slot 0 other,
// slot 1 decayed, slot 1 other (the plan's buffer order, plan_training_memory; block l uses
// slot l % 2).
using ZeroWindowPtrs = std::array<float*, 6>;

// The executor hooks (model::BlockHooks) of ZeRO stages 2 and 3 on one rank.
//
// Gradients (stages 2-3): before an op's backward, the windows of the units it writes are zeroed
// (after waiting for their previous reduction); after a block's backward (the head's, the
// embedding's) its units' windows are final and a reduce-scatter of each is submitted to the
// CommQueue: this rank's piece of the sum over ranks lands in `grad_shard` (laid out by
// `layout`, the optimizer's: flat for stage 2, per unit for stage 3). From the second micro-batch
// of a step on, the rank first adds its shard's current values into its own piece of the window,
// so the shard accumulates over micro-batches. Parameters: stage 2 reads the full buffer;
// stage 3 acquires a unit from `ParamGatherer` (gathering it unless prefetched) before the op and
// releases it after, prefetching the next block's units (forward: the next block, the head last;
// backward: the previous block; forward's head prefetches the last block for backward).
//
// Every rank makes the same hook calls in the same order, so the collectives on the queue match.
// A rank that cannot compute a micro-batch (an allocation failure) still owes the others its
// collectives: skip_micro_batch() makes the same calls without computing. Before any collective
// on the training thread (agree, the optimizer), call finish_step().
//
// Not thread-safe: the training thread calls everything; the queue's thread runs the collectives.
class ZeroWindows : public model::BlockHooks {
 public:
  // params: stage 2 the full buffer, stage 3 this rank's shard (layout-local). grad_shard: the
  // reduced-gradient shard (layout.local_floats()). param_windows: stage 3 only. Every buffer is
  // the memory of `ops`, which zeroes the windows and adds the shard into them (accumulation);
  // `comm` takes that memory (a device's: dist::StagingCommunicator or NCCL).
  ZeroWindows(int stage, dist::CommQueue* queue, dist::Communicator* comm,
              const model::ParamTable* table, const dist::ShardLayout* layout, float* params,
              float* grad_shard, ZeroWindowPtrs grad_windows,
              std::optional<ZeroWindowPtrs> param_windows,
              const backend::Ops& ops = backend::cpu_ops());
  ~ZeroWindows() override;

  // Before a step's first micro-batch: the next reductions overwrite the shard.
  void begin_step();
  // Before each forward: `training` false (validation) releases the head's units after forward
  // instead of keeping them for backward.
  void begin_micro_batch(bool training);
  // Makes the hook calls of one micro-batch (forward, and backward when training) without
  // computing: the collectives the other ranks expect.
  void skip_micro_batch(bool training);
  // Waits for every queued collective; returns the first failure of the step (a gather's or a
  // reduction's). Every unit must be released.
  Status finish_step();
  // Waits for the reductions submitted so far (before the training thread uses a gradient window
  // or calls a collective in the middle of a step: a checkpoint after a failure).
  void quiesce();

  void before(model::OpDesc::Phase phase, int layer) override;
  void after(model::OpDesc::Phase phase, int layer) override;
  float* param(size_t tensor) override;
  float* grad(size_t tensor) override;

  // For tests of the overlap: events in the order they happened, across both threads.
  struct Event {
    enum Kind { kBackwardBegin, kBackwardEnd, kReduceSubmit, kReduceBegin, kReduceEnd } kind;
    int layer;     // the block (or -1 embedding, n_layer head) the event is about
    uint64_t seq;  // global order (one atomic counter across both threads)
  };
  void set_record(bool on) { record_ = on; }
  std::vector<Event> events() const;

 private:
  using Phase = model::OpDesc::Phase;
  size_t window_of(size_t unit) const;  // 0..5
  void acquire(size_t unit, std::optional<size_t> next_a, std::optional<size_t> next_b);
  void release(size_t unit);
  void open_grad_window(size_t unit);
  void submit_reduction(size_t unit, int layer);
  Status reduce(size_t unit, int layer);
  void note(Event::Kind kind, int layer);

  int stage_;
  dist::CommQueue* queue_;
  dist::Communicator* comm_;
  const model::ParamTable* table_;
  const dist::ShardLayout* layout_;
  float* params_;
  float* grad_shard_;
  ZeroWindowPtrs grad_windows_;
  std::optional<ZeroWindowPtrs> param_windows_;
  int n_layer_;
  std::vector<dist::Range> units_;      // gpt2_zero_units
  std::vector<size_t> unit_of_tensor_;  // tensor -> unit
  // An untied LM head's unit (SIZE_MAX: tied): it takes turns with the embedding's in window 0.
  bool untied() const { return unit_h_ != SIZE_MAX; }
  size_t head_unit() const { return untied() ? unit_h_ : unit_e_; }
  size_t unit_e_ = 0, unit_f_ = 0, unit_h_ = SIZE_MAX;
  std::vector<size_t> unit_d_, unit_n_;  // per block
  std::vector<int> block_of_unit_;       // unit -> block, or -1
  std::array<size_t, 6> grad_owner_;     // window -> unit whose gradient it holds (SIZE_MAX: none)
  std::array<dist::CommQueue::Ticket, 6> grad_ticket_{};  // its last reduction
  std::vector<dist::CommQueue::Ticket> unit_ticket_;      // unit -> its last reduction this step
  const backend::Ops* ops_;
  dist::CommQueue::Ticket last_ticket_ = 0;  // the last reduction submitted
  std::optional<dist::ParamGatherer> gatherer_;
  bool training_ = true;
  bool accumulate_ = false;  // not the step's first micro-batch
  int micro_batch_ = 0;
  Status first_error_;
  bool record_ = false;
  std::vector<Event> events_;  // guarded by events_mu_
  mutable std::mutex events_mu_;
  std::atomic<uint64_t> seq_{0};
};

// Stages 0-1 with several ranks: the full gradient buffer stays (it accumulates over
// micro-batches), and in the step's last micro-batch each op's units (tensors of the reducer:
// gpt2_zero_units) are marked ready after its backward (the head: ln_f; block l: its two units;
// the embedding: wte + wpe, whose tied gradient is final last), so `reducer` launches complete
// buckets on the communication thread while backward continues. Parameters and gradients are
// the flat buffers. Not thread-safe (the training thread).
class BucketHooks : public model::BlockHooks {
 public:
  BucketHooks(const model::ParamTable* table, float* params, float* grads,
              dist::BucketReducer* reducer);
  // true in the step's last micro-batch: its backward's gradients are final.
  void set_active(bool on) { active_ = on; }

  void before(model::OpDesc::Phase, int) override {}
  void after(model::OpDesc::Phase phase, int layer) override;
  float* param(size_t tensor) override { return params_ + table_->params[tensor].offset; }
  float* grad(size_t tensor) override { return grads_ + table_->params[tensor].offset; }

 private:
  const model::ParamTable* table_;
  float* params_;
  float* grads_;
  dist::BucketReducer* reducer_;
  bool active_ = false;
  std::vector<std::vector<size_t>> units_of_site_;  // [layer + 1] -> units marked after it
};

// Gathers `layout`'s shard (this rank's `shard`) chunk by chunk through `staging` (at most
// staging_floats floats); with `full` non-null also copies each chunk to full + its offset (a
// host buffer of table size, e.g. rank 0's checkpoint copy; ops.copy_to_host: shard and staging
// are the memory of `ops`). A collective.
Status gather_through(dist::Communicator* comm, const dist::ShardLayout& layout, const float* shard,
                      float* staging, int64_t staging_floats, float* full,
                      const backend::Ops& ops = backend::cpu_ops());

}  // namespace headroom::train
