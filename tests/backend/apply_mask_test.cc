// The sparsity mask's op (Ops::apply_mask, docs/notes/pruning.md): +0.0f exactly where the mask
// is 0 (a -0.0 and a NaN too), every other element's bits kept (NaN, -0.0, infinities), nothing
// written past n; the CPU table against a plain loop of model::apply_mask's contract, and the
// fenced device's op on fenced memory against the CPU's bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "backend/fenced/fenced_ops.h"
#include "backend/ops.h"

namespace headroom::backend {
namespace {

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Values with the edges a multiply would get wrong (-0.0, NaN, inf) among random ones, and a
// mask with runs and isolated zeros.
void make_inputs(size_t n, uint32_t seed, std::vector<float>* x, std::vector<uint8_t>* mask) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  x->resize(n);
  mask->resize(n);
  for (size_t i = 0; i < n; i++) {
    (*x)[i] = d(rng);
    (*mask)[i] = uint8_t(rng() % 3 != 0);  // any non-zero byte keeps
    if (i % 7 == 0) (*mask)[i] = uint8_t(2 + rng() % 200);
  }
  const float edges[] = {-0.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity(), -1e-40f};
  for (size_t i = 0; i + 8 < n; i += 97) {
    for (size_t e = 0; e < 4; e++) {
      (*x)[i + 2 * e] = edges[e];
      (*x)[i + 2 * e + 1] = edges[e];
      (*mask)[i + 2 * e] = 0;
      (*mask)[i + 2 * e + 1] = 1;
    }
  }
}

// The contract, written out: +0.0f where the mask is 0, the element itself elsewhere.
std::vector<float> reference(const std::vector<float>& x, const std::vector<uint8_t>& mask,
                             size_t off, size_t n) {
  std::vector<float> r = x;
  for (size_t i = off; i < off + n; i++) {
    if (mask[i] == 0) r[i] = +0.0f;
  }
  return r;
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); i++)
    ASSERT_EQ(bits(got[i]), bits(want[i])) << what << " element " << i << ": " << got[i];
}

TEST(ApplyMask, CpuOpIsTheContract) {
  for (size_t n : {size_t(1), size_t(13), size_t(4096), size_t(100003)}) {
    for (size_t off : {size_t(0), size_t(3)}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " offset=" << off);
      std::vector<float> x;
      std::vector<uint8_t> mask;
      make_inputs(n + off + 5, uint32_t(n + off), &x, &mask);
      const std::vector<float> want = reference(x, mask, off, n);
      cpu_ops().apply_mask(mask.data() + off, x.data() + off, int64_t(n));
      expect_bits(x, want, "cpu");  // also: nothing before off or past n written
    }
  }
  // A second pass changes nothing; n = 0 touches nothing.
  std::vector<float> x;
  std::vector<uint8_t> mask;
  make_inputs(1000, 5, &x, &mask);
  cpu_ops().apply_mask(mask.data(), x.data(), 1000);
  const std::vector<float> once = x;
  cpu_ops().apply_mask(mask.data(), x.data(), 1000);
  expect_bits(x, once, "twice");
  cpu_ops().apply_mask(nullptr, nullptr, 0);
}

TEST(ApplyMask, FencedOpEqualsTheCpusBits) {
  FencedResource device;
  device.fence();
  FencedOps ops(&device);
  const size_t n = 50001;
  std::vector<float> x;
  std::vector<uint8_t> mask;
  make_inputs(n, 11, &x, &mask);
  Result<void*> dx = device.allocate(n * sizeof(float));
  Result<void*> dm = device.allocate(n);
  ASSERT_TRUE(dx.is_ok() && dm.is_ok());
  ops.copy_to_device(*dx, x.data(), n * sizeof(float));
  ops.copy_to_device(*dm, mask.data(), n);
  ops.apply_mask(static_cast<const uint8_t*>(*dm), static_cast<float*>(*dx), int64_t(n));
  std::vector<float> got(n);
  ops.copy_to_host(got.data(), *dx, n * sizeof(float));
  cpu_ops().apply_mask(mask.data(), x.data(), int64_t(n));
  expect_bits(got, x, "fenced");
  expect_bits(got, reference(got, mask, 0, n), "fenced contract");
  device.deallocate(*dm, n);
  device.deallocate(*dx, n * sizeof(float));
}

}  // namespace
}  // namespace headroom::backend
