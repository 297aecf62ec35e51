// The CUDA memory resources: the shared suite over device stacks (the leaf under memory/'s limit,
// tracking, failing and pool adaptors, unchanged), out of memory as a Status that clears the
// runtime's error, pinned and managed memory, the elastic budget and the context's bytes.
#include "backend/cuda/device_memory.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "core/check.h"
#include "core/units.h"
#include "cuda_test_util.h"
#include "memory/adaptors.h"
#include "memory/arena.h"
#include "memory/pool_resource.h"

namespace headroom {
namespace {

using backend::cuda::CudaDeviceResource;
using backend::cuda::ManagedResource;
using backend::cuda::PinnedHostResource;
using memory::Category;
using memory::MemoryResource;

// A leaf of each kind on the process's device, made after the op table (so the context exists).
std::unique_ptr<CudaDeviceResource> device_leaf() {
  Result<int> dev = backend::cuda::process_device();
  HR_CHECK_MSG(dev.is_ok(), dev.status().to_string().c_str());
  Result<std::unique_ptr<CudaDeviceResource>> r = CudaDeviceResource::create(*dev);
  HR_CHECK_MSG(r.is_ok(), r.status().to_string().c_str());
  return std::move(r).value();
}

// Each stack owns its layers; resource() is the top; device() says whether the memory is
// device memory (filled with cudaMemset) or host-visible (filled by the host too).
struct DeviceStack {
  static constexpr size_t kMaxAlignment = size_t(1) << 20;
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  MemoryResource* resource() { return leaf.get(); }
};
struct DeviceLimitTrackingStack {
  static constexpr size_t kMaxAlignment = size_t(1) << 20;
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  memory::LimitResource limit{leaf.get(), 1 * kGiB};
  memory::TrackingResource tracking{&limit};
  MemoryResource* resource() { return &tracking; }
};
struct DeviceFailingStack {
  static constexpr size_t kMaxAlignment = size_t(1) << 20;
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  memory::FailingResource failing{leaf.get()};  // never told to fail: behaves like its upstream
  MemoryResource* resource() { return &failing; }
};
struct DevicePoolStack {
  static constexpr size_t kMaxAlignment = size_t(1) << 20;
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  memory::LimitResource limit{leaf.get(), 1 * kGiB};
  memory::TrackingResource tracking{&limit};
  memory::PoolResource pool{&tracking};
  MemoryResource* resource() { return &pool; }
};
struct PinnedStack {
  static constexpr size_t kMaxAlignment = 4096;  // cudaHostAlloc's pages
  std::unique_ptr<PinnedHostResource> leaf = std::move(PinnedHostResource::create()).value();
  MemoryResource* resource() { return leaf.get(); }
};
struct ManagedStack {
  static constexpr size_t kMaxAlignment = size_t(1) << 20;
  std::unique_ptr<ManagedResource> leaf =
      std::move(ManagedResource::create(*backend::cuda::process_device())).value();
  MemoryResource* resource() { return leaf.get(); }
};

template <typename T>
class CudaResourceSuite : public ::testing::Test {
 protected:
  void SetUp() override {
    HR_CUDA_OPS_OR_SKIP(ops);
    (void)ops;
    stack_ = std::make_unique<T>();
  }
  std::unique_ptr<T> stack_;
};
using Stacks = ::testing::Types<DeviceStack, DeviceLimitTrackingStack, DeviceFailingStack,
                                DevicePoolStack, PinnedStack, ManagedStack>;
TYPED_TEST_SUITE(CudaResourceSuite, Stacks);

// Every block aligned, distinct, and holding what is written to it: each block gets its own byte
// value through cudaMemset, and every block is read back after all were written (an overlap
// would show as another block's value).
TYPED_TEST(CudaResourceSuite, AlignedWritableAndDistinct) {
  MemoryResource* r = this->stack_->resource();
  const std::vector<size_t> sizes = {0, 1, 100, 4096, size_t(3) << 20};
  // 4096: what the arenas ask for; 1 MiB: past anything the runtime's pointers are sure to have.
  const std::vector<size_t> aligns = {8, 64, 256, 4096, size_t(1) << 20};
  struct Block {
    void* p;
    size_t bytes, align;
    unsigned char value;
  };
  std::vector<Block> blocks;
  unsigned char value = 1;
  for (size_t bytes : sizes) {
    for (size_t align : aligns) {
      if (align > TypeParam::kMaxAlignment) continue;
      Result<void*> p = r->allocate(bytes, align, Category::kActivations);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      ASSERT_NE(*p, nullptr);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % align, 0u) << bytes << " bytes, align " << align;
      for (const Block& b : blocks) EXPECT_NE(b.p, *p);
      if (bytes > 0) HR_CUDA_CHECK(cudaMemset(*p, value, bytes));
      blocks.push_back({*p, bytes, align, value++});
    }
  }
  HR_CUDA_CHECK(cudaDeviceSynchronize());
  for (const Block& b : blocks) {
    if (b.bytes == 0) continue;
    std::vector<unsigned char> host(b.bytes);
    HR_CUDA_CHECK(cudaMemcpy(host.data(), b.p, b.bytes, cudaMemcpyDefault));
    EXPECT_EQ(host.front(), b.value);
    EXPECT_EQ(host.back(), b.value);
    EXPECT_EQ(host[b.bytes / 2], b.value);
  }
  for (const Block& b : blocks) r->deallocate(b.p, b.bytes, b.align, Category::kActivations);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// An arena (the planner's regions) laid out on device memory through the adaptors.
TYPED_TEST(CudaResourceSuite, AnArenaLivesOnIt) {
  MemoryResource* r = this->stack_->resource();
  std::vector<memory::BufferDesc> bufs = {
      {"a", DType::kF32, {1000}, Category::kActivations},
      {"b", DType::kF32, {333}, Category::kActivations},
  };
  memory::Layout layout;
  layout.offsets = {0, 4096};
  layout.size = 4096 + 333 * 4;
  Result<memory::Arena> arena = memory::Arena::create(r, bufs, layout, Category::kActivations);
  ASSERT_TRUE(arena.is_ok()) << arena.status().to_string();
  std::vector<float> host(333, 2.5f), back(333, 0.0f);
  HR_CUDA_CHECK(cudaMemcpy(arena->f32(1), host.data(), 333 * 4, cudaMemcpyDefault));
  HR_CUDA_CHECK(cudaMemcpy(back.data(), arena->f32(1), 333 * 4, cudaMemcpyDefault));
  EXPECT_EQ(back, host);
}

TEST(CudaDeviceResource, OutOfMemoryIsAStatusNamingTheDeviceAndClearsTheError) {
  HR_CUDA_OPS_OR_SKIP(ops);
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t too_much = total_b + (size_t(1) << 30);
  Result<void*> p = leaf->allocate(too_much, 256, Category::kLogits);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kOutOfMemory);
  const std::string& m = p.status().message();
  EXPECT_NE(m.find(format_bytes(too_much)), std::string::npos) << m;
  EXPECT_NE(m.find("logits"), std::string::npos) << m;
  EXPECT_NE(m.find("free of"), std::string::npos) << m;
  EXPECT_NE(m.find(format_bytes(total_b)), std::string::npos) << m;
  // The runtime's error is cleared: the next call sees success, and allocation still works.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  Result<void*> q = leaf->allocate(1 << 20, 256, Category::kLogits);
  ASSERT_TRUE(q.is_ok()) << q.status().to_string();
  leaf->deallocate(*q, 1 << 20, 256, Category::kLogits);
  ops->synchronize();
}

// Small blocks come from the runtime's sub-allocations, aligned to 256 bytes only: a larger
// alignment is served from a padded block, and freeing the aligned pointer frees that block.
TEST(CudaDeviceResource, ServesAnyPowerOfTwoAlignment) {
  HR_CUDA_OPS_OR_SKIP(ops);
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  size_t free0 = 0, total = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free0, &total));
  for (int round = 0; round < 3; round++) {
    std::vector<void*> blocks;
    for (int i = 0; i < 64; i++) {
      Result<void*> p = leaf->allocate(1000, 4096, Category::kWeights);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 4096, 0u);
      HR_CUDA_CHECK(cudaMemset(*p, 0x3c, 1000));
      blocks.push_back(*p);
    }
    for (void* p : blocks) leaf->deallocate(p, 1000, 4096, Category::kWeights);
  }
  size_t free1 = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free1, &total));
  EXPECT_GE(free1 + 8 * kMiB, free0);  // every padded block went back
  Result<void*> odd = leaf->allocate(100, 3, Category::kWeights);
  ASSERT_FALSE(odd.is_ok());
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(odd.status().message().find("alignment 3"), std::string::npos);
  Result<std::unique_ptr<CudaDeviceResource>> bad = CudaDeviceResource::create(4096);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("4096"), std::string::npos);
}

