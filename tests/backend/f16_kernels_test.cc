// The fp16 overloads against the fp32 kernels on the same (f16-representable) inputs. An f16
// GEMM widens its f16 operands exactly and runs the fp32 GEMM (Note [fp16 GEMMs]), so an fp32
// result is bit-identical to the fp32 kernel's and an f16 result is that rounded once; the other
// kernels compute in fp32 and round once (relative 2^-11: half an ulp of an 11-bit significand).
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "kernel_test_util.h"

namespace headroom::cpu {
namespace {

using testing::expect_close;
using testing::from_h;
using testing::h_rand;  // values that f16 holds exactly, so both paths see the same inputs
using testing::rand_vec;
using testing::to_h;
using testing::VecF;
using testing::VecH;
// Each value of `ref` rounded once to f16.
VecF rounded(const VecF& ref) {
  VecF out(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) out[i] = round_f16(ref[i]);
  return out;
}

constexpr double kRound = 1.0 / 2048;  // one f16 rounding, relative

// A staging area for the f16 GEMMs of a test, bound for its scope.
struct Staging {
  explicit Staging(size_t floats) : area(floats, NAN), bind(area.data(), area.size()) {}
  VecF area;
  F16GemmStaging bind;
};

TEST(F16, RoundingIsNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(from_f32<f16_t>(1.0f).bits, 0x3c00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(from_f32<f16_t>(1.0f + 1.0f / 2048).bits, 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties to even (1 + 2^-9).
  EXPECT_EQ(from_f32<f16_t>(1.0f + 3.0f / 2048).bits, 0x3c02);
  EXPECT_EQ(from_f32<f16_t>(-2.0f).bits, 0xc000);
  EXPECT_EQ(from_f32<f16_t>(65504.0f).bits, 0x7bff);  // the largest f16
  // 65520 is halfway between 65504 and 65536 (= infinity): ties to even overflow to infinity.
  EXPECT_EQ(from_f32<f16_t>(65520.0f).bits, 0x7c00);
  EXPECT_EQ(from_f32<f16_t>(65519.0f).bits, 0x7bff);
  EXPECT_EQ(from_f32<f16_t>(1e6f).bits, 0x7c00);
  EXPECT_EQ(from_f32<f16_t>(std::ldexp(1.0f, -24)).bits, 0x0001);  // the smallest subnormal
  EXPECT_EQ(from_f32<f16_t>(std::ldexp(1.0f, -25)).bits, 0x0000);  // a tie: to even (zero)
  EXPECT_TRUE(std::isnan(to_f32(from_f32<f16_t>(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(to_f32(f16_t{0x7c00})));
  // The scalar path, the vector cast (vcvtps2ph) and core's portable conversion agree on many
  // values, subnormals, overflow and signed zero included (NaN: still NaN).
  VecF x = rand_vec(4099, 1, -7e4f, 7e4f);
  VecF small = rand_vec(1000, 2, -1e-4f, 1e-4f);
  x.insert(x.end(), small.begin(), small.end());
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = -0.0f;
  x[7] = 1e-40f;
  x[8] = -std::numeric_limits<float>::infinity();
  VecH v(x.size());
  cast_to_f16(v.data(), x.data(), int64_t(x.size()));
  VecF r(x.size());
  round_to_f16_values(r.data(), x.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) {
      ASSERT_TRUE(std::isnan(to_f32(v[i])) && std::isnan(r[i]));
      continue;
    }
    ASSERT_EQ(v[i].bits, f32_to_f16_bits(x[i])) << i << ": " << x[i];
    ASSERT_EQ(from_f32<f16_t>(x[i]).bits, f32_to_f16_bits(x[i])) << i;
    ASSERT_EQ(r[i], f16_bits_to_f32(f32_to_f16_bits(x[i]))) << i;
  }
  // Widening is exact: every f16 bit pattern but NaN comes back unchanged.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16_t h{uint16_t(b)};
    const float f = to_f32(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f, f16_bits_to_f32(uint16_t(b))) << b;
    ASSERT_EQ(from_f32<f16_t>(f).bits, b) << b;
  }
}

TEST(F16, LayerNorm) { testing::check_layernorm_low<f16_t>(1e-7, kRound); }

// fp16: the loss's backward writes fp32 holding the f16 rounding of each gradient, in the same
// pass: the bits of the fp32 gradient rounded once (small values become f16 subnormals or 0).
TEST(F16, CrossEntropyBackwardRoundsToF16Values) {
  const int N = 5, V = 2100;
  VecF logits = rand_vec(size_t(N) * V, 50, -12, 12);
  std::vector<int32_t> tg = {3, -1, V - 1, 0, 1000};
  VecF loss(N), lse(N);
  cross_entropy_forward(loss.data(), lse.data(), logits.data(), tg.data(), N, V);
  VecF f32 = logits, h = logits;
  cross_entropy_backward_inplace(f32.data(), lse.data(), tg.data(), N, V, 0.2f, DType::kF32);
  cross_entropy_backward_inplace(h.data(), lse.data(), tg.data(), N, V, 0.2f, DType::kF16);
  for (size_t i = 0; i < h.size(); ++i) {
    ASSERT_EQ(h[i], f16_bits_to_f32(f32_to_f16_bits(f32[i]))) << i;
  }
}

// atol: results below f16's normal range (2^-14) are subnormal, with an absolute ulp of 2^-24.
TEST(F16, Gelu) { testing::check_gelu_low<f16_t>(kRound); }

// Every finite input's GELU and gelu' within one step of the exact value rounded to f16_t.
TEST(F16, GeluIsFaithfullyRoundedOnEveryInput) {
  const double share = testing::check_gelu_faithful<f16_t>();
  RecordProperty("correctly_rounded_percent", std::to_string(100.0 * share));
  std::printf("GELU forward correctly rounded on %.2f%% of finite inputs\n", 100.0 * share);
}

// Every 16-bit input through the kernels (tables with AVX-512) equals the computed path, bit for
// bit: forward, and backward with douts of both signs, one that rounds, a large and a tiny one.
TEST(F16, GeluEveryInputMatchesTheComputedPath) {
  testing::check_gelu_every_input<f16_t>({1.0f, -0.5f, 0.3f, 1000.0f, 1e-5f});
}

// The f16 GEMMs widen exactly and run the fp32 GEMM: fp32 outputs are bit-identical to the fp32
// kernel on the same values, f16 outputs are those rounded once, and accumulated weight
// gradients are bit-identical too.
TEST(F16, MatmulIsTheFp32GemmOnWidenedOperands) {
  const int N = 33, IC = 48, OC = 80;
  Staging staging(f16_matmul_staging_floats(N, IC, OC));
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    SCOPED_TRACE(layout == WeightLayout::kInOut ? "in-out" : "out-in");
    VecF x = h_rand(size_t(N) * IC, 9), w = h_rand(size_t(IC) * OC, 10), b = rand_vec(OC, 11);
    VecH xh = to_h(x);
    VecF out(size_t(N) * OC), outf(size_t(N) * OC);
    VecH outh(size_t(N) * OC);
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC, layout);
    matmul_forward(outf.data(), xh.data(), w.data(), b.data(), N, IC, OC, layout);
    matmul_forward(outh.data(), xh.data(), w.data(), b.data(), N, IC, OC, layout);
    EXPECT_EQ(outf, out);
    EXPECT_EQ(from_h(outh), rounded(out));

    VecF dout = h_rand(size_t(N) * OC, 12);
    VecH douth = to_h(dout);
    VecF dx(size_t(N) * IC), dw(size_t(IC) * OC, 1.0f), db(OC, 1.0f);
    VecH dxh(size_t(N) * IC);
    VecF dw2 = dw, db2 = db;
    matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), N, IC, OC,
                    layout);
    matmul_backward(dxh.data(), dw2.data(), db2.data(), douth.data(), xh.data(), w.data(), N, IC,
                    OC, layout);
    EXPECT_EQ(from_h(dxh), rounded(dx));
    EXPECT_EQ(dw2, dw);
    expect_close(db2, db, 1e-6, 1e-6, "matmul dbias (accumulated)");
    // The LM head's form: dout in fp32 holding f16 values.
    VecH dxh2(size_t(N) * IC);
    VecF dw3(size_t(IC) * OC, 1.0f);
    matmul_backward(dxh2.data(), dw3.data(), nullptr, dout.data(), xh.data(), w.data(), N, IC, OC,
                    layout);
    EXPECT_EQ(from_h(dxh2), from_h(dxh));
    EXPECT_EQ(dw3, dw);
  }
}

TEST(F16, MatmulPaddedStrides) {
  const int N = 8, IC = 16, OC = 40;
  const int64_t ldo = 56;
  Staging staging(f16_matmul_staging_floats(N, IC, OC));
  VecF x = h_rand(size_t(N) * IC, 13), w = h_rand(size_t(IC) * OC, 14);
  VecH xh = to_h(x);
  VecH out(size_t(N) * ldo, f16_t{0x7e00});  // NaN padding must stay untouched
  matmul_forward(out.data(), xh.data(), w.data(), nullptr, N, IC, OC, WeightLayout::kInOut,
                 {.inp = 0, .out = ldo});
  VecF ref(size_t(N) * OC);
  matmul_forward(ref.data(), x.data(), w.data(), nullptr, N, IC, OC, WeightLayout::kInOut);
  for (int n = 0; n < N; ++n) {
    for (int c = 0; c < OC; ++c) {
      EXPECT_EQ(to_f32(out[size_t(n) * ldo + c]), round_f16(ref[size_t(n) * OC + c]));
    }
    for (int64_t c = OC; c < ldo; ++c) EXPECT_EQ(out[size_t(n) * ldo + c].bits, 0x7e00);
  }
}

TEST(F16DeathTest, GemmWithoutEnoughStagingStops) {
  const int N = 8, IC = 16, OC = 40;
  VecH x(size_t(N) * IC, f16_t{0x3c00});
  VecF w(size_t(IC) * OC, 1.0f), out(size_t(N) * OC);
  EXPECT_DEATH(
      {
        Staging staging(f16_matmul_staging_floats(N, IC, OC) / 4);
        VecH outh(size_t(N) * OC);
        matmul_forward(outh.data(), x.data(), w.data(), nullptr, N, IC, OC, WeightLayout::kInOut);
      },
      "staging area is smaller");
  EXPECT_DEATH(
      matmul_forward(out.data(), x.data(), w.data(), nullptr, N, IC, OC, WeightLayout::kInOut),
      "without its staging area");
}

// f16 attention always runs the fp32 kernels on widened copies.
void check_attention(testing::AttnShape s) { testing::check_attention_widened<f16_t>(s, kRound); }

TEST(F16, AttentionTiledSmall) { check_attention({2, 7, 24, 3}); }
TEST(F16, AttentionTiledPartialBlocks) { check_attention({1, 130, 128, 2}); }

TEST(F16, FusedHead) {
  const int N = 19, C = 32, V = 301, chunk = 8;
  VecF x = h_rand(size_t(N) * C, 30, -2, 2), wte = h_rand(size_t(V) * C, 31, -0.5f, 0.5f);
  VecH xh = to_h(x);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[size_t(i)] = i == 4 ? -1 : (i * 37) % V;
  VecF losses(N), lse(N), losses2(N), lse2(N), scratch(lm_head_ce_scratch_floats(chunk, V));
  // fp16 keeps its dlogits as f16 values in the fp32 logits: no larger scratch than fp32.
  VecF scratch_h(lm_head_ce_scratch_floats(chunk, V, DType::kF16), NAN);
  EXPECT_EQ(scratch_h.size(), scratch.size());
  Staging staging(size_t(2) * chunk * C);
  lm_head_ce_forward(losses.data(), lse.data(), x.data(), wte.data(), targets.data(), N, C, V,
                     chunk, scratch.data());
  lm_head_ce_forward(losses2.data(), lse2.data(), xh.data(), wte.data(), targets.data(), N, C, V,
                     chunk, scratch_h.data());
  // The same fp32 GEMM on the same values: identical.
  EXPECT_EQ(losses2, losses);
  EXPECT_EQ(lse2, lse);

  const float dloss = 1024.0f / 18;  // a loss-scaled gradient, as fp16 trains
  VecF dx(size_t(N) * C), dwte(size_t(V) * C, 0.5f), dwte2 = dwte;
  VecH dxh(size_t(N) * C);
  lm_head_ce_backward(dx.data(), dwte.data(), x.data(), wte.data(), targets.data(), lse.data(), N,
                      C, V, chunk, dloss, scratch.data());
  lm_head_ce_backward(dxh.data(), dwte2.data(), xh.data(), wte.data(), targets.data(), lse.data(),
                      N, C, V, chunk, dloss, scratch_h.data());
  // dlogits are rounded to f16 before the GEMMs (relative 2^-11 per term), dx once more when
  // stored; atol covers cancellation in sums of +/- terms (dx ~ dloss * |wte| ~ 30).
  expect_close(from_h(dxh), dx, 2e-2, 3 * kRound, "head dx");
  expect_close(dwte2, dwte, 2e-2, 3 * kRound, "head dwte");
}

}  // namespace
}  // namespace headroom::cpu
