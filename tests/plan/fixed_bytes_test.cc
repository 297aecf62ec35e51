// A plan for a CUDA device counts the backend's fixed bytes (the context, the cuBLASLt and op
// workspaces) in its peak, its categories and the table, the same in a CPU-only build as in a
// CUDA one; a plan for the CPU backend counts none.
#include "plan/fixed_bytes.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/units.h"
#include "plan/device_spec.h"
#include "plan/memory_plan.h"
#include "plan/search.h"
#if defined(HEADROOM_HAVE_CUDA)
#include "backend/cuda/cuda_ops.h"
#endif

namespace headroom::plan {
namespace {

SearchRequest h200_request(const DeviceSpec& dev, uint64_t memory) {
  SearchRequest r;
  r.config = *model::preset_config("gpt2");
  r.device = dev;
  r.device_memory = memory;
  r.seq = 1024;
  r.global_batch = 16;
  r.micro_batch = 16;
  r.precision = "bf16";
  return r;
}

TEST(BackendFixedBytes, NamedGpusCarryTheCudaBackendsFixedBytes) {
  for (const std::string& name : named_device_names()) {
    const DeviceSpec d = *named_device(name);
    EXPECT_EQ(d.backend_fixed.cublaslt_workspace, 32 * kMiB) << name;
    EXPECT_EQ(d.backend_fixed.op_workspace, 64 * kMiB) << name;
    EXPECT_GE(d.backend_fixed.context, 256 * kMiB) << name;
    EXPECT_LE(d.backend_fixed.context, 1 * kGiB) << name;
    EXPECT_FALSE(d.backend_fixed.context_source.empty()) << name;
  }
  const DeviceSpec h200 = *named_device("H200");
  EXPECT_EQ(h200.backend_fixed.context, 512 * kMiB);
  EXPECT_EQ(h200.backend_fixed.total(), 608 * kMiB);
  EXPECT_EQ(DeviceSpec{}.backend_fixed.total(), 0u);  // the CPU backend: none
}

// The CPU-only build's constants are the CUDA backend's own figures.
TEST(BackendFixedBytes, ConstantsMatchTheCudaBackend) {
#if defined(HEADROOM_HAVE_CUDA)
  const backend::cuda::FixedDeviceBytes b = backend::cuda::fixed_device_bytes();
  EXPECT_EQ(b.cublaslt_workspace, kCudaCublasLtWorkspaceBytes);
  EXPECT_EQ(b.op_workspace, kCudaOpWorkspaceBytes);
#else
  GTEST_SKIP() << "a CPU-only build: the constants are the only figures";
#endif
}

TEST(BackendFixedBytes, APlanForAnH200CountsThem) {
  const DeviceSpec h200 = *named_device("H200");
  DeviceSpec bare = h200;
  bare.backend_fixed = {};
  const uint64_t fixed = h200.backend_fixed.total();
  Result<SearchResult> with = search_plan(h200_request(h200, h200.memory_bytes));
  Result<SearchResult> without = search_plan(h200_request(bare, h200.memory_bytes));
  ASSERT_TRUE(with.is_ok()) << with.status().to_string();
  ASSERT_TRUE(without.is_ok()) << without.status().to_string();
  ASSERT_TRUE(with->chosen && without->chosen);
  const Candidate& a = *with->chosen;
  const Candidate& b = *without->chosen;
  ASSERT_EQ(describe_exec(a.policy.exec), describe_exec(b.policy.exec));
  EXPECT_EQ(a.peak_bytes, b.peak_bytes + fixed);
  EXPECT_EQ(a.lower_bound_bytes, b.lower_bound_bytes + fixed);
  EXPECT_EQ(a.by_category[size_t(memory::Category::kWorkspace)],
            b.by_category[size_t(memory::Category::kWorkspace)] + 96 * kMiB);
  EXPECT_EQ(a.by_category[size_t(memory::Category::kOther)],
            b.by_category[size_t(memory::Category::kOther)] + 512 * kMiB);
  EXPECT_EQ(with->chosen_plan->persistent_bytes, without->chosen_plan->persistent_bytes + fixed);
  // The table says which bytes are the backend's.
  const std::string table = category_table(*with->chosen_plan, h200.memory_bytes);
  EXPECT_NE(table.find("CUDA context 512 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("cuBLASLt workspace 32.0 MiB"), std::string::npos) << table;
  EXPECT_NE(table.find("op workspace 64.0 MiB"), std::string::npos) << table;
  EXPECT_EQ(category_table(*without->chosen_plan, h200.memory_bytes).find("CUDA context"),
            std::string::npos);
}

// A budget between the chosen plan's arenas and the arenas plus the fixed bytes: that plan fits
// only when the fixed bytes are forgotten, so with them the planner must choose another (leaner)
// one, or none, and every candidate it keeps holds the fixed bytes within the budget.
TEST(BackendFixedBytes, APlanThatFitsOnlyWithoutThemIsRejected) {
  const DeviceSpec h200 = *named_device("H200");
  DeviceSpec bare = h200;
  bare.backend_fixed = {};
  Result<SearchResult> roomy = search_plan(h200_request(bare, h200.memory_bytes));
  ASSERT_TRUE(roomy.is_ok() && roomy->chosen);
  const Candidate best = *roomy->chosen;
  const uint64_t budget = best.peak_bytes + h200.backend_fixed.total() / 2;
  Result<SearchResult> bare_tight = search_plan(h200_request(bare, budget));
  ASSERT_TRUE(bare_tight.is_ok() && bare_tight->chosen);
  EXPECT_EQ(bare_tight->chosen->peak_bytes, best.peak_bytes);  // the fastest still fits
  Result<SearchResult> real_tight = search_plan(h200_request(h200, budget));
  ASSERT_TRUE(real_tight.is_ok());
  if (real_tight->chosen) {
    const Candidate& c = *real_tight->chosen;
    EXPECT_LE(c.peak_bytes, budget);
    EXPECT_GE(c.peak_bytes, h200.backend_fixed.total());
    EXPECT_FALSE(describe_exec(c.policy.exec) == describe_exec(best.policy.exec) &&
                 c.policy.precision == best.policy.precision)
        << "the plan that fits only without the fixed bytes was chosen";
  }
  for (const Candidate& c : real_tight->candidates) EXPECT_LE(c.peak_bytes, budget);
}

TEST(BackendFixedBytes, DescribedInWords) {
  EXPECT_EQ(describe_fixed_bytes({}), "");
  const BackendFixedBytes f = cuda_fixed_bytes(500 * kMiB, "measured");
  EXPECT_EQ(f.total(), 596 * kMiB);
  EXPECT_EQ(describe_fixed_bytes(f),
            "CUDA context 500 MiB (measured), cuBLASLt workspace 32.0 MiB, op workspace 64.0 MiB");
}

// NCCL's buffers for a rank of several on GPUs: 16 channels x 2 connections x (Simple 4 MiB +
// LL128 + LL), Simple's size from NCCL_BUFFSIZE when it is a valid number.
TEST(BackendFixedBytes, NcclBuffersEstimateFollowsNcclBuffsize) {
  const char* old = std::getenv("NCCL_BUFFSIZE");
  const std::string saved = old ? old : "";
  ::unsetenv("NCCL_BUFFSIZE");
  const uint64_t per_connection = 4 * kMiB + 4792320 + 512 * 1024;
  BackendFixedBytes f = with_collective_buffers(cuda_fixed_bytes(500 * kMiB, "measured"));
  EXPECT_EQ(f.collective, 32 * per_connection);
  EXPECT_EQ(f.total(), 596 * kMiB + 32 * per_connection);
  EXPECT_NE(describe_fixed_bytes(f).find(", NCCL buffers 29"), std::string::npos)
      << describe_fixed_bytes(f);
  ::setenv("NCCL_BUFFSIZE", "1048576", 1);
  f = with_collective_buffers({});
  EXPECT_EQ(f.collective, 32 * (1 * kMiB + 4792320 + 512 * 1024));
  EXPECT_NE(f.collective_source.find("NCCL_BUFFSIZE=1048576"), std::string::npos);
  ::setenv("NCCL_BUFFSIZE", "4M", 1);  // not a number NCCL reads: its default
  EXPECT_EQ(with_collective_buffers({}).collective, 32 * per_connection);
  if (old) {
    ::setenv("NCCL_BUFFSIZE", saved.c_str(), 1);
  } else {
    ::unsetenv("NCCL_BUFFSIZE");
  }
}

// A plan for two ranks on H200s counts NCCL's buffers in each rank's peak and says so in its
// table; one rank, or two on the CPU backend, count none.
TEST(BackendFixedBytes, APlanForSeveralGpusCountsNcclsBuffers) {
  const DeviceSpec h200 = *named_device("H200");
  SearchRequest two = h200_request(h200, h200.memory_bytes);
  two.devices = 2;
  two.global_batch = 32;
  Result<SearchResult> r2 = search_plan(two);
  ASSERT_TRUE(r2.is_ok() && r2->chosen) << r2.status().to_string();
  const uint64_t nccl = with_collective_buffers({}).collective;
  EXPECT_EQ(r2->chosen_plan->policy.backend_fixed.collective, nccl);
  EXPECT_GE(r2->chosen->peak_bytes, h200.backend_fixed.total() + nccl);
  const std::string table = category_table(*r2->chosen_plan, h200.memory_bytes);
  EXPECT_NE(table.find("NCCL buffers"), std::string::npos) << table;
  Result<SearchResult> r1 = search_plan(h200_request(h200, h200.memory_bytes));
  ASSERT_TRUE(r1.is_ok() && r1->chosen);
  EXPECT_EQ(r1->chosen_plan->policy.backend_fixed.collective, 0u);
  DeviceSpec cpu = h200;
  cpu.kind = "cpu";
  cpu.backend_fixed = {};
  two.device = cpu;
  Result<SearchResult> rc = search_plan(two);
  ASSERT_TRUE(rc.is_ok() && rc->chosen);
  EXPECT_EQ(rc->chosen_plan->policy.backend_fixed.total(), 0u);
}

}  // namespace
}  // namespace headroom::plan
