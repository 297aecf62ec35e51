// Gradient buckets reduced on the communication thread while backward continues: backward marks
// tensors ready as it finishes them; a bucket whose tensors are all ready is reduced at once
// (all-reduce for ZeRO 0/1, reduce-scatter into the rank's shard for ZeRO 2/3).
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "dist/comm_queue.h"
#include "dist/communicator.h"
#include "dist/shard.h"

namespace headroom::dist {

// Buckets for a backward that finishes `units` (contiguous ranges of the gradient buffer) in the
// given order: adjacent units are merged while the bucket stays under bucket_floats (a unit
// larger than that is a bucket of its own), and the buckets are returned in the order they
// complete, which is the order to launch them in. Each unit lies in exactly one bucket.
std::vector<Range> make_buckets(const std::vector<Range>& units_in_ready_order,
                                int64_t bucket_floats);

// Buckets are launched strictly in the order given (bucket i only after bucket i-1), like
// PyTorch DDP's reducer: readiness order could differ across ranks, launch order must not.
// Order the buckets as backward finishes them (last layers first) so that they go out early.
//
// Gradients are summed, not averaged: the trainer normalises the loss by the tokens of the
// whole optimizer step on all ranks (DESIGN.md principle 2), so the sum is the gradient.
//
// One object per optimizer step pattern; reusable: after wait() the next step starts afresh.
// Not thread-safe: mark_ready and wait come from the training thread.
class BucketReducer {
 public:
  enum class Mode {
    kAllReduce,      // grads[bucket] := sum over ranks, in place, on every rank
    kReduceScatter,  // the rank's pieces (per layout) of the bucket's sum land in `shard`
  };

  // grads: the flat gradient buffer the ranges index. tensors: what backward marks ready.
  // buckets: disjoint ranges of grads in launch order, each the union of whole tensors (every
  // tensor lies inside exactly one bucket). For kReduceScatter, layout and shard (the rank's
  // local gradient shard, layout->local_floats() floats) are required; a bucket may span units.
  // The queue, communicator, layout and buffers must outlive the reducer.
  BucketReducer(CommQueue* queue, Communicator* comm, Mode mode, float* grads,
                std::vector<Range> tensors, std::vector<Range> buckets,
                const ShardLayout* layout = nullptr, float* shard = nullptr);
  // Waits for this reducer's operations still in the queue (they point into it).
  ~BucketReducer();
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;

  // Backward has finished tensor t's gradient (for this step). Launches every bucket that is
  // now complete and next in order. REQUIRES: t not yet marked in this step.
  void mark_ready(size_t tensor);
  // Waits until every bucket has been reduced; returns the first failure. Resets for the next
  // step. REQUIRES: every tensor was marked (otherwise a bucket was never launched here, which
  // would leave the other ranks waiting: checked, aborts).
  Status wait();
  // Launches every bucket not launched yet, ready or not. For a rank whose step failed midway
  // (out of memory in backward): the other ranks are issuing these collectives, so it must too,
  // with whatever its buffer holds. Then wait(), agree() on the step's status, and every rank
  // discards the step. See docs/notes/zero.md ("Failure").
  void flush();

  size_t buckets_launched() const { return next_; }
  size_t num_buckets() const { return buckets_.size(); }

 private:
  void launch(size_t bucket);
  Status reduce_scatter_bucket(Range bucket);

  CommQueue* queue_;
  Communicator* comm_;
  Mode mode_;
  float* grads_;
  std::vector<Range> tensors_;
  std::vector<Range> buckets_;
  const ShardLayout* layout_;
  float* shard_;
  std::vector<size_t> bucket_of_;   // tensor -> bucket
  std::vector<size_t> tensors_in_;  // bucket -> number of its tensors
  std::vector<size_t> pending_;     // bucket -> tensors not yet marked this step
  std::vector<char> marked_;        // tensor -> marked this step
  size_t next_ = 0;                 // next bucket to launch
  CommQueue::Ticket last_ = 0;      // this reducer's last submitted operation
};

}  // namespace headroom::dist
