// The offset planner: known optima, random instances checked by verify_offsets and against a
// plain O(n^2) best fit, transformer training schedules within 5% of the lower bound, and
// verify_offsets catching broken plans.
#include "memory/offset_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/units.h"
#include "memory/arena.h"
#include "memory/host_resource.h"

namespace headroom::memory {
namespace {

bool meet(const LiveRange& a, const LiveRange& b) { return a.first <= b.last && b.first <= a.last; }

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// What the planner must compute, written the obvious way: for each buffer, scan every buffer
// placed before it, keep those whose lifetimes meet, sort them by offset and take the smallest
// gap that fits. O(n^2 log n); the planner's time index must give the very same offsets.
std::vector<uint64_t> plain_best_fit(const std::vector<LiveRange>& b,
                                     const std::vector<uint32_t>& order) {
  std::vector<uint64_t> offsets(b.size(), 0);
  std::vector<uint32_t> placed;
  for (uint32_t i : order) {
    uint64_t need = footprint(b[i]);
    if (need == 0) continue;
    std::vector<uint32_t> hit;
    for (uint32_t j : placed)
      if (meet(b[i], b[j])) hit.push_back(j);
    std::sort(hit.begin(), hit.end(), [&](uint32_t x, uint32_t y) {
      return offsets[x] < offsets[y] || (offsets[x] == offsets[y] && x < y);
    });
    uint64_t top = 0, best = 0, best_gap = UINT64_MAX;
    bool found = false;
    for (uint32_t j : hit) {
      if (offsets[j] > top) {
        uint64_t at = round_up(top, b[i].alignment);
        if (at + need <= offsets[j] && offsets[j] - top < best_gap) {
          best_gap = offsets[j] - top;
          best = at;
          found = true;
        }
      }
      top = std::max(top, offsets[j] + footprint(b[j]));
    }
    offsets[i] = found ? best : round_up(top, b[i].alignment);
    placed.push_back(i);
  }
  return offsets;
}

std::vector<LiveRange> random_instance(std::mt19937_64& rng, int n, int ops) {
  std::vector<LiveRange> b(n);
  for (LiveRange& r : b) {
    int kind = int(rng() % 10);
    r.bytes = kind == 0 ? 0 : kind < 4 ? rng() % 200 : 64 * (1 + rng() % 64) + rng() % 3;
    r.alignment = uint64_t(1) << (rng() % 8);
    r.first = int32_t(rng() % ops);
    r.last = r.first + int32_t(rng() % (ops - r.first));
  }
  return b;
}

void expect_valid(const std::vector<LiveRange>& b, const OffsetPlan& plan) {
  Status s = verify_offsets(b, plan);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_GE(plan.size, plan.lower_bound);
  EXPECT_EQ(plan.lower_bound, live_bytes_lower_bound(b));
  for (size_t i = 0; i < b.size(); i++) {
    EXPECT_EQ(plan.offsets[i] % b[i].alignment, 0u);
    EXPECT_LE(plan.offsets[i] + footprint(b[i]), plan.size);
    if (b[i].bytes == 0) {
      EXPECT_EQ(plan.offsets[i], 0u);
    }
  }
}

// Known optima ------------------------------------------------------------------------------

TEST(OffsetPlanner, EmptyInput) {
  OffsetPlan plan = plan_offsets({});
  EXPECT_TRUE(plan.offsets.empty());
  EXPECT_EQ(plan.size, 0u);
  EXPECT_EQ(plan.lower_bound, 0u);
  EXPECT_TRUE(verify_offsets({}, plan).is_ok());
}

TEST(OffsetPlanner, DisjointLifetimesShareOneRange) {
  std::vector<LiveRange> b = {
      {1000, 64, 0, 0}, {5000, 64, 1, 2}, {300, 64, 3, 3}, {4096, 64, 4, 9}};
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_EQ(plan.size, round_up(5000, 64));
  EXPECT_EQ(plan.size, plan.lower_bound);
  for (uint64_t off : plan.offsets) EXPECT_EQ(off, 0u);
}

TEST(OffsetPlanner, AllOverlappingNeedTheSum) {
  std::vector<LiveRange> b;
  uint64_t sum = 0;
  for (int i = 0; i < 50; i++) {
    b.push_back({uint64_t(100 + 37 * i), 64, i % 3, 10 + i % 4});  // all live at ops 2..10
    sum += round_up(100 + 37 * i, 64);
  }
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_EQ(plan.size, sum);
  EXPECT_EQ(plan.lower_bound, sum);
}

TEST(OffsetPlanner, ChainReusesMemory) {
  // Each op reads the previous buffer and writes the next: two buffers live at a time, and the
  // optimum ping-pongs between two slots.
  std::vector<LiveRange> b;
  for (int i = 0; i < 20; i++) b.push_back({4096, 64, i, i + 1});
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_EQ(plan.size, 2 * 4096u);
  EXPECT_EQ(plan.lower_bound, 2 * 4096u);
}

TEST(OffsetPlanner, ZeroByteBuffersTakeNothing) {
  std::vector<LiveRange> b = {{0, 64, 0, 5}, {128, 64, 0, 5}, {0, 4096, 2, 3}, {64, 64, 1, 1}};
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_EQ(plan.offsets[0], 0u);
  EXPECT_EQ(plan.offsets[2], 0u);
  EXPECT_EQ(plan.size, 192u);
}

TEST(OffsetPlanner, RespectsMixedAlignments) {
  // A 1-byte-aligned buffer first would push the 4096-aligned one to 4096 if alignment were
  // ignored in gap search; the footprints are what gets reserved.
  std::vector<LiveRange> b = {{3, 1, 0, 4}, {4096, 4096, 0, 4}, {10, 8, 2, 3}, {70, 64, 1, 2}};
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_EQ(plan.offsets[1] % 4096, 0u);
  EXPECT_EQ(plan.offsets[2] % 8, 0u);
  EXPECT_EQ(plan.offsets[3] % 64, 0u);
}

TEST(OffsetPlanner, LowerBoundCountsFootprintsAtThePeak) {
  std::vector<LiveRange> b = {{10, 64, 0, 1}, {100, 64, 1, 2}, {1000, 8, 3, 3}};
  // Op 1: 64 + 128 live; op 3: 1000.
  EXPECT_EQ(live_bytes_lower_bound(b), 1000u);
  b[2].bytes = 100;
  EXPECT_EQ(live_bytes_lower_bound(b), 192u);
}

TEST(OffsetPlanner, OnlyOrderOfOpsMatters) {
  // Sparse, negative and huge op indices renumber to the same problem.
  std::vector<LiveRange> a = {{100, 64, 0, 1}, {200, 64, 1, 2}, {300, 64, 3, 3}};
  std::vector<LiveRange> b = {
      {100, 64, -50, 7}, {200, 64, 7, 1 << 30}, {300, 64, INT32_MAX, INT32_MAX}};
  OffsetPlan pa = plan_offsets(a), pb = plan_offsets(b);
  EXPECT_EQ(pa.offsets, pb.offsets);
  EXPECT_EQ(pa.size, pb.size);
  expect_valid(b, pb);
}

TEST(OffsetPlanner, PlanBuildsAnArena) {
  std::vector<BufferDesc> descs;
  std::vector<LiveRange> b;
  for (int i = 0; i < 8; i++) {
    descs.push_back(
        {"act" + std::to_string(i), DType::kF32, Shape{64, 16 + i}, Category::kActivations});
    b.push_back({descs.back().bytes(), kBufferAlignment, i, i + 2});
  }
  OffsetPlan plan = plan_offsets(b);
  expect_valid(b, plan);
  EXPECT_LT(plan.size, sequential_layout(descs).size);
  HostResource host;
  Result<Arena> arena = Arena::create(&host, descs, plan.layout(), Category::kActivations);
  ASSERT_TRUE(arena.is_ok()) << arena.status().to_string();
  EXPECT_EQ(arena->size(), plan.size);
  for (size_t i = 0; i < b.size(); i++) std::memset(arena->data(i), int(i), b[i].bytes);
}

// Random instances -------------------------------------------------------------------------

TEST(OffsetPlanner, RandomSmallInstancesAreValid) {
  std::mt19937_64 rng(20240611);
  for (int trial = 0; trial < 4000; trial++) {
    int n = 1 + int(rng() % 40);
    std::vector<LiveRange> b = random_instance(rng, n, 1 + int(rng() % 20));
    OffsetPlan plan = plan_offsets(b);
    ASSERT_NO_FATAL_FAILURE(expect_valid(b, plan)) << "trial " << trial;
  }
}

TEST(OffsetPlanner, TimeIndexMatchesPlainBestFit) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 1000; trial++) {
    int n = 1 + int(rng() % 60);
    std::vector<LiveRange> b = random_instance(rng, n, 1 + int(rng() % 30));
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    std::shuffle(order.begin(), order.end(), rng);
    OffsetPlan plan = plan_offsets_in_order(b, order, "shuffled");
    ASSERT_EQ(plan.offsets, plain_best_fit(b, order)) << "trial " << trial;
    EXPECT_EQ(plan.strategy, "shuffled");
    ASSERT_NO_FATAL_FAILURE(expect_valid(b, plan));
  }
}

