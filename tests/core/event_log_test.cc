// The event recorder against a known schedule: op boundaries become one alloc at the first op's
// begin and one free at the last op's end for every buffer, with the op's context; validation
// ops (outside a micro-batch) record no memory events; a new schedule or an interrupted
// micro-batch releases what is still live. The plan-driven version is tests/train.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "core/event_log.h"

namespace headroom {
namespace {

// Ops: f0 f1 (forward, layers 0 1), b1 b0 (backward, layers 1 0). Buffers: x [0,3] at 0,
// y [1,2] at 64, w [2,2] at 128, z [3,3] at 64.
EventRecorder make_recorder() {
  EventRecorder r;
  EventLog& log = r.log();
  const uint32_t act = log.intern("activations"), ws = log.intern("workspace");
  const uint32_t step = log.intern("step");
  r.set_schedule({{log.intern("f0"), EventPhase::kForward, 0},
                  {log.intern("f1"), EventPhase::kForward, 1},
                  {log.intern("b1"), EventPhase::kBackward, 1},
                  {log.intern("b0"), EventPhase::kBackward, 0}},
                 {{log.intern("x"), act, step, 64, 0, 0, 3},
                  {log.intern("y"), act, step, 32, 64, 1, 2},
                  {log.intern("w"), ws, step, 16, 128, 2, 2},
                  {log.intern("z"), ws, step, 8, 64, 3, 3}});
  return r;
}

// Runs one micro-batch the way Gpt2 does: forward ops, a gap, backward ops.
void run_micro_batch(EventRecorder& r, int step, int mb, double t0) {
  r.begin_micro_batch(step, mb);
  r.op_boundary(-1, 0, t0);
  r.op_boundary(0, 1, t0 + 1);
  r.op_boundary(1, -1, t0 + 2);
  r.op_boundary(-1, 2, t0 + 3);
  r.op_boundary(2, 3, t0 + 4);
  r.op_boundary(3, -1, t0 + 5);
}

std::string describe(const EventLog& log, const Event& e) {
  return std::string(event_kind_name(e.kind)) + " " + log.name(e.name) + " @" +
         std::to_string(int(e.t_us)) + " op" + std::to_string(e.op) + " " +
         std::string(event_phase_name(e.phase)) + " L" + std::to_string(e.layer) + " s" +
         std::to_string(e.step) + " m" + std::to_string(e.micro_batch);
}

TEST(EventRecorder, OneMicroBatchInOrderWithContext) {
  EventRecorder r = make_recorder();
  run_micro_batch(r, 3, 1, 10);
  std::vector<std::string> got;
  for (const Event& e : r.log().events()) got.push_back(describe(r.log(), e));
  const std::vector<std::string> want = {
      "op_begin f0 @10 op0 forward L0 s3 m1",  "alloc x @10 op0 forward L0 s3 m1",
      "op_end f0 @11 op0 forward L0 s3 m1",    "op_begin f1 @11 op1 forward L1 s3 m1",
      "alloc y @11 op1 forward L1 s3 m1",      "op_end f1 @12 op1 forward L1 s3 m1",
      "op_begin b1 @13 op2 backward L1 s3 m1", "alloc w @13 op2 backward L1 s3 m1",
      "free y @14 op2 backward L1 s3 m1",      "free w @14 op2 backward L1 s3 m1",
      "op_end b1 @14 op2 backward L1 s3 m1",   "op_begin b0 @14 op3 backward L0 s3 m1",
      "alloc z @14 op3 backward L0 s3 m1",     "free x @15 op3 backward L0 s3 m1",
      "free z @15 op3 backward L0 s3 m1",      "op_end b0 @15 op3 backward L0 s3 m1"};
  EXPECT_EQ(got, want);
  EXPECT_FALSE(r.in_micro_batch());
  // Sizes, offsets, categories and regions are the schedule's.
  for (const Event& e : r.log().events()) {
    if (e.kind != EventKind::kAlloc && e.kind != EventKind::kFree) {
      EXPECT_EQ(e.bytes, 0u);
      EXPECT_EQ(e.category, EventLog::kNoName);
      continue;
    }
    const std::string& n = r.log().name(e.name);
    const std::map<std::string, std::pair<uint64_t, uint64_t>> planned = {
        {"x", {64, 0}}, {"y", {32, 64}}, {"w", {16, 128}}, {"z", {8, 64}}};
    EXPECT_EQ(e.bytes, planned.at(n).first) << n;
    EXPECT_EQ(e.offset, planned.at(n).second) << n;
    EXPECT_EQ(r.log().name(e.category), n == "x" || n == "y" ? "activations" : "workspace");
    EXPECT_EQ(r.log().name(e.region), "step");
  }
}

TEST(EventRecorder, ValidationOpsRecordNoMemoryEvents) {
  EventRecorder r = make_recorder();
  run_micro_batch(r, 0, 0, 0);
  const size_t after_training = r.log().size();
  // Validation: the forward ops only, outside a micro-batch.
  r.op_boundary(-1, 0, 100);
  r.op_boundary(0, 1, 101);
  r.op_boundary(1, -1, 102);
  ASSERT_EQ(r.log().size(), after_training + 4);
  for (size_t i = after_training; i < r.log().size(); ++i) {
    const Event& e = r.log().events()[i];
    EXPECT_TRUE(e.kind == EventKind::kOpBegin || e.kind == EventKind::kOpEnd);
    EXPECT_EQ(e.phase, EventPhase::kValidation);
    EXPECT_EQ(e.micro_batch, -1);
    EXPECT_EQ(e.step, 0);
  }
}

TEST(EventRecorder, InterruptedMicroBatchAndNewScheduleReleaseWhatIsLive) {
  EventRecorder r = make_recorder();
  r.begin_micro_batch(0, 0);
  r.op_boundary(-1, 0, 1);
  r.op_boundary(0, 1, 2);  // x and y live
  r.begin_micro_batch(0, 1);
  int allocs = 0, frees = 0;
  for (const Event& e : r.log().events()) {
    allocs += e.kind == EventKind::kAlloc;
    frees += e.kind == EventKind::kFree;
  }
  EXPECT_EQ(allocs, 2);
  EXPECT_EQ(frees, 2);
  EXPECT_EQ(r.log().events().back().t_us, 2);
  r.op_boundary(-1, 0, 3);  // x live again
  r.set_schedule({}, {}, 4);
  EXPECT_EQ(r.log().events().back().kind, EventKind::kFree);
  EXPECT_EQ(r.log().name(r.log().events().back().name), "x");
  EXPECT_EQ(r.log().events().back().t_us, 4);
  EXPECT_FALSE(r.in_micro_batch());
}

TEST(EventRecorder, OutsideAllocationsTakeTheCurrentContext) {
  EventRecorder r = make_recorder();
  EventLog& log = r.log();
  r.alloc(0, log.intern("wte"), log.intern("weights"), log.intern("parameters"), 100, 0);
  EXPECT_EQ(log.events().back().op, -1);
  EXPECT_EQ(log.events().back().step, -1);
  EXPECT_EQ(log.events().back().phase, EventPhase::kNone);
  r.begin_micro_batch(2, 0);
  r.op_boundary(-1, 1, 5);
  r.free(6, log.intern("block"), log.intern("workspace"), log.intern("pool"), 4096, 8192);
  const Event& e = log.events().back();
  EXPECT_EQ(e.kind, EventKind::kFree);
  EXPECT_EQ(e.op, 1);
  EXPECT_EQ(log.name(e.op_name), "f1");
  EXPECT_EQ(e.step, 2);
  EXPECT_EQ(e.layer, 1);
  EXPECT_EQ(e.offset, 8192u);
  r.marker(7, "re-plan", "micro-batch 4 -> 2");
  const Event& m = log.events().back();
  EXPECT_EQ(m.kind, EventKind::kMarker);
  EXPECT_EQ(log.name(m.name), "re-plan");
  EXPECT_EQ(log.name(m.category), "micro-batch 4 -> 2");
  EXPECT_EQ(m.step, 2);
  EXPECT_EQ(m.t_us, 7);
}

// Ops outside the schedule, pool events and markers with a cause carry their own context.
TEST(EventRecorder, UnscheduledOpsPoolEventsAndCauses) {
  EventRecorder r;
  EventLog& log = r.log();
  r.set_schedule({{log.intern("f0"), EventPhase::kForward, 0}}, {});
  r.begin_micro_batch(3, 1);
  r.op_boundary(-1, 0, 1);
  const uint32_t opt = log.intern("optimizer step");
  r.begin_op(2, opt, EventPhase::kOptimizer, 3);
  r.end_op(4, opt, EventPhase::kOptimizer, 3);
  r.begin_op(0.5, log.intern("load batch"), EventPhase::kData, 4, kEventThreadLoader);
  const std::vector<Event>& ev = log.events();
  ASSERT_EQ(ev.size(), 4u);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_EQ(ev[i].op, -1);
    EXPECT_EQ(ev[i].name, opt);
    EXPECT_EQ(ev[i].op_name, opt);
    EXPECT_EQ(ev[i].phase, EventPhase::kOptimizer);
    EXPECT_EQ(ev[i].step, 3);
    EXPECT_EQ(ev[i].micro_batch, -1);
    EXPECT_EQ(ev[i].layer, -1);
    EXPECT_EQ(ev[i].thread, kEventThreadTraining);
  }
  EXPECT_EQ(ev[1].kind, EventKind::kOpBegin);
  EXPECT_EQ(ev[2].kind, EventKind::kOpEnd);
  EXPECT_EQ(ev[3].thread, kEventThreadLoader);
  EXPECT_EQ(ev[3].step, 4);
  EXPECT_EQ(event_phase_name(ev[3].phase), "data");

