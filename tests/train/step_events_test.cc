// The event stream of real profiled training runs against the plan (plan_training_memory): in
// every micro-batch of every step each planned step buffer is allocated once when its first op
// begins and released once when its last op ends, at its planned offset, size and category; the
// persistent regions are allocated once at the start; every op begins and ends once per
// micro-batch, in schedule order; and no two buffers live at the same moment overlap. The pool
// block that holds the step region is acquired and released once per micro-batch (and per
// validation run), at the plan's step bytes, and is not counted again in the bytes the buffers
// add up to; the optimizer step (with its collective and the zeroing of the gradients inside it),
// the data wait and the loader's fill are ops of their phases.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "data/token_file.h"
#include "plan/memory_plan.h"
#include "train/step_events.h"
#include "train/trainer.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

std::string random_token_file(int vocab, int n) {
  std::string path = (fs::path(testing::TempDir()) / ("step_events_" + std::to_string(getpid()) +
                                                      "_" + std::to_string(vocab) + ".tok"))
                         .string();
  std::mt19937 rng(11);
  std::vector<int32_t> toks(static_cast<size_t>(n));
  for (auto& t : toks) t = int32_t(rng() % uint32_t(vocab - 1));
  for (size_t i = 50; i < toks.size(); i += 97) toks[i] = vocab - 1;
  EXPECT_TRUE(data::write_token_file(path, toks, vocab, vocab - 1, toks.size() / 97).is_ok());
  return path;
}

struct Case {
  int L, B, T, K;
  model::Recompute recompute = model::Recompute::kNone;
  int head_chunk = 0;
  bool tiled = true;
};