TEST(OffsetPlanner, RandomLargeInstancesAreValid) {
  std::mt19937_64 rng(99);
  for (int ops : {50, 2000, 100000}) {
    std::vector<LiveRange> b = random_instance(rng, 4000, ops);
    OffsetPlan plan = plan_offsets(b);
    ASSERT_NO_FATAL_FAILURE(expect_valid(b, plan)) << "ops " << ops;
  }
}

TEST(OffsetPlanner, Deterministic) {
  std::mt19937_64 rng(3);
  std::vector<LiveRange> b = random_instance(rng, 500, 100);
  OffsetPlan a = plan_offsets(b), c = plan_offsets(b);
  EXPECT_EQ(a.offsets, c.offsets);
  EXPECT_EQ(a.strategy, c.strategy);
}

// Transformer training schedules --------------------------------------------------------------

enum class Recompute { kNone, kFull, kEveryOther };

// One optimizer step of a chain of `layers` blocks over `micro_batches` micro-batches (gradient
// accumulation). Sizes follow a GPT block at bf16 with tokens = b*t, width C, heads NH, vocab V:
// per layer the saved activations (layer input, ln1, qkv, attention probabilities, attention
// output, ln2, fc, gelu), forward scratch, backward gradient ping-pong and scratch, per-layer
// weight gradients (fp32, live from the first backward of the layer to the optimizer), fp32 logits
// and their gradient around the loss. A recomputed layer keeps only its input in forward; its
// internals come back in a recompute op just before its backward op.
std::vector<LiveRange> transformer_step(int layers, Recompute recompute, int micro_batches = 1,
                                        uint64_t tokens = 4096, uint64_t C = 1024, uint64_t NH = 16,
                                        uint64_t T = 1024, uint64_t V = 50257) {
  const uint64_t a = 64;
  const uint64_t act = tokens * C * 2;  // one [b*t, C] bf16 tensor
  const uint64_t probs = (tokens / T) * NH * T * T * 2;
  const uint64_t layer_grads = (12 * C * C + 13 * C) * 4;
  std::vector<LiveRange> b;
  int op = 0;
  std::vector<int> first_backward(layers, -1);
  for (int m = 0; m < micro_batches; m++) {
    std::vector<int> fwd(layers);
    for (int l = 0; l < layers; l++) fwd[l] = op++;
    const int loss = op++;
    std::vector<int> rec(layers), bwd(layers);
    for (int l = layers - 1; l >= 0; l--) {
      bool r = recompute == Recompute::kFull || (recompute == Recompute::kEveryOther && l % 2);
      rec[l] = r ? op++ : -1;
      bwd[l] = op++;
      if (first_backward[l] < 0) first_backward[l] = r ? rec[l] : bwd[l];
    }
    const std::vector<uint64_t> internals = {act, 3 * act, probs, act, act, 4 * act, 4 * act};
    for (int l = 0; l < layers; l++) {
      bool r = rec[l] >= 0;
      b.push_back({act, a, fwd[l], bwd[l]});  // layer input (the residual stream)
      for (uint64_t bytes : internals) {
        if (r) {
          b.push_back({bytes, a, fwd[l], fwd[l]});  // computed and dropped in forward
          b.push_back({bytes, a, rec[l], bwd[l]});  // recomputed for backward
        } else {
          b.push_back({bytes, a, fwd[l], bwd[l]});
        }
      }
      b.push_back({2 * act, a, fwd[l], fwd[l]});           // forward scratch
      b.push_back({act, a, bwd[l], bwd[l] + 1});           // d(input) for the next backward op
      b.push_back({4 * act, a, bwd[l], bwd[l]});           // d(fc) scratch
      b.push_back({probs, a, bwd[l], bwd[l]});             // d(probs) scratch
      b.push_back({3 * C * 4 + 100, 64, bwd[l], bwd[l]});  // small odd-sized reductions
    }
    b.push_back({tokens * V * 4, a, fwd[layers - 1], loss});  // logits, fp32
    b.push_back({tokens * V * 2, a, loss, bwd[layers - 1]});  // d(logits), bf16
    b.push_back({act, a, loss, bwd[0]});                      // d(final ln) across the backward
    b.push_back({tokens * 8, a, fwd[0], loss});               // targets and loss staging
  }
  for (int l = 0; l < layers; l++) b.push_back({layer_grads, a, first_backward[l], op});
  return b;
}