// The adaptors stack on the device leaf unchanged: the limit refuses before the device is asked,
// the tracking resource counts device bytes by category and extends the leaf's own
// out-of-memory with its table, and failure injection fails the chosen call.
TEST(CudaDeviceResource, AdaptorsStackUnchanged) {
  HR_CUDA_OPS_OR_SKIP(ops);
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  memory::FailingResource failing(leaf.get());
  memory::LimitResource limit(&failing, 64 * kMiB);
  memory::TrackingResource tracking(&limit);
  void* w = *tracking.allocate(40 * kMiB, 256, Category::kWeights);
  Result<void*> over = tracking.allocate(30 * kMiB, 256, Category::kActivations);
  ASSERT_FALSE(over.is_ok());
  EXPECT_EQ(over.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(over.status().message().find("weights"), std::string::npos);
  EXPECT_EQ(failing.calls(), 1u);  // the limit refused without asking below it
  failing.fail_at(1);
  Result<void*> injected = tracking.allocate(1 * kMiB, 256, Category::kGrads);
  ASSERT_FALSE(injected.is_ok());
  EXPECT_EQ(injected.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(limit.in_use(), 40 * kMiB);  // the failed request is not counted
  void* g = *tracking.allocate(8 * kMiB, 256, Category::kGrads);
  memory::MemoryStats s = tracking.stats();
  EXPECT_EQ(s.current, 48 * kMiB);
  EXPECT_EQ(s.by_category[size_t(Category::kWeights)].current, 40 * kMiB);
  EXPECT_EQ(s.by_category[size_t(Category::kGrads)].current, 8 * kMiB);
  EXPECT_EQ(s.failures, 2u);
  tracking.deallocate(g, 8 * kMiB, 256, Category::kGrads);
  tracking.deallocate(w, 40 * kMiB, 256, Category::kWeights);
  EXPECT_EQ(tracking.stats().current, 0u);
  EXPECT_EQ(limit.in_use(), 0u);

  // The leaf's own out-of-memory comes up through the adaptors with the tracking table added.
  memory::LimitResource roomy(leaf.get(), UINT64_MAX / 2);
  memory::TrackingResource tracked(&roomy);
  void* kept = *tracked.allocate(4 * kMiB, 256, Category::kOptimizer);
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  Result<void*> huge = tracked.allocate(total_b + kGiB, 256, Category::kActivations);
  ASSERT_FALSE(huge.is_ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(huge.status().message().find("cudaMalloc"), std::string::npos);
  EXPECT_NE(huge.status().message().find("optimizer"), std::string::npos);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  tracked.deallocate(kept, 4 * kMiB, 256, Category::kOptimizer);
}

TEST(PinnedHostResource, IsPageLockedHostMemory) {
  HR_CUDA_OPS_OR_SKIP(ops);
  Result<std::unique_ptr<PinnedHostResource>> r = PinnedHostResource::create();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const size_t n = 1 << 20;
  float* p = static_cast<float*>(*(*r)->allocate(n * 4, 4096, Category::kStaging));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u);
  cudaPointerAttributes attr{};
  HR_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  EXPECT_EQ(attr.type, cudaMemoryTypeHost);
  for (size_t i = 0; i < n; i++) p[i] = float(i % 1000);
  // An asynchronous round trip through the device on the h2d stream's kind of copy.
  cudaStream_t s;
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* d = nullptr;
  HR_CUDA_CHECK(cudaMalloc(&d, n * 4));
  HR_CUDA_CHECK(cudaMemcpyAsync(d, p, n * 4, cudaMemcpyHostToDevice, s));
  float* q = static_cast<float*>(*(*r)->allocate(n * 4, 64, Category::kOffload));
  HR_CUDA_CHECK(cudaMemcpyAsync(q, d, n * 4, cudaMemcpyDeviceToHost, s));
  HR_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(std::memcmp(p, q, n * 4), 0);
  HR_CUDA_CHECK(cudaFree(d));
  HR_CUDA_CHECK(cudaStreamDestroy(s));
  (*r)->deallocate(q, n * 4, 64, Category::kOffload);
  (*r)->deallocate(p, n * 4, 4096, Category::kStaging);
}

// Managed memory never oversubscribes: the capacity is the device's free memory at creation,
// and a request past it is refused before the runtime is asked (free memory does not move).
TEST(ManagedResource, RefusesToOversubscribeTheDevice) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const int dev = *backend::cuda::process_device();
  size_t free_before = 0, total = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  Result<std::unique_ptr<ManagedResource>> r = ManagedResource::create(dev);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ManagedResource& m = **r;
  EXPECT_LE(m.capacity(), total);
  EXPECT_GT(m.capacity(), 0u);
  // Counted in 2 MiB granules: 1 byte takes one.
  void* small = *m.allocate(1, 64, Category::kWeights);
  EXPECT_EQ(m.in_use(), ManagedResource::kGranularity);
  static_cast<volatile char*>(small)[0] = 7;  // host-visible
  Result<void*> too_much = m.allocate(m.capacity(), 256, Category::kActivations);
  ASSERT_FALSE(too_much.is_ok());
  EXPECT_EQ(too_much.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(too_much.status().message().find("never oversubscribes"), std::string::npos);
  EXPECT_NE(too_much.status().message().find(format_bytes(m.capacity())), std::string::npos);
  EXPECT_EQ(m.in_use(), ManagedResource::kGranularity);  // the refused request is not counted
  m.deallocate(small, 1, 64, Category::kWeights);
  EXPECT_EQ(m.in_use(), 0u);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(DeviceBudget, IsFreeMemoryLessTheMarginAndShrinksWithAllocations) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const int dev = *backend::cuda::process_device();
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  Result<uint64_t> b0 = backend::cuda::device_budget_bytes(256 * kMiB, dev);
  ASSERT_TRUE(b0.is_ok()) << b0.status().to_string();
  EXPECT_LE(*b0, uint64_t(free_b) - 256 * kMiB);
  EXPECT_EQ(*backend::cuda::device_budget_bytes(uint64_t(total_b) * 2, dev), 0u);
  std::unique_ptr<CudaDeviceResource> leaf = device_leaf();
  void* p = *leaf->allocate(kGiB, 256, Category::kWeights);
  Result<uint64_t> b1 = backend::cuda::device_budget_bytes(256 * kMiB, dev);
  ASSERT_TRUE(b1.is_ok());
  // At least the gigabyte less (the driver may round the allocation up, never down); other
  // processes on a shared GPU could move it by more, never make it grow past the allocation.
  EXPECT_LE(*b1 + kGiB, *b0 + 4 * kMiB);
  leaf->deallocate(p, kGiB, 256, Category::kWeights);
  Result<uint64_t> bad = backend::cuda::device_budget_bytes(0, -1);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(ContextBytes, MeasuredOnceAndPlausible) {
  HR_CUDA_OPS_OR_SKIP(ops);
  Result<uint64_t> a = backend::cuda::context_bytes();
  ASSERT_TRUE(a.is_ok()) << a.status().to_string();
  size_t free_b = 0, total_b = 0;
  HR_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  // A context takes some device memory (tens to hundreds of MiB) and was measured before the
  // table's 96 MiB of workspaces, so it is below what is used now.
  EXPECT_GT(*a, 0u);
  EXPECT_LE(*a + backend::cuda::fixed_device_bytes().op_workspace, uint64_t(total_b - free_b));
  EXPECT_EQ(*backend::cuda::context_bytes(), *a);  // once per process
  std::printf("CUDA context: %s on device %d (total - free before any allocation of ours)\n",
              format_bytes(*a).c_str(), *backend::cuda::process_device());
}

TEST(ProcessDevice, IsInRange) {
  HR_CUDA_OPS_OR_SKIP(ops);
  int count = 0;
  HR_CUDA_CHECK(cudaGetDeviceCount(&count));
  Result<int> d = backend::cuda::process_device();
  ASSERT_TRUE(d.is_ok());
  EXPECT_GE(*d, 0);
  EXPECT_LT(*d, count);
  int current = -1;
  HR_CUDA_CHECK(cudaGetDevice(&current));
  EXPECT_EQ(current, *d);  // the op table made it current
}

// The factories succeed exactly when a device is usable; without one each says why (the
// runtime's reason) instead of crashing, and the test then reports the skip.
TEST(CudaResources, FactoriesSucceedExactlyWhenADeviceIsUsable) {
  std::string why;
  const bool available = backend::cuda::device_available(&why);
  const std::vector<Status> statuses = {
      CudaDeviceResource::create(0).status(),  PinnedHostResource::create().status(),
      ManagedResource::create(0).status(),     backend::cuda::device_budget_bytes(0, 0).status(),
      backend::cuda::context_bytes().status(), backend::cuda::process_device().status()};
  for (const Status& st : statuses) {
    if (available) {
      EXPECT_TRUE(st.is_ok()) << st.to_string();
    } else {
      EXPECT_EQ(st.code(), StatusCode::kUnsupported) << st.to_string();
      EXPECT_NE(st.message().find(why), std::string::npos) << st.to_string();
    }
  }
  if (!available) GTEST_SKIP() << "no CUDA device: " << why;
}

}  // namespace
}  // namespace headroom
