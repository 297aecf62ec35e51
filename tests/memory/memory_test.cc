// Memory resources: one typed suite every resource passes, then each adaptor's own behaviour.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "core/units.h"
#include "memory/adaptors.h"
#include "memory/arena.h"
#include "memory/host_resource.h"
#include "memory/pool_resource.h"

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

struct PoolStack {
  HostResource host;
  LimitResource limit{&host, 1 * kGiB};
  TrackingResource tracking{&limit};
  PoolResource pool{&tracking};
  MemoryResource* resource() { return &pool; }
};

template <typename T>
class ResourceSuite : public ::testing::Test {
 protected:
  T stack_;
};
using Stacks = ::testing::Types<HostStack, LimitStack, TrackingStack, FailingStack, PoolStack>;
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

// HostAllocator: vectors whose large blocks come from HostResource's page-aligned mappings (the
// bench and calibration operands), small ones from aligned_alloc; contents survive growth.
TEST(HostAllocator, VectorsLiveInHostResourceMemory) {
  std::vector<float, HostAllocator<float>> big(size_t{3} << 20, 1.5f);  // 12 MiB: mmap'ed
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % 4096, 0u);
  EXPECT_EQ(big[123456], 1.5f);
  std::vector<int, HostAllocator<int>> small;
  for (int i = 0; i < 1000; i++) small.push_back(i);  // reallocates through the allocator
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.data()) % kDefaultAlignment, 0u);
  EXPECT_EQ(small[999], 999);
  big.resize(size_t{5} << 20, 2.0f);
  EXPECT_EQ(big[size_t{3} << 20], 2.0f);
  EXPECT_EQ(big[0], 1.5f);
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

TEST(FailingResource, FailsASetOfCalls) {
  HostResource host;
  FailingResource failing(&host);
  failing.fail_at(std::vector<uint64_t>{4, 1});
  std::vector<bool> ok;
  for (int i = 0; i < 6; i++) {
    Result<void*> p = failing.allocate(64);
    ok.push_back(p.is_ok());
    if (p.is_ok()) failing.deallocate(*p, 64);
  }
  EXPECT_EQ(ok, (std::vector<bool>{true, false, true, true, false, true}));
  EXPECT_EQ(failing.failures(), 2u);
}

// BlockResource lends its one block to one arena at a time, never more than the block.
TEST(BlockResource, LendsItsBlockOnceAndOnlyWhatFits) {
  HostResource host;
  Result<Arena> owner =
      Arena::create(&host, {{"block", DType::kF32, Shape({4096})}},
                    sequential_layout({{"block", DType::kF32, Shape({4096})}}), Category::kOffload);
  ASSERT_TRUE(owner.is_ok());
  BlockResource block(owner->base(), owner->size());
  const std::vector<BufferDesc> two = {{"a", DType::kF32, Shape({1000})},
                                       {"b", DType::kF32, Shape({2000})}};
  {
    Result<Arena> view = Arena::create(&block, two, sequential_layout(two), Category::kOffload);
    ASSERT_TRUE(view.is_ok()) << view.status().to_string();
    EXPECT_EQ(view->base(), owner->base());
    EXPECT_EQ(view->data(1), static_cast<char*>(owner->base()) + view->layout().offsets[1]);
    // Lent: a second arena is refused until the first returns the block.
    Result<Arena> again = Arena::create(&block, two, sequential_layout(two), Category::kOffload);
    ASSERT_FALSE(again.is_ok());
    EXPECT_EQ(again.status().code(), StatusCode::kOutOfMemory);
    EXPECT_NE(again.status().message().find("already lent"), std::string::npos);
  }
  const std::vector<BufferDesc> big = {{"c", DType::kF32, Shape({5000})}};
  Result<Arena> too_big = Arena::create(&block, big, sequential_layout(big), Category::kOffload);
  ASSERT_FALSE(too_big.is_ok());
  EXPECT_NE(too_big.status().message().find("does not fit"), std::string::npos);
  EXPECT_TRUE(Arena::create(&block, two, sequential_layout(two), Category::kOffload).is_ok());
}