TEST(OffsetPlanner, BothSearchPathsMatchPlainBestFit) {
  // Transformer schedules leave few holes, so placements read the time index; random lifetimes
  // shred free memory, so most placements walk the offset list instead. Both must give exactly
  // the plain search's offsets.
  std::mt19937_64 rng(5);
  std::vector<std::vector<LiveRange>> cases = {transformer_step(12, Recompute::kEveryOther, 2),
                                               random_instance(rng, 1500, 300)};
  for (const std::vector<LiveRange>& b : cases) {
    std::vector<uint32_t> order(b.size());
    std::iota(order.begin(), order.end(), 0u);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t x, uint32_t y) { return b[x].bytes > b[y].bytes; });
    OffsetPlan plan = plan_offsets_in_order(b, order);
    EXPECT_EQ(plan.offsets, plain_best_fit(b, order)) << b.size() << " buffers";
    ASSERT_NO_FATAL_FAILURE(expect_valid(b, plan));
  }
}

void expect_near_lower_bound(const std::vector<LiveRange>& b, const char* what) {
  OffsetPlan plan = plan_offsets(b);
  ASSERT_NO_FATAL_FAILURE(expect_valid(b, plan));
  double ratio = double(plan.size) / double(plan.lower_bound);
  EXPECT_LE(ratio, 1.05) << what << ": " << b.size() << " buffers, size " << plan.size
                         << ", lower bound " << plan.lower_bound << ", by " << plan.strategy;
  ::testing::Test::RecordProperty(what, std::to_string(ratio) + " " + plan.strategy);
}

