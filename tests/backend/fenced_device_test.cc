// The fenced device (backend/fenced): its memory kills a host touch outside an op with SIGSEGV,
// opens inside every op (and in nested windows), copies in and out, and its ops give the CPU's
// bits on the same inputs.
#include "backend/fenced/fenced_ops.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "memory/arena.h"

namespace headroom::backend {
namespace {

// A host read or write of a fenced block: SIGSEGV (AddressSanitizer reports it as a SEGV and
// exits instead of dying by the signal).
#if defined(__SANITIZE_ADDRESS__)
#define EXPECT_SEGV(stmt) EXPECT_DEATH(stmt, "SEGV")
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EXPECT_SEGV(stmt) EXPECT_DEATH(stmt, "SEGV")
#endif
#endif
#ifndef EXPECT_SEGV
#define EXPECT_SEGV(stmt) EXPECT_EXIT(stmt, ::testing::KilledBySignal(SIGSEGV), "")
#endif

// Reads and writes the compiler cannot drop.
float host_read(const float* p) { return *static_cast<const volatile float*>(p); }
void host_write(float* p, float v) { *static_cast<volatile float*>(p) = v; }

float* allocate_floats(FencedResource* r, size_t n) {
  Result<void*> p = r->allocate(n * sizeof(float));
  HR_CHECK(p.is_ok());
  return static_cast<float*>(*p);
}

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class FencedDevice : public ::testing::Test {
 protected:
  // The death tests' children start afresh (the training tests' OpenMP threads exist).
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(FencedDevice, AHostTouchOutsideAnOpDies) {
  FencedResource r;
  FencedOps ops(&r);
  float* p = allocate_floats(&r, 1000);
  host_write(p, 1.0f);  // not fenced yet: host memory
  EXPECT_EQ(host_read(p), 1.0f);
  r.fence();
  EXPECT_TRUE(r.fenced());
  EXPECT_SEGV(host_read(p));
  EXPECT_SEGV(host_write(p + 999, 2.0f));  // the block's last float
  // After an op the fence is back.
  ops.fill_bytes(p, 0, 1000 * sizeof(float));
  EXPECT_SEGV(host_read(p));
  r.unfence();
  EXPECT_EQ(host_read(p), 0.0f);  // the op wrote it; unfenced, the host reads it
  r.deallocate(p, 1000 * sizeof(float));
}

// The fence closes blocks in runs of adjacent mappings: every block, whatever its neighbours
// (one freed in the middle leaves a gap), is fenced again after an op.
TEST_F(FencedDevice, EveryBlockIsFencedAgainAfterAnOp) {
  FencedResource r;
  FencedOps ops(&r);
  const size_t sizes[] = {1, 3, 1000, 5000, 1025, 7};
  std::vector<float*> blocks;
  for (size_t n : sizes) blocks.push_back(allocate_floats(&r, n));
  r.deallocate(blocks[2], sizes[2] * sizeof(float));
  r.fence();
  ops.fill_bytes(blocks[0], 0, sizeof(float));
  for (size_t i = 0; i < blocks.size(); i++) {
    if (i == 2) continue;
    SCOPED_TRACE(::testing::Message() << "block " << i);
    EXPECT_SEGV(host_read(blocks[i] + sizes[i] - 1));
  }
}

TEST_F(FencedDevice, BlocksAllocatedWhileFencedAreBornFenced) {
  FencedResource r;
  r.fence();
  float* p = allocate_floats(&r, 16);
  EXPECT_SEGV(host_write(p, 1.0f));
  // Through the adaptors and an arena, as the trainer allocates.
  memory::BufferDesc b{"x", DType::kF32, Shape{64}, memory::Category::kActivations};
  Result<memory::Arena> a = memory::Arena::create(&r, {b}, memory::sequential_layout({b}),
                                                  memory::Category::kActivations);
  ASSERT_TRUE(a.is_ok());
  EXPECT_TRUE(r.contains(a->data(0), 64 * sizeof(float)));
  EXPECT_SEGV(host_read(a->f32(0)));
  r.deallocate(p, 16 * sizeof(float));
}

TEST_F(FencedDevice, WindowsNestAndCloseWithTheLast) {
  FencedResource r;
  float* p = allocate_floats(&r, 4);
  r.fence();
  {
    FencedResource::Window outer(&r);
    host_write(p, 3.0f);
    {
      FencedResource::Window inner(&r);
      host_write(p + 1, 4.0f);
    }
    // The inner window closed; the outer one still holds the memory open.
    EXPECT_EQ(host_read(p + 1), 4.0f);
  }
  EXPECT_SEGV(host_read(p));
  r.unfence();
  EXPECT_EQ(host_read(p), 3.0f);
  r.deallocate(p, 4 * sizeof(float));
}

TEST_F(FencedDevice, CopiesRoundTrip) {
  FencedResource r;
  r.fence();
  FencedOps ops(&r);
  EXPECT_FALSE(ops.host_addressable());
  EXPECT_EQ(ops.name(), "fenced");
  const size_t n = 10000;  // several pages
  const std::vector<float> src = random_floats(n, 1);
  float* d = allocate_floats(&r, n);
  ops.copy_to_device(d, src.data(), n * sizeof(float));
  std::vector<float> back(n, 0.0f);
  ops.copy_to_host(back.data(), d, n * sizeof(float));
  EXPECT_EQ(0, std::memcmp(back.data(), src.data(), n * sizeof(float)));
  // fill_bytes, read back through a copy.
  ops.fill_bytes(d + 10, 0xff, 5 * sizeof(float));
  ops.copy_to_host(back.data(), d, n * sizeof(float));
  uint32_t bits;
  std::memcpy(&bits, &back[12], 4);
  EXPECT_EQ(bits, 0xffffffffu);
  EXPECT_EQ(back[9], src[9]);
  EXPECT_EQ(back[15], src[15]);
  // Each op opened and closed the block once: two mprotect calls.
  ASSERT_EQ(r.live_blocks(), 1u);
  const uint64_t before = r.protect_calls();
  ops.copy_to_host(back.data(), d, sizeof(float));
  EXPECT_EQ(r.protect_calls() - before, 2u);
  r.deallocate(d, n * sizeof(float));
  EXPECT_EQ(r.live_blocks(), 0u);
  EXPECT_FALSE(r.contains(d));
}

// The other direction: an op's device operands must be the device's memory (a GPU kernel
// cannot read host memory either), and a copy must stay inside its block.
TEST_F(FencedDevice, AnOpGivenHostMemoryAborts) {
  FencedResource r;
  r.fence();
  FencedOps ops(&r);
  std::vector<float> host(1024, 1.0f);
  float* d = allocate_floats(&r, 1024);  // exactly one 4 KiB page
  EXPECT_DEATH(ops.zero(host.data(), 1024), "zero was given .* not the device's memory");
  EXPECT_DEATH(ops.residual_forward(d, d, host.data(), 1024), "residual_forward was given");
  EXPECT_DEATH(ops.copy_to_device(d, host.data(), 1025 * sizeof(float)), "copy_to_device");
  EXPECT_DEATH(ops.copy_to_host(host.data(), host.data(), 4), "copy_to_host");
  // Null operands (an absent bias) and host-side pointers of copies are fine.
  ops.copy_to_device(d, host.data(), 1024 * sizeof(float));
  ops.residual_forward(d, d, d, 1024);
  ops.copy_to_host(host.data(), d, 1024 * sizeof(float));
  EXPECT_EQ(host[7], 2.0f);
  r.deallocate(d, 1024 * sizeof(float));
}

TEST_F(FencedDevice, AlignmentBeyondAPage) {
  FencedResource r;
  const size_t align = size_t(1) << 16;
  Result<void*> p = r.allocate(100, align);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % align, 0u);
  EXPECT_TRUE(r.contains(*p, 100));
  r.deallocate(*p, 100, align);
  EXPECT_EQ(r.live_blocks(), 0u);
}

// The ops on fenced memory are the inner table's: the same bits as cpu_ops() on host memory.
TEST_F(FencedDevice, OpsOnFencedMemoryEqualTheCpus) {
  FencedResource r;
  r.fence();
  FencedOps ops(&r);
  const Ops& cpu = cpu_ops();
  const int N = 24, IC = 48, OC = 40;
  const std::vector<float> x = random_floats(size_t(N) * IC, 2),
                           w = random_floats(size_t(IC) * OC, 3),
                           bias = random_floats(size_t(OC), 4);
  auto upload = [&](const std::vector<float>& h) {
    float* d = allocate_floats(&r, h.size());
    ops.copy_to_device(d, h.data(), h.size() * sizeof(float));
    return d;
  };
  auto download = [&](const float* d, size_t n) {
    std::vector<float> h(n);
    ops.copy_to_host(h.data(), d, n * sizeof(float));
    return h;
  };
  float* dx = upload(x);
  float* dw = upload(w);
  float* db = upload(bias);
  float* dout = allocate_floats(&r, size_t(N) * OC);
  // matmul with a bias
  std::vector<float> out(size_t(N) * OC);
  cpu.matmul_forward(out.data(), x.data(), w.data(), bias.data(), N, IC, OC, WeightLayout::kInOut,
                     {});
  ops.matmul_forward(dout, dx, dw, db, N, IC, OC, WeightLayout::kInOut, {});
  EXPECT_EQ(download(dout, out.size()), out);
  // layernorm over the matmul's output
  const std::vector<float> g = random_floats(size_t(OC), 5);
  float* dg = upload(g);
  std::vector<float> ln(out.size()), mean(N), rstd(N);
  float* dln = allocate_floats(&r, out.size());
  float* dmean = allocate_floats(&r, N);
  float* drstd = allocate_floats(&r, N);
  cpu.layernorm_forward(ln.data(), mean.data(), rstd.data(), out.data(), g.data(), bias.data(), N,
                        OC);
  ops.layernorm_forward(dln, dmean, drstd, dout, dg, db, N, OC);
  EXPECT_EQ(download(dln, ln.size()), ln);
  EXPECT_EQ(download(drstd, size_t(N)), rstd);
  // a reduction returned to the host
  EXPECT_EQ(ops.sum_squares(dln, int64_t(ln.size())),
            cpu.sum_squares(ln.data(), int64_t(ln.size())));
  // AdamW updates params, m and v in place and zeroes the gradients
  std::vector<float> p = w, gr = random_floats(w.size(), 6), m(w.size(), 0.0f), v(w.size(), 0.0f);
  float* dp = dw;
  float* dgr = upload(gr);
  float* dm = upload(m);
  float* dv = upload(v);
  const AdamWParams ap{1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 1, 1.0f};
  cpu.adamw_update(p.data(), gr.data(), m.data(), v.data(), int64_t(p.size()), ap, nullptr, true);
  ops.adamw_update(dp, dgr, dm, dv, int64_t(p.size()), ap, nullptr, true);
  EXPECT_EQ(download(dp, p.size()), p);
  EXPECT_EQ(download(dm, m.size()), m);
  EXPECT_EQ(download(dv, v.size()), v);
  EXPECT_EQ(download(dgr, gr.size()), gr);
  // the masked loss sum reads losses and targets on the device
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; i++) targets[size_t(i)] = i % 5 == 0 ? -1 : i;
  int32_t* dt = static_cast<int32_t*>(*r.allocate(N * sizeof(int32_t)));
  ops.copy_to_device(dt, targets.data(), N * sizeof(int32_t));
  int64_t count_cpu = 0, count_fenced = 0;
  EXPECT_EQ(ops.masked_loss_sum(drstd, dt, N, &count_fenced),
            cpu.masked_loss_sum(rstd.data(), targets.data(), N, &count_cpu));
  EXPECT_EQ(count_fenced, count_cpu);
  EXPECT_EQ(r.live_blocks(), 12u);  // the destructor unmaps what is left
}

}  // namespace
}  // namespace headroom::backend