void check_run(const Case& c) {
  train::TrainOptions o;
  o.config.n_layer = c.L;
  o.config.n_embd = 64;
  o.config.n_head = 4;
  o.config.vocab_size = 257;
  o.config.n_positions = 64;
  o.model_name = "test";
  o.data = random_token_file(257, 20000);
  o.seq = c.T;
  o.micro_batch = c.B;
  o.accumulation = c.K;
  o.exec.tiled_attention = c.tiled;
  o.exec.head_chunk = c.head_chunk;
  if (c.recompute != model::Recompute::kNone) o.exec.recompute.assign(size_t(c.L), c.recompute);
  const int steps = 3;
  o.steps = steps;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 32;
  o.eval_batches = 1;
  o.eval_every = 1;  // validation after every step: its ops must not add memory events
  o.profile = true;
  Result<train::TrainResult> r = train::run_training(o, {});
  fs::remove(o.data);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_TRUE(r->profile.has_value());

  plan::Policy policy{c.B, c.K, c.T, "fp32", o.exec};
  Result<plan::MemoryPlan> planned = plan::plan_training_memory(o.config, policy);
  ASSERT_TRUE(planned.is_ok()) << planned.status().to_string();
  const plan::MemoryPlan& mp = *planned;
  const EventLog& log = r->profile->events.log();
  const std::vector<Event>& ev = log.events();
  const size_t nbuf = mp.step.buffers.size(), nops = mp.ops.size();
  ASSERT_GT(nbuf, 0u);

  // Persistent regions: one alloc each, before everything else, never freed.
  std::map<std::string, int> persistent_allocs;
  size_t persistent_count = 0;
  for (const plan::Region& reg : mp.persistent) {
    for (size_t i = 0; i < reg.buffers.size(); ++i) {
      ASSERT_LT(persistent_count, ev.size());
      const Event& e = ev[persistent_count++];
      EXPECT_EQ(e.kind, EventKind::kAlloc);
      EXPECT_EQ(log.name(e.name), reg.buffers[i].name);
      EXPECT_EQ(log.name(e.region), reg.name);
      EXPECT_EQ(log.name(e.category), memory::category_name(reg.buffers[i].category));
      EXPECT_EQ(e.bytes, reg.buffers[i].bytes());
      EXPECT_EQ(e.offset, reg.layout.offsets[i]);
      EXPECT_EQ(e.t_us, 0.0);
    }
  }

  // The pool: before the recording, the step region's chunk was reserved (the warm-up); one
  // reserve event of exactly that at time 0, right after the persistent buffers.
  const uint64_t block_bytes = (mp.step.layout.size + 63) / 64 * 64;
  ASSERT_LT(persistent_count, ev.size());
  {
    const Event& e = ev[persistent_count++];
    EXPECT_EQ(e.kind, EventKind::kPoolReserve);
    EXPECT_EQ(e.bytes, block_bytes);
    EXPECT_EQ(log.name(e.region), "pool");
    EXPECT_EQ(e.t_us, 0.0);
  }
  // Pool blocks per (step, micro-batch; -1 for validation): acquisitions and releases.
  std::map<std::pair<int, int>, std::pair<int, int>> blocks;
  bool block_held = false;
  // Ops outside the schedule, per (step, name, thread): begins and ends.
  std::map<std::tuple<int, std::string, int>, std::pair<int, int>> unscheduled;
  double last_loader_t = 0;
  std::map<std::pair<int, std::string>, std::pair<double, double>> op_time;  // begin, end

  // Per (step, micro-batch): where each buffer was allocated and freed (event indices).
  struct Seen {
    std::vector<int> allocs, frees;
  };
  std::map<std::pair<int, int>, std::vector<Seen>> seen;
  std::map<std::pair<int, int>, std::vector<int>> op_order;  // op_begin sequence
  std::map<std::pair<int, int>, int> op_ends;
  std::vector<int> live_at(nbuf, -1);  // event index of the live alloc, per buffer
  uint64_t live_bytes = 0, max_live = 0;
  double last_t = 0;
  for (size_t k = persistent_count; k < ev.size(); ++k) {
    const Event& e = ev[k];
    // Time order per thread (the loader's fills are appended when their batch is taken).
    double& last = e.thread == kEventThreadLoader ? last_loader_t : last_t;
    EXPECT_GE(e.t_us, last) << "events out of time order at " << k;
    last = e.t_us;
    if (is_pool_event(e.kind)) {
      EXPECT_EQ(log.name(e.region), "pool");
      // No chunk comes or goes: the plan never changes, so its one chunk serves every block.
      ASSERT_TRUE(e.kind == EventKind::kPoolAcquire || e.kind == EventKind::kPoolRelease)
          << event_kind_name(e.kind) << " at " << k;
      EXPECT_EQ(log.name(e.name), mp.step.name);
      EXPECT_EQ(e.bytes, block_bytes);
      EXPECT_EQ(e.bytes, (mp.step_bytes + 63) / 64 * 64);
      EXPECT_EQ(e.offset, 0u);
      auto& b = blocks[{e.step, e.micro_batch}];
      if (e.kind == EventKind::kPoolAcquire) {
        EXPECT_FALSE(block_held) << "a second block while one is held, at " << k;
        block_held = true;
        b.first++;
      } else {
        EXPECT_TRUE(block_held) << "a release without a block, at " << k;
        block_held = false;
        b.second++;
      }
      continue;
    }
    if ((e.kind == EventKind::kOpBegin || e.kind == EventKind::kOpEnd) && e.op < 0) {
      const std::string name = log.name(e.name);
      if (e.thread == kEventThreadLoader) {
        EXPECT_EQ(name, "load batch");
      } else {
        EXPECT_TRUE(name == "optimizer step" || name == "zero gradients" || name == "all-reduce" ||
                    name == "wait for data")
            << name;
      }
      EXPECT_EQ(e.phase, name == "wait for data" || name == "load batch" ? EventPhase::kData
                                                                         : EventPhase::kOptimizer);
      EXPECT_EQ(e.micro_batch, -1);
      EXPECT_FALSE(block_held) << name << " while the step region is held";
      auto& u = unscheduled[{e.step, name, e.thread}];
      (e.kind == EventKind::kOpBegin ? u.first : u.second)++;
      auto& span = op_time[{e.step, name}];
      (e.kind == EventKind::kOpBegin ? span.first : span.second) = e.t_us;
      continue;
    }
    // Training and validation ops and their buffers run inside a pool block.
    EXPECT_TRUE(block_held) << event_kind_name(e.kind) << " outside the step region's block at "
                            << k;
    if (e.kind == EventKind::kOpBegin || e.kind == EventKind::kOpEnd) {
      ASSERT_GE(e.op, 0);
      ASSERT_LT(size_t(e.op), nops);
      EXPECT_EQ(log.name(e.name), mp.ops[size_t(e.op)].name);
      EXPECT_EQ(e.layer, mp.ops[size_t(e.op)].layer);
      if (e.micro_batch < 0) {
        EXPECT_EQ(e.phase, EventPhase::kValidation);
        continue;
      }
      const auto key = std::make_pair(int(e.step), int(e.micro_batch));
      if (e.kind == EventKind::kOpBegin) op_order[key].push_back(e.op);
      if (e.kind == EventKind::kOpEnd) op_ends[key]++;
      continue;
    }
    // A memory event of a step buffer, inside a training micro-batch.
    ASSERT_GE(e.micro_batch, 0) << "memory event outside a micro-batch at " << k;
    ASSERT_GE(e.step, 0);
    EXPECT_EQ(log.name(e.region), "step");
    size_t b = nbuf;
    for (size_t i = 0; i < nbuf; ++i) {
      if (mp.step.buffers[i].name == log.name(e.name)) b = i;
    }
    ASSERT_LT(b, nbuf) << "an event for a buffer the plan does not have: " << log.name(e.name);
    const memory::BufferDesc& d = mp.step.buffers[b];
    EXPECT_EQ(e.bytes, d.bytes()) << d.name;
    EXPECT_EQ(e.offset, mp.step.layout.offsets[b]) << d.name;
    EXPECT_EQ(log.name(e.category), memory::category_name(d.category)) << d.name;
    auto& s = seen[{e.step, e.micro_batch}];
    s.resize(nbuf);
    if (e.kind == EventKind::kAlloc) {
      EXPECT_EQ(e.op, mp.first_op[b]) << d.name;
      s[b].allocs.push_back(int(k));
      // No live buffer overlaps this one's bytes.
      for (size_t i = 0; i < nbuf; ++i) {
        if (live_at[i] < 0) continue;
        const uint64_t lo = mp.step.layout.offsets[i], hi = lo + mp.step.buffers[i].bytes();
        EXPECT_TRUE(e.offset >= hi || e.offset + e.bytes <= lo)
            << d.name << " overlaps live " << mp.step.buffers[i].name;
      }
      EXPECT_LT(live_at[b], 0) << d.name << " allocated twice";
      live_at[b] = int(k);
      live_bytes += e.bytes;
      max_live = std::max(max_live, live_bytes);
    } else {
      EXPECT_EQ(e.op, mp.last_op[b]) << d.name;
      s[b].frees.push_back(int(k));
      EXPECT_GE(live_at[b], 0) << d.name << " freed while not live";
      live_at[b] = -1;
      live_bytes -= e.bytes;
    }
    const model::OpDesc& op = mp.ops[size_t(e.op)];
    EXPECT_EQ(e.phase, op.phase == model::OpDesc::Phase::kForward ? EventPhase::kForward
                                                                  : EventPhase::kBackward);
    EXPECT_EQ(e.layer, op.layer);
  }
  EXPECT_EQ(live_bytes, 0u) << "buffers left live at the end";
  EXPECT_FALSE(block_held) << "the step region's block is still held at the end";

  // One block per micro-batch and one per validation run (after every step), each released.
  std::map<std::pair<int, int>, std::pair<int, int>> want_blocks;
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < c.K; ++m) want_blocks[{s, m}] = {1, 1};
    want_blocks[{s, -1}] = {1, 1};
  }
  EXPECT_EQ(blocks, want_blocks);
  // The optimizer step, the data wait and the loader's fill: once per step, begun and ended.
  std::map<std::tuple<int, std::string, int>, std::pair<int, int>> want_ops;
  for (int s = 0; s < steps; ++s) {
    want_ops[{s, "optimizer step", kEventThreadTraining}] = {1, 1};
    want_ops[{s, "all-reduce", kEventThreadTraining}] = {1, 1};  // ZeRO-0's gradient all-reduce
    want_ops[{s, "zero gradients", kEventThreadTraining}] = {1, 1};
    want_ops[{s, "wait for data", kEventThreadTraining}] = {1, 1};
    want_ops[{s, "load batch", kEventThreadLoader}] = {1, 1};
  }
  EXPECT_EQ(unscheduled, want_ops);
  // The optimizer step's parts lie inside it.
  for (int s = 0; s < steps; ++s) {
    const auto whole = op_time[{s, "optimizer step"}];
    for (const char* part : {"all-reduce", "zero gradients"}) {
      const auto p = op_time[{s, part}];
      EXPECT_LE(whole.first, p.first) << part;
      EXPECT_LE(p.first, p.second) << part;
      EXPECT_LE(p.second, whole.second) << part;
    }
  }

  // The bytes-by-category total (alloc/free events only: what the report stacks) peaks at the
  // persistent regions plus the plan's largest column, not doubled by the block around them.
  uint64_t total = 0, max_total = 0;
  for (const Event& e : ev) {
    if (e.kind == EventKind::kAlloc) total += e.bytes;
    if (e.kind == EventKind::kFree) total -= e.bytes;
    max_total = std::max(max_total, total);
  }

  // Every micro-batch of every step: each buffer exactly once, alloc before free; every op once,
  // in order.
  ASSERT_EQ(seen.size(), size_t(steps * c.K));
  for (int s = 0; s < steps; ++s) {
    for (int m = 0; m < c.K; ++m) {
      SCOPED_TRACE(::testing::Message() << "step " << s << " micro-batch " << m);
      const auto& v = seen[{s, m}];
      ASSERT_EQ(v.size(), nbuf);
      for (size_t b = 0; b < nbuf; ++b) {
        ASSERT_EQ(v[b].allocs.size(), 1u) << mp.step.buffers[b].name;
        ASSERT_EQ(v[b].frees.size(), 1u) << mp.step.buffers[b].name;
        EXPECT_LT(v[b].allocs[0], v[b].frees[0]) << mp.step.buffers[b].name;
        EXPECT_LE(ev[size_t(v[b].allocs[0])].t_us, ev[size_t(v[b].frees[0])].t_us);
      }
      std::vector<int> want(nops);
      for (size_t i = 0; i < nops; ++i) want[i] = int(i);
      const auto key = std::make_pair(s, m);
      EXPECT_EQ(op_order[key], want);
      EXPECT_EQ(op_ends[key], int(nops));
    }
  }
  // The most step bytes live at once is the plan's: the largest column of its timeline.
  uint64_t planned_max = 0;
  for (size_t op = 0; op < nops; ++op) {
    planned_max = std::max(planned_max, plan::live_bytes_at(mp, int(op)));
  }
  EXPECT_EQ(max_live, planned_max);
  EXPECT_LE(max_live, mp.step_bytes);
  uint64_t persistent_bytes = 0;
  for (const plan::Region& reg : mp.persistent) {
    for (const memory::BufferDesc& b : reg.buffers) persistent_bytes += b.bytes();
  }
  EXPECT_EQ(max_total, persistent_bytes + planned_max);
}

