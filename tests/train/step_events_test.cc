// The event stream of real profiled training runs against the plan (plan_training_memory): in
// every micro-batch of every step each planned step buffer is allocated once when its first op
// begins and released once when its last op ends, at its planned offset, size and category; the
// persistent regions are allocated once at the start; every op begins and ends once per
// micro-batch, in schedule order; and no two buffers live at the same moment overlap.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
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
    EXPECT_GE(e.t_us, last_t) << "events out of time order at " << k;
    last_t = e.t_us;
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
  // One re-plan marker, at the start of step 1.
  int markers = 0;
  for (const Event& e : log.events()) {
    if (e.kind != EventKind::kMarker) continue;
    ++markers;
    EXPECT_EQ(log.name(e.name), "re-plan");
    EXPECT_NE(log.name(e.category).find("step region re-planned"), std::string::npos);
    EXPECT_EQ(e.step, 1);
  }
  EXPECT_EQ(markers, 1);
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
