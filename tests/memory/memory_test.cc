// Memory resources: one typed suite every resource passes, then each adaptor's own behaviour.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "core/units.h"
#include "memory/adaptors.h"
#include "memory/arena.h"
#include "memory/host_resource.h"

namespace headroom::memory {
namespace {

// Each stack owns its layers; resource() is the top.
struct HostStack {
  HostResource host;
  MemoryResource* resource() { return &host; }
};
struct LimitStack {
  HostResource host;
  LimitResource limit{&host, 1 * kGiB};
  MemoryResource* resource() { return &limit; }
};
struct TrackingStack {
  HostResource host;
  LimitResource limit{&host, 1 * kGiB};
  TrackingResource tracking{&limit};
  MemoryResource* resource() { return &tracking; }
};
struct FailingStack {
  HostResource host;
  FailingResource failing{&host};  // never told to fail: behaves like its upstream
  MemoryResource* resource() { return &failing; }
};

template <typename T>
class ResourceSuite : public ::testing::Test {
 protected:
  T stack_;
};
using Stacks = ::testing::Types<HostStack, LimitStack, TrackingStack, FailingStack>;
TYPED_TEST_SUITE(ResourceSuite, Stacks);

TYPED_TEST(ResourceSuite, AlignedWritableAndDistinct) {
  MemoryResource* r = this->stack_.resource();
  std::vector<std::pair<void*, size_t>> blocks;
  for (size_t bytes : {size_t(0), size_t(1), size_t(100), size_t(4096), size_t(3) << 20}) {
    for (size_t align : {size_t(8), size_t(64), size_t(4096)}) {
      Result<void*> p = r->allocate(bytes, align, Category::kActivations);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % align, 0u);
      std::memset(*p, 0xab, bytes);
      blocks.push_back({*p, bytes});
      for (size_t i = 0; i + 1 < blocks.size(); i++) EXPECT_NE(blocks[i].first, *p);
    }
  }
  size_t i = 0;
  for (size_t bytes : {size_t(0), size_t(1), size_t(100), size_t(4096), size_t(3) << 20}) {
    for (size_t align : {size_t(8), size_t(64), size_t(4096)}) {
      EXPECT_EQ(blocks[i].second, bytes);
      r->deallocate(blocks[i++].first, bytes, align, Category::kActivations);
    }
  }
}

TEST(LimitResource, EnforcesBudgetAndNamesIt) {
  HostResource host;
  LimitResource limit(&host, 10 * kMiB);
  Result<void*> a = limit.allocate(6 * kMiB, 64, Category::kWeights);
  ASSERT_TRUE(a.is_ok());
  Result<void*> b = limit.allocate(6 * kMiB, 64, Category::kActivations);
  ASSERT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("6.00 MiB"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("10.0 MiB"), std::string::npos) << b.status().message();
  EXPECT_EQ(limit.in_use(), 6 * kMiB);
  limit.set_budget(20 * kMiB);
  Result<void*> c = limit.allocate(6 * kMiB, 64, Category::kActivations);
  ASSERT_TRUE(c.is_ok());
  limit.deallocate(*a, 6 * kMiB, 64, Category::kWeights);
  limit.deallocate(*c, 6 * kMiB, 64, Category::kActivations);
  EXPECT_EQ(limit.in_use(), 0u);
}

TEST(TrackingResource, CountsByCategoryAndExtendsOutOfMemory) {
  HostResource host;
  LimitResource limit(&host, 8 * kMiB);
  TrackingResource tracking(&limit);
  void* w = *tracking.allocate(3 * kMiB, 64, Category::kWeights);
  void* a = *tracking.allocate(2 * kMiB, 64, Category::kActivations);
  tracking.deallocate(a, 2 * kMiB, 64, Category::kActivations);
  void* l = *tracking.allocate(1 * kMiB, 64, Category::kLogits);
  MemoryStats s = tracking.stats();
  EXPECT_EQ(s.current, 4 * kMiB);
  EXPECT_EQ(s.peak, 5 * kMiB);
  EXPECT_EQ(s.by_category[size_t(Category::kWeights)].current, 3 * kMiB);
  EXPECT_EQ(s.by_category[size_t(Category::kActivations)].current, 0u);
  EXPECT_EQ(s.by_category[size_t(Category::kActivations)].peak, 2 * kMiB);
  EXPECT_EQ(s.allocations, 3u);

  Result<void*> big = tracking.allocate(5 * kMiB, 64, Category::kActivations);
  ASSERT_FALSE(big.is_ok());
  const std::string& m = big.status().message();
  EXPECT_NE(m.find("weights"), std::string::npos) << m;  // the table of what was live
  EXPECT_NE(m.find("logits"), std::string::npos) << m;
  EXPECT_EQ(tracking.stats().failures, 1u);

  tracking.reset_peak();
  EXPECT_EQ(tracking.stats().peak, 4 * kMiB);
  tracking.deallocate(w, 3 * kMiB, 64, Category::kWeights);
  tracking.deallocate(l, 1 * kMiB, 64, Category::kLogits);
  EXPECT_EQ(tracking.stats().current, 0u);
}

TEST(FailingResource, FailsTheChosenCall) {
  HostResource host;
  FailingResource failing(&host);
  failing.fail_at(1);
  Result<void*> a = failing.allocate(64);
  Result<void*> b = failing.allocate(64);
  Result<void*> c = failing.allocate(64);
  EXPECT_TRUE(a.is_ok());
  EXPECT_FALSE(b.is_ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfMemory);
  EXPECT_TRUE(c.is_ok());
  failing.deallocate(*a, 64);
  failing.deallocate(*c, 64);
}

TEST(Arena, ServesBuffersAtLayoutOffsets) {
  HostResource host;
  TrackingResource tracking(&host);
  std::vector<BufferDesc> bufs = {{"a", DType::kF32, Shape{3, 5}, Category::kActivations},
                                  {"b", DType::kBF16, Shape{7}, Category::kActivations},
                                  {"c", DType::kF32, Shape{64}, Category::kLogits}};
  Layout l = sequential_layout(bufs);
  EXPECT_EQ(l.offsets[0], 0u);
  EXPECT_EQ(l.offsets[1], 64u);   // 60 bytes rounded up to 64
  EXPECT_EQ(l.offsets[2], 128u);  // 14 bytes rounded up to 64
  EXPECT_EQ(l.size, 128u + 256u);
  {
    Result<Arena> arena = Arena::create(&tracking, bufs, l, Category::kActivations);
    ASSERT_TRUE(arena.is_ok());
    EXPECT_EQ(static_cast<char*>(arena->data(2)) - static_cast<char*>(arena->data(0)), 128);
    EXPECT_EQ(arena->view(1).shape, Shape{7});
    EXPECT_EQ(tracking.stats().current, l.size);
    Arena moved = std::move(*arena);
    EXPECT_EQ(tracking.stats().current, l.size);
  }
  EXPECT_EQ(tracking.stats().current, 0u);
}

}  // namespace
}  // namespace headroom::memory