TEST(StepEvents, EveryPlannedBufferOncePerMicroBatch) { check_run({2, 2, 16, 2}); }
TEST(StepEvents, SelectiveRecompute) { check_run({2, 2, 16, 2, model::Recompute::kSelective}); }
TEST(StepEvents, FullRecompute) { check_run({3, 2, 16, 3, model::Recompute::kFull}); }
TEST(StepEvents, FusedHeadAndPlainAttention) {
  check_run({2, 3, 32, 1, model::Recompute::kNone, 16, false});
}
TEST(StepEvents, FusedHeadWithFullRecompute) {
  check_run({2, 2, 16, 2, model::Recompute::kFull, 8});
}

// An out-of-memory recovery re-plans the step region while the run goes on (docs/notes/
// elastic.md): the micro-batches after it are recorded with the new plan's step buffers (a
// different set, sizes or offsets: the new plan peaks lower), every buffer still allocated and
// released once per micro-batch, and live buffers never overlap.
TEST(StepEvents, AReplanSwitchesTheSchedule) {
  train::TrainOptions o;
  o.config.n_layer = 2;
  o.config.n_embd = 64;
  o.config.n_head = 4;
  o.config.vocab_size = 257;
  o.config.n_positions = 64;
  o.model_name = "test";
  o.data = random_token_file(257, 20000);
  o.seq = 16;
  o.micro_batch = 4;
  o.steps = 2;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 32;
  o.eval_batches = 1;
  o.profile = true;
  o.fail_step_allocations = {1};  // step 1's first micro-batch (step 0 runs the first plan)
  Result<train::TrainResult> r = train::run_training(o, {});
  fs::remove(o.data);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const EventLog& log = r->profile->events.log();
  struct Live {
    uint64_t offset, bytes;
    std::string name;
  };
  using Signature = std::set<std::tuple<std::string, uint64_t, uint64_t>>;  // name, bytes, offset
  std::map<std::pair<int, int>, Signature> allocs_of, frees_of;
  std::vector<Live> live;
  for (const Event& e : log.events()) {
    if ((e.kind != EventKind::kAlloc && e.kind != EventKind::kFree) || e.step < 0) continue;
    const std::string name = log.name(e.name);
    const auto key = std::make_pair(int(e.step), int(e.micro_batch));
    if (e.kind == EventKind::kAlloc) {
      EXPECT_TRUE(allocs_of[key].insert({name, e.bytes, e.offset}).second) << name << " twice";
      for (const Live& l : live) {
        EXPECT_TRUE(e.offset >= l.offset + l.bytes || e.offset + e.bytes <= l.offset)
            << name << " overlaps live " << l.name;
      }
      live.push_back({e.offset, e.bytes, name});
    } else {
      EXPECT_TRUE(frees_of[key].insert({name, e.bytes, e.offset}).second) << name << " twice";
      auto it = std::find_if(live.begin(), live.end(), [&](const Live& l) {
        return l.name == name && l.offset == e.offset && l.bytes == e.bytes;
      });
      ASSERT_NE(it, live.end()) << name << " freed while not live";
      live.erase(it);
    }
  }
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(allocs_of, frees_of);
  // Step 0 ran the first plan, step 1 another.
  plan::Policy policy{4, 1, 16, "fp32", o.exec};
  Result<plan::MemoryPlan> first = plan::plan_training_memory(o.config, policy);
  ASSERT_TRUE(first.is_ok());
  Signature planned;
  for (size_t i = 0; i < first->step.buffers.size(); ++i) {
    planned.insert({first->step.buffers[i].name, first->step.buffers[i].bytes(),
                    first->step.layout.offsets[i]});
  }
  ASSERT_TRUE(allocs_of.count({0, 0}));
  ASSERT_TRUE(allocs_of.count({1, 0}));
  EXPECT_EQ(allocs_of[std::make_pair(0, 0)], planned);
  EXPECT_NE(allocs_of[std::make_pair(1, 0)], planned);
  // One re-plan marker, at the start of step 1, caused by the allocation failure.
  int markers = 0;
  for (const Event& e : log.events()) {
    if (e.kind != EventKind::kMarker) continue;
    ++markers;
    EXPECT_EQ(log.name(e.name), "re-plan");
    EXPECT_EQ(log.name(e.region), "out of memory");
    EXPECT_NE(log.name(e.category).find("out of memory at micro-batch 1"), std::string::npos)
        << log.name(e.category);
    EXPECT_NE(log.name(e.category).find("re-planned micro-batch 4 x 1"), std::string::npos)
        << log.name(e.category);
    EXPECT_EQ(e.step, 1);
  }
  EXPECT_EQ(markers, 1);
  // The pool: the failed acquisition never reached it (the failure is injected above it); the
  // old plan's chunk is handed back at the re-plan and the new one reserved, and every block
  // acquired is released at its plan's size.
  int acquired = 0, released = 0, reserves = 0, unreserves = 0;
  uint64_t held = 0;
  std::set<uint64_t> block_sizes;
  for (const Event& e : log.events()) {
    acquired += e.kind == EventKind::kPoolAcquire;
    released += e.kind == EventKind::kPoolRelease;
    reserves += e.kind == EventKind::kPoolReserve;
    unreserves += e.kind == EventKind::kPoolUnreserve;
    if (e.kind == EventKind::kPoolAcquire) block_sizes.insert(e.bytes);
    if (e.kind == EventKind::kPoolReserve) held += e.bytes;
    if (e.kind == EventKind::kPoolUnreserve) {
      ASSERT_GE(held, e.bytes);
      held -= e.bytes;
    }
  }
  EXPECT_EQ(acquired, released);
  // One block per training micro-batch (as many as had allocations) and one for the validation
  // at the end.
  EXPECT_EQ(size_t(acquired), allocs_of.size() + 1);
  EXPECT_EQ(unreserves, 1);
  EXPECT_EQ(reserves, 2);
  EXPECT_EQ(block_sizes.size(), 2u);
}

