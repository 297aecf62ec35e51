// ZeRO-2/3 executor hooks: gradient windows and per-block parameter gathering.
#include "train/zero_windows.h"

#include <algorithm>
#include <string>

#include "core/check.h"
#include "train/zero.h"

namespace headroom::train {

namespace {}  // namespace

ZeroWindows::ZeroWindows(int stage, dist::CommQueue* queue, dist::Communicator* comm,
                         const model::ParamTable* table, const dist::ShardLayout* layout,
                         float* params, float* grad_shard, ZeroWindowPtrs grad_windows,
                         std::optional<ZeroWindowPtrs> param_windows, const backend::Ops& ops)
    : stage_(stage),
      queue_(queue),
      comm_(comm),
      table_(table),
      layout_(layout),
      params_(params),
      grad_shard_(grad_shard),
      grad_windows_(grad_windows),
      param_windows_(param_windows),
      ops_(&ops) {
  HR_CHECK_MSG(stage == 2 || stage == 3, "ZeroWindows: stages 2 and 3 only");
  HR_CHECK(queue_ && comm_ && table_ && layout_ && params_);
  HR_CHECK_MSG(stage_ < 3 || param_windows_.has_value(), "ZeRO-3 needs parameter windows");
  units_ = gpt2_zero_units(*table_);
  unit_of_tensor_.assign(table_->params.size(), SIZE_MAX);
  block_of_unit_.assign(units_.size(), -1);
  n_layer_ = 0;
  for (const model::ParamDesc& p : table_->params) {
    const int g = table_->group_of(p);
    if (g != -1 && g != INT32_MAX) n_layer_ = std::max(n_layer_, g + 1);
  }
  unit_d_.assign(size_t(n_layer_), SIZE_MAX);
  unit_n_.assign(size_t(n_layer_), SIZE_MAX);
  for (size_t t = 0; t < table_->params.size(); ++t) {
    const model::ParamDesc& p = table_->params[t];
    size_t u = 0;
    while (!(units_[u].begin <= p.offset && p.offset < units_[u].end)) ++u;
    unit_of_tensor_[t] = u;
    const int g = table_->group_of(p);
    if (g == -1) {
      HR_CHECK_MSG(p.decay, "ZeroWindows: the embeddings are expected to be one decayed unit");
      unit_e_ = u;
    } else if (g == INT32_MAX) {
      (p.decay ? unit_h_ : unit_f_) = u;  // an untied LM head; the final norm
    } else {
      (p.decay ? unit_d_ : unit_n_)[size_t(g)] = u;
      block_of_unit_[u] = g;
    }
  }
  grad_owner_.fill(SIZE_MAX);
  unit_ticket_.assign(units_.size(), 0);
  if (stage_ == 3) {
    HR_CHECK_MSG(layout_->units() == units_, "ZeRO-3: the shard layout must be gpt2_zero_units");
    gatherer_.emplace(queue_, comm_, layout_, params_,
                      [this](size_t u) { return (*param_windows_)[window_of(u)]; });
  }
}

ZeroWindows::~ZeroWindows() { (void)queue_->wait_all(); }

size_t ZeroWindows::window_of(size_t unit) const {
  if (unit == unit_e_ || unit == unit_h_) return 0;
  if (unit == unit_f_) return 1;
  const int l = block_of_unit_[unit];
  HR_CHECK(l >= 0);
  return 2 + 2 * size_t(l % 2) + (unit == unit_d_[size_t(l)] ? 0 : 1);
}

void ZeroWindows::begin_step() {
  accumulate_ = false;
  micro_batch_ = 0;
}

void ZeroWindows::begin_micro_batch(bool training) {
  training_ = training;
  // A step's later micro-batches add into the shard the earlier ones reduced.
  accumulate_ = training && micro_batch_ > 0;
  if (training) ++micro_batch_;
}

void ZeroWindows::acquire(size_t unit, std::optional<size_t> next_a, std::optional<size_t> next_b) {
  Status s = gatherer_->acquire(unit, next_a);
  if (next_b) gatherer_->prefetch(*next_b);
  if (!s.is_ok() && first_error_.is_ok()) first_error_ = std::move(s);
}

void ZeroWindows::release(size_t unit) {
  if (gatherer_->resident(unit)) gatherer_->release(unit);
}

void ZeroWindows::before(Phase phase, int layer) {
  const int L = n_layer_;
  if (phase == Phase::kForward) {
    if (stage_ < 3) return;
    // An untied head's unit follows the final norm's wherever that is prefetched (it takes
    // the embedding's window, released after the embedding's forward).
    const std::optional<size_t> head = untied() ? std::optional(unit_h_) : std::optional<size_t>();
    if (layer == kEmbedding) {
      acquire(unit_e_, L > 0 ? std::optional(unit_d_[0]) : std::optional(unit_f_),
              L > 0 ? std::optional(unit_n_[0]) : std::nullopt);
    } else if (layer < L) {
      const bool last = layer + 1 == L;
      const size_t l = size_t(layer);
      acquire(unit_d_[l], last ? unit_f_ : unit_d_[l + 1], std::nullopt);
      acquire(unit_n_[l], last ? head : std::optional(unit_n_[l + 1]), std::nullopt);
    } else {
      // The head; in training the last block is prefetched for the backward that follows.
      const bool pre = training_ && L > 0;
      acquire(unit_f_, pre ? std::optional(unit_d_[size_t(L - 1)]) : std::nullopt,
              pre ? std::optional(unit_n_[size_t(L - 1)]) : std::nullopt);
      // A tied head reads wte, resident since the embedding; an untied one its own unit.
      acquire(head_unit(), std::nullopt, std::nullopt);
    }
    return;
  }
  // Backward: open the gradient windows this op writes; stage 3 acquires the block's units.
  note(Event::kBackwardBegin, layer);
  if (layer == kEmbedding) {
    // Tied: writes into the embedding window the head opened. Untied: the head's gradient has
    // been submitted from this window; opening waits for its reduction.
    if (untied()) open_grad_window(unit_e_);
    return;
  }
  if (layer == L) {
    open_grad_window(unit_f_);
    open_grad_window(head_unit());
    if (stage_ == 3) {
      acquire(unit_f_, std::nullopt, std::nullopt);
      acquire(head_unit(), std::nullopt, std::nullopt);
    }
    return;
  }
  const size_t l = size_t(layer);
  open_grad_window(unit_d_[l]);
  open_grad_window(unit_n_[l]);
  if (stage_ == 3) {
    const bool first = layer == 0;
    acquire(unit_d_[l], first ? std::nullopt : std::optional(unit_d_[l - 1]), std::nullopt);
    acquire(unit_n_[l], first ? std::nullopt : std::optional(unit_n_[l - 1]), std::nullopt);
  }
}

void ZeroWindows::after(Phase phase, int layer) {
  const int L = n_layer_;
  if (phase == Phase::kForward) {
    if (stage_ < 3) return;
    if (layer == kEmbedding) {
      if (untied()) release(unit_e_);  // the head's unit takes its window
    } else if (layer >= 0 && layer < L) {
      release(unit_d_[size_t(layer)]);
      release(unit_n_[size_t(layer)]);
    } else if (layer == L && !training_) {
      release(unit_f_);
      release(head_unit());
    }
    return;
  }
  note(Event::kBackwardEnd, layer);
  if (layer == kEmbedding) {
    submit_reduction(unit_e_, layer);  // wte's (tied) gradient is final now
  } else if (layer == L) {
    submit_reduction(unit_f_, layer);
    if (untied()) submit_reduction(unit_h_, layer);
    if (stage_ == 3) {
      release(unit_f_);
      release(head_unit());  // backward reads no embedding parameters
    }
  } else {
    const size_t l = size_t(layer);
    submit_reduction(unit_d_[l], layer);
    submit_reduction(unit_n_[l], layer);
    if (stage_ == 3) {
      release(unit_d_[l]);
      release(unit_n_[l]);
    }
  }
}

float* ZeroWindows::param(size_t tensor) {
  const model::ParamDesc& p = table_->params[tensor];
  if (stage_ < 3) return params_ + p.offset;
  const size_t u = unit_of_tensor_[tensor];
  HR_CHECK_MSG(gatherer_->resident(u), "ZeRO-3: a parameter was read outside its unit's window");
  return (*param_windows_)[window_of(u)] + (p.offset - units_[u].begin);
}

float* ZeroWindows::grad(size_t tensor) {
  const model::ParamDesc& p = table_->params[tensor];
  const size_t u = unit_of_tensor_[tensor];
  const size_t w = window_of(u);
  HR_CHECK_MSG(grad_owner_[w] == u, "ZeRO-2/3: a gradient was written outside its open window");
  return grad_windows_[w] + (p.offset - units_[u].begin);
}

void ZeroWindows::open_grad_window(size_t unit) {
  const size_t w = window_of(unit);
  // The window's previous reduction (two blocks later, or the last micro-batch) must be done.
  if (grad_ticket_[w] != 0) queue_->wait(grad_ticket_[w]);
  grad_ticket_[w] = 0;
  grad_owner_[w] = unit;
  ops_->zero(grad_windows_[w], units_[unit].size());
}

void ZeroWindows::submit_reduction(size_t unit, int layer) {
  const size_t w = window_of(unit);
  HR_CHECK(grad_owner_[w] == unit);
  note(Event::kReduceSubmit, layer);
  if (accumulate_) {
    // A step's later micro-batch: the shard so far joins this rank's contribution (its own
    // pieces of the window), so that the reduction sums it with the others'. Added here, on the
    // training thread, as an op of the table in the order of the step's other ops (on a GPU, on
    // the compute stream, before the collective that reads it), once the unit's previous
    // reduction wrote the shard (already done: opening the window waited for it).
    if (unit_ticket_[unit] != 0) queue_->wait(unit_ticket_[unit]);
    const dist::Range un = units_[unit];
    float* src = grad_windows_[w];
    const int me = comm_->rank();
    for (size_t ou = 0; ou < layout_->units().size(); ++ou) {
      const dist::Range lu = layout_->units()[ou];
      const dist::Range sub{std::max(un.begin, lu.begin), std::min(un.end, lu.end)};
      if (sub.empty()) continue;
      const dist::Range mine = layout_->piece(ou, me);
      const dist::Range own{std::max(sub.begin, mine.begin), std::min(sub.end, mine.end)};
      if (own.empty()) continue;
      float* recv = grad_shard_ + layout_->local_offset(ou) + (own.begin - mine.begin);
      float* mine_src = src + (own.begin - un.begin);
      ops_->residual_forward(mine_src, mine_src, recv, own.size());
    }
  }
  grad_ticket_[w] = queue_->submit([this, unit, layer] { return reduce(unit, layer); });
  unit_ticket_[unit] = grad_ticket_[w];
  last_ticket_ = grad_ticket_[w];
}

// Runs on the queue's thread. The unit's part in each optimizer-layout unit it overlaps is split
// among the ranks as that unit is (rank order): the segment layout of reduce_scatter.
Status ZeroWindows::reduce(size_t unit, int layer) {
  note(Event::kReduceBegin, layer);
  const dist::Range un = units_[unit];
  float* src = grad_windows_[window_of(unit)];
  const int me = comm_->rank(), R = comm_->size();
  std::vector<int64_t> counts(static_cast<size_t>(R));
  Status result;
  for (size_t ou = 0; ou < layout_->units().size() && result.is_ok(); ++ou) {
    const dist::Range lu = layout_->units()[ou];
    const dist::Range sub{std::max(un.begin, lu.begin), std::min(un.end, lu.end)};
    if (sub.empty()) continue;
    for (int r = 0; r < R; ++r) {
      const dist::Range p = layout_->piece(ou, r);
      counts[size_t(r)] =
          std::max<int64_t>(0, std::min(p.end, sub.end) - std::max(p.begin, sub.begin));
    }
    const dist::Range mine = layout_->piece(ou, me);
    float* recv = grad_shard_ + layout_->local_offset(ou) +
                  std::max<int64_t>(0, std::max(sub.begin, mine.begin) - mine.begin);
    result = comm_->reduce_scatter(src + (sub.begin - un.begin), recv, counts);
  }
  note(Event::kReduceEnd, layer);
  return result;
}

void ZeroWindows::skip_micro_batch(bool training) {
  begin_micro_batch(training);
  const int L = n_layer_;
  for (int l = kEmbedding; l <= L; ++l) {
    before(Phase::kForward, l);
    after(Phase::kForward, l);
  }
  if (!training) return;
  for (int l = L; l >= kEmbedding; --l) {
    before(Phase::kBackward, l);
    after(Phase::kBackward, l);
  }
}

void ZeroWindows::quiesce() {
  if (last_ticket_ != 0) queue_->wait(last_ticket_);
}

Status ZeroWindows::finish_step() {
  Status s = queue_->wait_all();
  if (gatherer_) HR_CHECK_MSG(gatherer_->live_units() == 0, "ZeRO-3: a unit was not released");
  grad_ticket_.fill(0);
  std::fill(unit_ticket_.begin(), unit_ticket_.end(), 0);
  last_ticket_ = 0;
  grad_owner_.fill(SIZE_MAX);
  Status first = std::move(first_error_);
  first_error_ = Status::ok();
  return first.is_ok() ? s : first;
}

void ZeroWindows::note(Event::Kind kind, int layer) {
  if (!record_) return;
  const uint64_t seq = seq_.fetch_add(1);
  std::lock_guard<std::mutex> lock(events_mu_);
  events_.push_back({kind, layer, seq});
}

std::vector<ZeroWindows::Event> ZeroWindows::events() const {
  std::lock_guard<std::mutex> lock(events_mu_);
  std::vector<Event> e = events_;
  std::sort(e.begin(), e.end(), [](const Event& a, const Event& b) { return a.seq < b.seq; });
  return e;
}

BucketHooks::BucketHooks(const model::ParamTable* table, float* params, float* grads,
                         dist::BucketReducer* reducer)
    : table_(table), params_(params), grads_(grads), reducer_(reducer) {
  HR_CHECK(table_ && params_ && grads_ && reducer_);
  const std::vector<dist::Range> units = gpt2_zero_units(*table_);
  int n_layer = 0;
  for (const model::ParamDesc& p : table_->params) {
    const int g = table_->group_of(p);
    if (g != -1 && g != INT32_MAX) n_layer = std::max(n_layer, g + 1);
  }
  // Sites: -1 embedding, 0..L-1 blocks, L the head (ln_f): index layer + 1.
  units_of_site_.assign(size_t(n_layer + 2), {});
  for (size_t u = 0; u < units.size(); ++u) {
    for (const model::ParamDesc& p : table_->params) {
      if (p.offset != units[u].begin) continue;
      const int g = table_->group_of(p);
      const int site = g == INT32_MAX ? n_layer : g;
      units_of_site_[size_t(site + 1)].push_back(u);
      break;
    }
  }
}

void BucketHooks::after(model::OpDesc::Phase phase, int layer) {
  if (!active_ || phase != model::OpDesc::Phase::kBackward) return;
  for (size_t u : units_of_site_[size_t(layer + 1)]) reducer_->mark_ready(u);
}

Status gather_through(dist::Communicator* comm, const dist::ShardLayout& layout, const float* shard,
                      float* staging, int64_t staging_floats, float* full,
                      const backend::Ops& ops) {
  HR_CHECK(staging_floats > 0);
  const int me = comm->rank(), R = comm->size();
  std::vector<int64_t> counts(static_cast<size_t>(R));
  for (size_t u = 0; u < layout.units().size(); ++u) {
    const dist::Range unit = layout.units()[u];
    const dist::Range mine = layout.piece(u, me);
    for (int64_t a = unit.begin; a < unit.end; a += staging_floats) {
      const dist::Range chunk{a, std::min(unit.end, a + staging_floats)};
      for (int r = 0; r < R; ++r) {
        const dist::Range p = layout.piece(u, r);
        counts[size_t(r)] =
            std::max<int64_t>(0, std::min(p.end, chunk.end) - std::max(p.begin, chunk.begin));
      }
      const float* send = shard + layout.local_offset(u) +
                          std::max<int64_t>(0, std::max(chunk.begin, mine.begin) - mine.begin);
      HR_RETURN_IF_ERROR(comm->all_gather(send, staging, counts));
      if (full) ops.copy_to_host(full + chunk.begin, staging, size_t(chunk.size()) * sizeof(float));
    }
  }
  return Status::ok();
}

}  // namespace headroom::train