TEST(PoolResource, ReusesFreedBlocksWithoutUpstreamCalls) {
  HostResource host;
  TrackingResource tracking(&host);
  PoolResource pool(&tracking);
  void* a = *pool.allocate(5 * kMiB, 4096, Category::kActivations);
  pool.deallocate(a, 5 * kMiB, 4096, Category::kActivations);
  for (int i = 0; i < 10; i++) {
    void* b = *pool.allocate(5 * kMiB, 4096, Category::kActivations);
    EXPECT_EQ(b, a);  // the same block: no new pages to fault in
    pool.deallocate(b, 5 * kMiB, 4096, Category::kActivations);
  }
  PoolStats s = pool.stats();
  EXPECT_EQ(s.upstream_allocations, 1u);
  EXPECT_EQ(s.hits, 10u);
  EXPECT_EQ(s.reserved, 5 * kMiB);
  EXPECT_EQ(s.in_use, 0u);
  // A large block is reserved at exactly its (64-byte rounded) size: the plan's peak is exact.
  EXPECT_EQ(tracking.stats().peak, 5 * kMiB);
  EXPECT_EQ(pool.release_unused(), 5 * kMiB);
  EXPECT_EQ(tracking.stats().current, 0u);
  EXPECT_EQ(pool.stats().reserved, 0u);
}

// The observer sees every block and chunk, in order, with positions in the reserved bytes and the
// pool's figures after each event.
TEST(PoolResource, ObserverSeesBlocksAndChunks) {
  HostResource host;
  PoolResource pool(&host, PoolOptions{0, 0});
  std::vector<PoolEvent> seen;
  pool.set_observer([&](const PoolEvent& e) { seen.push_back(e); });
  using K = PoolEvent::Kind;
  void* a = *pool.allocate(1000, 64, Category::kActivations);  // a miss: reserve, then acquire
  void* b = *pool.allocate(3 * kMiB, 4096, Category::kWorkspace);
  pool.deallocate(a, 1000, 64, Category::kActivations);
  void* c = *pool.allocate(1000, 64, Category::kActivations);  // a hit: acquire only
  pool.deallocate(c, 1000, 64, Category::kActivations);
  pool.deallocate(b, 3 * kMiB, 4096, Category::kWorkspace);
  EXPECT_EQ(pool.release_unused(), 1024 + 3 * kMiB);
  ASSERT_EQ(seen.size(), 10u);
  const K want[] = {K::kReserve, K::kAcquire, K::kReserve, K::kAcquire,   K::kRelease,
                    K::kAcquire, K::kRelease, K::kRelease, K::kUnreserve, K::kUnreserve};
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i].kind, want[i]) << i;
  EXPECT_EQ(seen[0].bytes, 1024u);  // rounded to 64 bytes
  EXPECT_EQ(seen[0].after.reserved, 1024u);
  EXPECT_EQ(seen[1].after.in_use, 1024u);
  EXPECT_EQ(seen[1].category, Category::kActivations);
  EXPECT_EQ(seen[2].offset, 1024u);  // the second chunk lies after the first
  EXPECT_EQ(seen[3].category, Category::kWorkspace);
  EXPECT_EQ(seen[3].offset, 1024u);
  EXPECT_EQ(seen[3].after.reserved, 1024 + 3 * kMiB);
  EXPECT_EQ(seen[5].offset, 0u);
  EXPECT_EQ(seen[7].after.in_use, 0u);
  EXPECT_EQ(seen[8].offset, 0u);
  EXPECT_EQ(seen[8].after.reserved, 3 * kMiB);
  EXPECT_EQ(seen[9].offset, 0u);  // the first chunk is gone: the second one starts the pool now
  EXPECT_EQ(seen[9].after.reserved, 0u);
  pool.set_observer(nullptr);
  void* d = *pool.allocate(64, 64, Category::kActivations);
  pool.deallocate(d, 64, 64, Category::kActivations);
  EXPECT_EQ(seen.size(), 10u);
}

