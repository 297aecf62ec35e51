// Bucketed gradient reduction.
#include "dist/bucket_reducer.h"

#include <algorithm>
#include <string>

#include "core/check.h"

namespace headroom::dist {

std::vector<Range> make_buckets(const std::vector<Range>& units_in_ready_order,
                                int64_t bucket_floats) {
  struct Open {
    Range range;
    size_t last;  // index (ready order) of its last unit: the bucket completes then
  };
  std::vector<Open> buckets;
  for (size_t i = 0; i < units_in_ready_order.size(); ++i) {
    const Range u = units_in_ready_order[i];
    bool merged = false;
    for (Open& b : buckets) {
      const bool adjacent = b.range.end == u.begin || u.end == b.range.begin;
      if (adjacent && b.range.size() + u.size() <= bucket_floats) {
        b.range = {std::min(b.range.begin, u.begin), std::max(b.range.end, u.end)};
        b.last = i;
        merged = true;
        break;
      }
    }
    if (!merged) buckets.push_back({u, i});
  }
  std::stable_sort(buckets.begin(), buckets.end(),
                   [](const Open& a, const Open& b) { return a.last < b.last; });
  std::vector<Range> out;
  for (const Open& b : buckets) out.push_back(b.range);
  return out;
}

BucketReducer::BucketReducer(CommQueue* queue, Communicator* comm, Mode mode, float* grads,
                             std::vector<Range> tensors, std::vector<Range> buckets,
                             const ShardLayout* layout, float* shard)
    : queue_(queue),
      comm_(comm),
      mode_(mode),
      grads_(grads),
      tensors_(std::move(tensors)),
      buckets_(std::move(buckets)),
      layout_(layout),
      shard_(shard) {
  HR_CHECK(queue_ != nullptr && comm_ != nullptr);
  if (mode_ == Mode::kReduceScatter) {
    HR_CHECK_MSG(
        layout_ != nullptr && layout_->ranks() == comm_->size() && layout_->rank() == comm_->rank(),
        "BucketReducer: reduce-scatter needs a layout for this communicator");
    HR_CHECK_MSG(shard_ != nullptr || layout_->local_floats() == 0,
                 "BucketReducer: reduce-scatter needs the shard buffer");
  }
  bucket_of_.assign(tensors_.size(), SIZE_MAX);
  tensors_in_.assign(buckets_.size(), 0);
  for (size_t t = 0; t < tensors_.size(); ++t) {
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (tensors_[t].begin >= buckets_[b].begin && tensors_[t].end <= buckets_[b].end) {
        HR_CHECK_MSG(bucket_of_[t] == SIZE_MAX, "BucketReducer: buckets overlap");
        bucket_of_[t] = b;
        ++tensors_in_[b];
      }
    }
    HR_CHECK_MSG(bucket_of_[t] != SIZE_MAX, "BucketReducer: a tensor lies in no bucket");
  }
  pending_ = tensors_in_;
  marked_.assign(tensors_.size(), 0);
  // Empty buckets are complete from the start.
  while (next_ < buckets_.size() && pending_[next_] == 0) launch(next_++);
}

BucketReducer::~BucketReducer() {
  if (last_ != 0) queue_->wait(last_);
}

void BucketReducer::flush() {
  while (next_ < buckets_.size()) launch(next_++);
}

void BucketReducer::mark_ready(size_t tensor) {
  HR_CHECK(tensor < tensors_.size());
  HR_CHECK_MSG(!marked_[tensor], "BucketReducer: tensor marked ready twice in one step");
  marked_[tensor] = 1;
  --pending_[bucket_of_[tensor]];
  while (next_ < buckets_.size() && pending_[next_] == 0) launch(next_++);
}

Status BucketReducer::wait() {
  if (next_ != buckets_.size()) {
    std::string msg = "BucketReducer::wait: bucket " + std::to_string(next_) + " of " +
                      std::to_string(buckets_.size()) + " has tensors never marked ready";
    HR_CHECK_MSG(false, msg.c_str());
  }
  Status s = queue_->wait_all();
  pending_ = tensors_in_;
  std::fill(marked_.begin(), marked_.end(), 0);
  next_ = 0;
  while (next_ < buckets_.size() && pending_[next_] == 0) launch(next_++);
  return s;
}

void BucketReducer::launch(size_t bucket) {
  const Range r = buckets_[bucket];
  if (mode_ == Mode::kAllReduce) {
    last_ = queue_->submit([this, r] { return comm_->all_reduce(grads_ + r.begin, r.size()); });
  } else {
    last_ = queue_->submit([this, r] { return reduce_scatter_bucket(r); });
  }
}

// The bucket's part in each unit is split among the ranks as the unit is (rank order), which is
// exactly the segment layout of Communicator::reduce_scatter.
Status BucketReducer::reduce_scatter_bucket(Range bucket) {
  const int me = comm_->rank();
  std::vector<int64_t> counts(size_t(comm_->size()));
  for (size_t u = 0; u < layout_->units().size(); ++u) {
    const Range unit = layout_->units()[u];
    const Range sub{std::max(bucket.begin, unit.begin), std::min(bucket.end, unit.end)};
    if (sub.empty()) continue;
    for (int r = 0; r < comm_->size(); ++r) {
      const Range p = layout_->piece(u, r);
      counts[size_t(r)] =
          std::max<int64_t>(0, std::min(p.end, sub.end) - std::max(p.begin, sub.begin));
    }
    const Range mine = layout_->piece(u, me);
    float* recv = shard_ + layout_->local_offset(u) +
                  std::max<int64_t>(0, std::max(sub.begin, mine.begin) - mine.begin);
    HR_RETURN_IF_ERROR(comm_->reduce_scatter(grads_ + sub.begin, recv, counts));
  }
  return Status::ok();
}

}  // namespace headroom::dist