  r.set_pool_context(5, 2);
  r.pool_event(EventKind::kPoolAcquire, 6, log.intern("step"), log.intern("activations"),
               log.intern("pool"), 4096, 64);
  const Event& p = log.events().back();
  EXPECT_EQ(event_kind_name(p.kind), "pool_acquire");
  EXPECT_TRUE(is_pool_event(p.kind));
  EXPECT_EQ(p.step, 5);
  EXPECT_EQ(p.micro_batch, 2);
  EXPECT_EQ(p.op, -1);
  EXPECT_EQ(p.bytes, 4096u);
  EXPECT_EQ(p.offset, 64u);
  EXPECT_FALSE(is_pool_event(EventKind::kAlloc));

  r.marker(7, "re-plan", "budget 2 GiB -> 1 GiB", "budget", 6);
  const Event& m = log.events().back();
  EXPECT_EQ(log.name(m.region), "budget");
  EXPECT_EQ(m.step, 6);
  r.marker(8, "re-plan", "no cause");
  EXPECT_EQ(log.events().back().region, EventLog::kNoName);
  EXPECT_EQ(log.events().back().step, 3);  // the context's
  EXPECT_EQ(log.find("budget"), m.region);
  EXPECT_EQ(log.find("never interned"), EventLog::kNoName);
}

TEST(EventLog, InternsOnce) {
  EventLog log;
  const uint32_t a = log.intern("a"), b = log.intern("b");
  EXPECT_NE(a, b);
  EXPECT_EQ(log.intern("a"), a);
  EXPECT_EQ(log.name(b), "b");
  EXPECT_EQ(log.name(EventLog::kNoName), "");
  EXPECT_EQ(log.names().size(), 2u);
}

}  // namespace
}  // namespace headroom
