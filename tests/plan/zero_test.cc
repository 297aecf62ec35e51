// ZeRO memory per rank and traffic per step: the textbook figures (ZeRO paper, Table 1 and
// section 7) for a model of P parameters.
#include "plan/zero.h"

#include <gtest/gtest.h>

namespace headroom::plan {
namespace {

TEST(ZeroPlan, MemoryPerRankShrinksByStage) {
  ZeroSpec s;
  s.ranks = 4;
  s.param_floats = 1'000'000;  // divisible by 4 * 16
  const int64_t P = s.param_floats, S = P / 4;
  s.stage = 0;
  ZeroMemory m0 = zero_memory(s);
  EXPECT_EQ(m0.params, 4 * P);
  EXPECT_EQ(m0.grads, 4 * P);
  EXPECT_EQ(m0.grad_shard, 0);
  EXPECT_EQ(m0.optimizer, 8 * P);
  EXPECT_EQ(m0.total(), 16 * P);
  s.stage = 1;
  ZeroMemory m1 = zero_memory(s);
  EXPECT_EQ(m1.optimizer, 8 * S);
  EXPECT_EQ(m1.grads, 4 * P);
  EXPECT_EQ(m1.grad_shard, 4 * S);
  s.stage = 2;
  s.grad_window_floats = 2 * 50'000;  // two buckets after integration
  ZeroMemory m2 = zero_memory(s);
  EXPECT_EQ(m2.grads, 4 * 100'000);
  EXPECT_LT(m2.total(), m1.total());
  s.stage = 3;
  s.gather_window_floats = 2 * 60'000;
  ZeroMemory m3 = zero_memory(s);
  EXPECT_EQ(m3.params, 4 * (S + 120'000));
  EXPECT_LT(m3.total(), m2.total());
  // Mixed precision: bf16 working copies, an fp32 master shard.
  s.stage = 1;
  s.param_bytes = s.grad_bytes = 2;
  s.master = true;
  s.grad_window_floats = 0;
  ZeroMemory mb = zero_memory(s);
  EXPECT_EQ(mb.params, 2 * P);
  EXPECT_EQ(mb.master, 4 * S);
}

TEST(ZeroPlan, ShardOfAnUnevenBufferIsTheLargestRanks) {
  ZeroSpec s;
  s.stage = 1;
  s.ranks = 3;
  s.param_floats = 100;  // pieces of 48, 48, 4
  EXPECT_EQ(zero_memory(s).optimizer, 2 * 48 * 4);
  s.shard_floats = 64;  // a multi-unit layout's own figure wins
  EXPECT_EQ(zero_memory(s).optimizer, 2 * 64 * 4);
}

TEST(ZeroPlan, TrafficMatchesRingCollectives) {
  ZeroSpec s;
  s.param_floats = 1'200'000;
  s.ranks = 1;
  EXPECT_EQ(zero_traffic(s).total(), 0);
  s.ranks = 4;
  const int64_t B = 4 * s.param_floats;  // fp32 bytes
  s.stage = 0;
  EXPECT_EQ(zero_traffic(s).all_reduce, 2 * B * 3 / 4);
  s.stage = 1;  // reduce-scatter + all-gather: the same volume as stage 0
  EXPECT_EQ(zero_traffic(s).total(), zero_traffic(ZeroSpec{0, 4, s.param_floats}).total());
  EXPECT_EQ(zero_traffic(s).reduce_scatter, B * 3 / 4);
  EXPECT_EQ(zero_traffic(s).all_gather, B * 3 / 4);
  s.stage = 3;  // 1.5x: parameters gathered in forward and again in backward
  EXPECT_EQ(zero_traffic(s).total(), 3 * B * 3 / 4);
  s.micro_batches = 4;  // gathers repeat per micro-batch; one reduce-scatter of the sum
  EXPECT_EQ(zero_traffic(s).all_gather, 8 * B * 3 / 4);
  EXPECT_EQ(zero_traffic(s).reduce_scatter, B * 3 / 4);
  s.grad_window_floats = 1000;  // windows: each micro-batch reduces its own gradients
  EXPECT_EQ(zero_traffic(s).reduce_scatter, 4 * B * 3 / 4);
  EXPECT_DOUBLE_EQ(zero_comm_seconds(s, 1e9), double(zero_traffic(s).total()) / 1e9);
}

}  // namespace
}  // namespace headroom::plan