TEST(OffsetPlanner, TransformerWithinFivePercentOfLowerBound) {
  for (int layers : {2, 12, 48, 80}) {
    std::string tag = "layers" + std::to_string(layers);
    expect_near_lower_bound(transformer_step(layers, Recompute::kNone), (tag + "_none").c_str());
    expect_near_lower_bound(transformer_step(layers, Recompute::kFull), (tag + "_full").c_str());
    expect_near_lower_bound(transformer_step(layers, Recompute::kEveryOther),
                            (tag + "_every_other").c_str());
  }
}

TEST(OffsetPlanner, TransformerShapesWithinFivePercentOfLowerBound) {
  // Small and large vocabularies and widths move the peak between the logits and the saved
  // activations; several micro-batches add long-lived gradients.
  expect_near_lower_bound(transformer_step(12, Recompute::kNone, 1, 2048, 768, 12, 1024, 50257),
                          "gpt2_small");
  expect_near_lower_bound(transformer_step(32, Recompute::kFull, 1, 8192, 4096, 32, 4096, 128256),
                          "llama8b_full");
  expect_near_lower_bound(transformer_step(80, Recompute::kEveryOther, 4, 4096, 8192, 64, 4096),
                          "llama70b_mb4");
  expect_near_lower_bound(transformer_step(24, Recompute::kNone, 3, 1024, 2048, 16, 512, 32000),
                          "mb3_small_vocab");
}