// A budget change that re-plans and a resumed run leave markers that say their cause (and the
// budget change its old -> new budget); the pool hands the old plan's chunk back and reserves
// the new one.
TEST(StepEvents, ReplanMarkersSayTheirCause) {
  const fs::path dir =
      fs::path(testing::TempDir()) / ("step_events_cause_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  train::TrainOptions o;
  o.config.n_layer = 2;
  o.config.n_embd = 64;
  o.config.n_head = 4;
  o.config.vocab_size = 257;
  o.config.n_positions = 64;
  o.model_name = "test";
  o.data = random_token_file(257, 20000);
  o.seq = 16;
  o.micro_batch = 4;
  o.steps = 3;
  o.warmup_steps = 1;
  o.eval_batches = 1;
  o.profile = true;
  o.out_dir = (dir / "out").string();
  o.save_every = 1;
  // A budget between the plans of micro-batch 2 and 4: from step 2 on, the run must re-plan.
  plan::Policy p4{4, 1, 16, "fp32", o.exec}, p2{2, 2, 16, "fp32", o.exec};
  Result<plan::MemoryPlan> plan4 = plan::plan_training_memory(o.config, p4);
  Result<plan::MemoryPlan> plan2 = plan::plan_training_memory(o.config, p2);
  ASSERT_TRUE(plan4.is_ok() && plan2.is_ok());
  const uint64_t tight = plan4->persistent_bytes + (plan2->step_bytes + plan4->step_bytes) / 2;
  o.device_memory_file = (dir / "budget").string();
  auto write_budget = [&](uint64_t bytes) {
    std::ofstream f(o.device_memory_file, std::ios::trunc);
    f << bytes << "\n";
  };
  write_budget(uint64_t(1) << 30);
  o.device_memory = uint64_t(1) << 30;
  train::TrainCallbacks cb;
  cb.on_step = [&](const train::StepStats& st) {
    if (st.step == 1) write_budget(tight);
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_GE(r->replans, 1);
  const EventLog& log = r->profile->events.log();
  std::vector<const Event*> markers;
  int unreserves = 0;
  for (const Event& e : log.events()) {
    if (e.kind == EventKind::kMarker) markers.push_back(&e);
    unreserves += e.kind == EventKind::kPoolUnreserve;
  }
  ASSERT_EQ(markers.size(), 1u);
  EXPECT_EQ(log.name(markers[0]->name), "re-plan");
  EXPECT_EQ(log.name(markers[0]->region), "budget");
  EXPECT_EQ(markers[0]->step, 1);
  const std::string detail = log.name(markers[0]->category);
  EXPECT_NE(detail.find("budget 1.00 GiB -> "), std::string::npos) << detail;
  EXPECT_NE(detail.find("re-planned"), std::string::npos) << detail;
  EXPECT_EQ(unreserves, 1);  // the old step region's chunk, handed back at the re-plan

  // Resumed from the checkpoint of step 2 (under the tight budget, with that plan's micro-batch
  // and accumulation), one step more: the resume is marked, at step 2, and nothing else.
  train::TrainOptions resumed = o;
  resumed.resume = (dir / "out").string();
  resumed.steps = 4;
  resumed.device_memory_file.clear();
  resumed.device_memory = uint64_t(1) << 30;
  Result<train::TrainResult> r2 = Status::internal("not run");
  for (int b : {1, 2, 4}) {  // the checkpoint's micro-batch (the re-plan chose it)
    resumed.micro_batch = b;
    resumed.accumulation = 4 / b;
    r2 = train::run_training(resumed, {});
    if (r2.is_ok()) break;
  }
  fs::remove(o.data);
  fs::remove_all(dir);
  ASSERT_TRUE(r2.is_ok()) << r2.status().to_string();
  const EventLog& log2 = r2->profile->events.log();
  int resumes = 0;
  for (const Event& e : log2.events()) {
    if (e.kind != EventKind::kMarker) continue;
    ++resumes;
    EXPECT_EQ(log2.name(e.name), "resume");
    EXPECT_EQ(log2.name(e.region), "resume");
    EXPECT_EQ(e.step, 3);
    EXPECT_NE(log2.name(e.category).find("resumed at step 3"), std::string::npos)
        << log2.name(e.category);
  }
  EXPECT_EQ(resumes, 1);
}

// Without --profile nothing is recorded (the model's recorder pointer stays null).
TEST(StepEvents, NothingWithoutProfile) {
  train::TrainOptions o;
  o.config.n_layer = 1;
  o.config.n_embd = 32;
  o.config.n_head = 2;
  o.config.vocab_size = 101;
  o.config.n_positions = 16;
  o.model_name = "test";
  o.data = random_token_file(101, 5000);
  o.seq = 8;
  o.micro_batch = 1;
  o.steps = 1;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 30;
  o.eval_batches = 1;
  Result<train::TrainResult> r = train::run_training(o, {});
  fs::remove(o.data);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_FALSE(r->profile.has_value());
}

}  // namespace
}  // namespace headroom