TEST(PoolResource, BestFitSplitsAndCoalesces) {
  HostResource host;
  PoolResource pool(&host);
  // One 8 MiB chunk, carved into a 3 MiB and a 5 MiB block after it is freed.
  void* big = *pool.allocate(8 * kMiB, 64, Category::kActivations);
  pool.deallocate(big, 8 * kMiB, 64, Category::kActivations);
  void* x = *pool.allocate(3 * kMiB, 64, Category::kActivations);
  void* y = *pool.allocate(5 * kMiB, 64, Category::kActivations);
  EXPECT_EQ(x, big);
  EXPECT_EQ(static_cast<char*>(y), static_cast<char*>(big) + 3 * kMiB);
  PoolStats s = pool.stats();
  EXPECT_EQ(s.upstream_allocations, 1u);
  EXPECT_EQ(s.in_use, 8 * kMiB);
  EXPECT_DOUBLE_EQ(s.fragmentation(), 0.0);
  // Freeing both merges them back: the whole chunk serves an 8 MiB request again.
  pool.deallocate(x, 3 * kMiB, 64, Category::kActivations);
  EXPECT_NEAR(pool.stats().fragmentation(), 3.0 / 8.0, 1e-12);
  EXPECT_EQ(pool.stats().largest_free, 3 * kMiB);
  pool.deallocate(y, 5 * kMiB, 64, Category::kActivations);
  EXPECT_EQ(pool.stats().largest_free, 8 * kMiB);
  void* again = *pool.allocate(8 * kMiB, 64, Category::kActivations);
  EXPECT_EQ(again, big);
  EXPECT_EQ(pool.stats().upstream_allocations, 1u);
  // A block in use pins its chunk: release_unused keeps it.
  EXPECT_EQ(pool.release_unused(), 0u);
  pool.deallocate(again, 8 * kMiB, 64, Category::kActivations);
  // Free blocks serve only their own category.
  void* w = *pool.allocate(2 * kMiB, 64, Category::kWeights);
  EXPECT_EQ(pool.stats().upstream_allocations, 2u);
  pool.deallocate(w, 2 * kMiB, 64, Category::kWeights);
}

TEST(PoolResource, SmallRequestsShareSizeClassSlabs) {
  HostResource host;
  PoolResource pool(&host);
  std::vector<void*> ps;
  for (size_t bytes : {size_t(1), size_t(100), size_t(129), size_t(5000)}) {
    ps.push_back(*pool.allocate(bytes, 64, Category::kWorkspace));
  }
  PoolStats s = pool.stats();
  EXPECT_EQ(s.upstream_allocations, 1u);  // one slab
  EXPECT_EQ(s.reserved, PoolOptions().small_chunk);
  EXPECT_EQ(s.in_use, 64u + 128u + 256u + 8192u);  // powers of two
  size_t i = 0;
  for (size_t bytes : {size_t(1), size_t(100), size_t(129), size_t(5000)}) {
    pool.deallocate(ps[i++], bytes, 64, Category::kWorkspace);
  }
  EXPECT_EQ(pool.stats().in_use, 0u);
  EXPECT_EQ(pool.stats().largest_free, PoolOptions().small_chunk);
  // Without size classes every request is its own exact-size chunk (what the trainer uses, so
  // that a small step region is held at exactly its planned size).
  PoolResource exact(&host, PoolOptions{0, 0});
  void* e = *exact.allocate(100, 64, Category::kActivations);
  EXPECT_EQ(exact.stats().reserved, 128u);
  exact.deallocate(e, 100, 64, Category::kActivations);
}

TEST(PoolResource, ReleasesUnusedChunksWhenTheBudgetShrinks) {
  HostResource host;
  LimitResource limit(&host, 16 * kMiB);
  TrackingResource tracking(&limit);
  PoolResource pool(&tracking);
  void* a = *pool.allocate(10 * kMiB, 64, Category::kActivations);
  pool.deallocate(a, 10 * kMiB, 64, Category::kActivations);
  EXPECT_EQ(limit.in_use(), 10 * kMiB);  // reserved, free, still counted by the budget
  // A request that the free block cannot serve: the upstream refuses (10 + 8 > 16 MiB), the pool
  // releases its unused chunk and tries again.
  Result<void*> b = pool.allocate(12 * kMiB, 64, Category::kActivations);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  EXPECT_EQ(limit.in_use(), 12 * kMiB);
  pool.deallocate(*b, 12 * kMiB, 64, Category::kActivations);
  limit.set_budget(4 * kMiB);
  EXPECT_EQ(pool.release_unused(), 12 * kMiB);
  EXPECT_EQ(limit.in_use(), 0u);
  // Out of memory names the pool's state as well as the budget.
  Result<void*> c = pool.allocate(6 * kMiB, 64, Category::kActivations);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(c.status().message().find("pool: reserved"), std::string::npos) << c.status().message();
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