// verify_offsets ---------------------------------------------------------------------------

TEST(VerifyOffsets, NamesBothCollidingBuffers) {
  std::vector<LiveRange> b;
  for (int i = 0; i < 30; i++) b.push_back({1024, 64, i, i + 3});
  OffsetPlan plan = plan_offsets(b);
  ASSERT_TRUE(verify_offsets(b, plan).is_ok());
  plan.offsets[17] = plan.offsets[15];  // 15 (ops 15..18) and 17 (ops 17..20) meet
  Status s = verify_offsets(b, plan);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("buffer 15 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("buffer 17 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("op 17"), std::string::npos) << s.message();
}

TEST(VerifyOffsets, AcceptsSharingWhenLifetimesDoNotMeet) {
  std::vector<LiveRange> b = {{100, 4, 0, 2}, {100, 4, 3, 5}, {0, 4, 0, 5}};
  OffsetPlan plan{{0, 0, 0}, 100, 100, "hand"};
  EXPECT_TRUE(verify_offsets(b, plan).is_ok());
  b[1].first = 2;  // now both live at op 2
  Status s = verify_offsets(b, plan);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("buffer 0 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("buffer 1 "), std::string::npos) << s.message();
}

TEST(VerifyOffsets, CatchesMisalignmentSizeAndCount) {
  std::vector<LiveRange> b = {{100, 64, 0, 1}, {100, 64, 2, 3}};
  OffsetPlan plan{{0, 32}, 200, 128, "hand"};
  Status s = verify_offsets(b, plan);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("buffer 1 "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("aligned"), std::string::npos) << s.message();

  plan.offsets[1] = 128;
  plan.size = 200;  // 128 + 100 > 200
  s = verify_offsets(b, plan);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("arena size 200"), std::string::npos) << s.message();

  plan.offsets.pop_back();
  s = verify_offsets(b, plan);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("1 offsets for 2 buffers"), std::string::npos) << s.message();
}

TEST(VerifyOffsets, CatchesEveryCollisionOnRandomInstances) {
  // Move one buffer onto another it meets in time: verify_offsets must refuse, whichever pair.
  std::mt19937_64 rng(11);
  int checked = 0;
  for (int trial = 0; trial < 500; trial++) {
    std::vector<LiveRange> b = random_instance(rng, 30, 10);
    OffsetPlan plan = plan_offsets(b);
    size_t i = rng() % b.size(), j = rng() % b.size();
    if (i == j || b[i].bytes == 0 || b[j].bytes == 0 || !meet(b[i], b[j])) continue;
    plan.offsets[j] = plan.offsets[i] / b[j].alignment * b[j].alignment;
    if (plan.offsets[j] + b[j].bytes <= plan.offsets[i]) continue;  // rounding moved it clear
    Status s = verify_offsets(b, plan);
    ASSERT_FALSE(s.is_ok()) << "trial " << trial;
    checked++;
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace headroom::memory
