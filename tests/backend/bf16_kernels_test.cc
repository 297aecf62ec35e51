// The bf16 overloads against the fp32 kernels on the same (bf16-representable) inputs. A bf16
// result is the fp32 result rounded once, plus the rounding of any bf16 intermediate the kernel
// feeds a GEMM (as under torch.autocast); tolerances say which.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "kernel_test_util.h"

namespace headroom::cpu {
namespace {

using testing::AttnShape;
using testing::bf_rand;  // values that bf16 holds exactly, so both paths see the same inputs
using testing::expect_close;
using testing::from_bf;
using testing::rand_vec;
using testing::to_bf;
using testing::VecB;
using testing::VecF;

// One bf16 rounding: relative error <= 2^-8 (half an ulp of an 8-bit significand, 2^-7 of the
// power of two below the value).
constexpr double kRound = 1.0 / 256;

TEST(Bf16, RoundingIsNearestEvenAndKeepsSpecials) {
  EXPECT_EQ(from_f32<bf16_t>(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(from_f32<bf16_t>(1.0f + 1.0f / 256).bits, 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(from_f32<bf16_t>(1.0f + 3.0f / 256).bits, 0x3f82);
  EXPECT_EQ(from_f32<bf16_t>(-2.0f).bits, 0xc000);
  EXPECT_EQ(from_f32<bf16_t>(std::numeric_limits<float>::infinity()).bits, 0x7f80);
  EXPECT_TRUE(std::isnan(to_f32(from_f32<bf16_t>(std::numeric_limits<float>::quiet_NaN()))));
  // The largest float rounds to infinity, as in PyTorch.
  EXPECT_EQ(from_f32<bf16_t>(std::numeric_limits<float>::max()).bits, 0x7f80);
  // The same as core's scalar conversion, and the vector cast kernel, on many values.
  VecF x = rand_vec(4099, 1, -1e4f, 1e4f);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = -0.0f;
  x[7] = 1e-40f;  // denormal
  VecB v(x.size());
  cast_to_bf16(v.data(), x.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(v[i].bits, f32_to_bf16_bits(x[i])) << i;
    ASSERT_EQ(from_f32<bf16_t>(x[i]).bits, f32_to_bf16_bits(x[i])) << i;
  }
}

// The vector rounding (vcvtneps2bf16 where the CPU has AVX512-BF16, with denormal inputs taken by
// the integer form) against the scalar one, on every sign and exponent and on mantissas that round
// down, tie (to even, both ways), round up and carry, NaNs with payloads, infinities and
// denormals: every upper half, with six lower halves.
TEST(Bf16, VectorRoundingMatchesScalarOnEveryExponent) {
  std::vector<float> x;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      x.push_back(std::bit_cast<float>((hi << 16) | lo));
    }
  }
  x.push_back(1e-40f);  // a denormal alone in a vector of normal values
  for (int i = 0; i < 15; ++i) x.push_back(1.0f + float(i));
  VecB v(x.size());
  cast_to_bf16(v.data(), x.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(v[i].bits, from_f32<bf16_t>(x[i]).bits)
        << i << ": " << std::hex << std::bit_cast<uint32_t>(x[i]);
    ASSERT_EQ(v[i].bits, f32_to_bf16_bits(x[i])) << i;
  }
}

TEST(Bf16, RoundRowsInPlaceMatchesTheCast) {
  const int rows = 5, cols = 37, ld = 41;
  VecF x = rand_vec(size_t(rows) * ld, 2);
  VecF orig = x;
  round_rows_to_bf16_inplace(x.data(), rows, cols, ld);
  const auto* b = reinterpret_cast<const bf16_t*>(x.data());
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) {
      ASSERT_EQ(b[int64_t(r) * 2 * ld + c].bits, f32_to_bf16_bits(orig[size_t(r) * ld + c]))
          << r << "," << c;
    }
  }
}

// The loss's backward writes the bf16 dlogits in the same pass, each row over the first half of
// its own fp32 row (bf16 row stride 2 V): the bits of the fp32 gradient rounded once, for several
// row counts and rows with an ignored target.
TEST(Bf16, CrossEntropyBackwardWritesBf16OverItsOwnRows) {
  for (int N : {1, 2, 3, 5, 17, 64}) {
    const int V = 2100;  // two softmax blocks, and V % 16 != 0
    VecF logits = rand_vec(size_t(N) * V, 40 + N, -6, 6);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int n = 0; n < N; ++n) tg[size_t(n)] = n % 4 == 1 ? -1 : (n * 131) % V;
    VecF loss(static_cast<size_t>(N)), lse(static_cast<size_t>(N));
    cross_entropy_forward(loss.data(), lse.data(), logits.data(), tg.data(), N, V);
    VecF f32 = logits, b = logits;
    cross_entropy_backward_inplace(f32.data(), lse.data(), tg.data(), N, V, 0.03f, DType::kF32);
    cross_entropy_backward_inplace(b.data(), lse.data(), tg.data(), N, V, 0.03f, DType::kBF16);
    const auto* out = reinterpret_cast<const bf16_t*>(b.data());
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < V; ++j) {
        ASSERT_EQ(out[n * 2 * V + j].bits, f32_to_bf16_bits(f32[size_t(n * V + j)]))
            << N << " rows, row " << n << ", column " << j;
      }
    }
  }
}

// Padded logits rows (the model's logits_row_stride): the same losses, lse and gradient bits as
// the dense rows, for each storage (bf16 over the first half of each fp32 row); the padding
// columns are neither read (NaN there changes nothing) nor written (f32, f16).
TEST(Bf16, CrossEntropyTakesPaddedRows) {
  const int V = 2100, ld = 2112;
  for (int N : {1, 3, 17, 64}) {
    VecF dense = rand_vec(size_t(N) * V, 70 + N, -6, 6);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int n = 0; n < N; ++n) tg[size_t(n)] = n % 4 == 1 ? -1 : (n * 131) % V;
    VecF padded(size_t(N) * ld, std::nanf(""));
    for (int n = 0; n < N; ++n) {
      std::copy_n(dense.begin() + int64_t(n) * V, V, padded.begin() + int64_t(n) * ld);
    }
    VecF loss(static_cast<size_t>(N)), lse(static_cast<size_t>(N)), loss_p(loss), lse_p(lse);
    cross_entropy_forward(loss.data(), lse.data(), dense.data(), tg.data(), N, V);
    cross_entropy_forward(loss_p.data(), lse_p.data(), padded.data(), tg.data(), N, V, ld);
    ASSERT_EQ(loss, loss_p) << N;
    ASSERT_EQ(lse, lse_p) << N;
    for (DType storage : {DType::kF32, DType::kF16, DType::kBF16}) {
      VecF d = dense, dp = padded;
      cross_entropy_backward_inplace(d.data(), lse.data(), tg.data(), N, V, 0.03f, storage);
      cross_entropy_backward_inplace(dp.data(), lse.data(), tg.data(), N, V, 0.03f, storage, ld);
      for (int n = 0; n < N; ++n) {
        for (int j = 0; j < V; ++j) {
          uint32_t got, want;
          if (storage == DType::kBF16) {
            got = reinterpret_cast<const bf16_t*>(dp.data())[int64_t(n) * 2 * ld + j].bits;
            want = reinterpret_cast<const bf16_t*>(d.data())[int64_t(n) * 2 * V + j].bits;
          } else {
            std::memcpy(&got, &dp[size_t(n) * ld + j], 4);
            std::memcpy(&want, &d[size_t(n) * V + j], 4);
          }
          ASSERT_EQ(got, want) << N << " rows, storage " << int(storage) << ", row " << n
                               << ", column " << j;
        }
        if (storage != DType::kBF16) {
          for (int j = V; j < ld; ++j) ASSERT_TRUE(std::isnan(dp[size_t(n) * ld + j]));
        }
      }
    }
  }
}

TEST(Bf16, LayerNorm) { testing::check_layernorm_low<bf16_t>(1e-6, kRound); }

TEST(Bf16, Gelu) { testing::check_gelu_low<bf16_t>(kRound); }

// Every finite input's GELU and gelu' within one step of the exact value rounded to bf16_t.
TEST(Bf16, GeluIsFaithfullyRoundedOnEveryInput) {
  const double share = testing::check_gelu_faithful<bf16_t>();
  RecordProperty("correctly_rounded_percent", std::to_string(100.0 * share));
  std::printf("GELU forward correctly rounded on %.2f%% of finite inputs\n", 100.0 * share);
}

// Every 16-bit input through the kernels (tables with AVX-512) equals the computed path, bit for
// bit: forward, and backward with douts of both signs, one that rounds, a large and a tiny one.
TEST(Bf16, GeluEveryInputMatchesTheComputedPath) {
  testing::check_gelu_every_input<bf16_t>({1.0f, -0.5f, 0.3f, 1000.0f, 1e-5f});
}

// bf16 GEMMs accumulate in fp32: with the same inputs, an fp32 result differs from the fp32
// kernel by accumulation order only, and a bf16 result by one rounding more.
TEST(Bf16, Matmul) {
  const int N = 33, IC = 48, OC = 80;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    SCOPED_TRACE(layout == WeightLayout::kInOut ? "in-out" : "out-in");
    VecF x = bf_rand(size_t(N) * IC, 9), w = bf_rand(size_t(IC) * OC, 10), b = rand_vec(OC, 11);
    VecB xb = to_bf(x), wb = to_bf(w);
    VecF out(size_t(N) * OC), outf(size_t(N) * OC);
    VecB outb(size_t(N) * OC);
    matmul_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC, layout);
    matmul_forward(outf.data(), xb.data(), wb.data(), b.data(), N, IC, OC, layout);
    matmul_forward(outb.data(), xb.data(), wb.data(), b.data(), N, IC, OC, layout);
    expect_close(outf, out, 1e-5, 1e-5, "matmul f32 out");
    expect_close(from_bf(outb), out, 1e-5, kRound, "matmul bf16 out");

    VecF dout = bf_rand(size_t(N) * OC, 12);
    VecB doutb = to_bf(dout);
    VecF dx(size_t(N) * IC), dw(size_t(IC) * OC, 1.0f), db(OC, 1.0f);
    VecB dxb(size_t(N) * IC);
    VecF dw2 = dw, db2 = db;
    matmul_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), N, IC, OC,
                    layout);
    matmul_backward(dxb.data(), dw2.data(), db2.data(), doutb.data(), xb.data(), wb.data(), N, IC,
                    OC, layout);
    expect_close(from_bf(dxb), dx, 1e-5, kRound, "matmul dinp");
    expect_close(dw2, dw, 1e-5, 1e-5, "matmul dweight (accumulated)");
    expect_close(db2, db, 1e-6, 1e-6, "matmul dbias (accumulated)");
  }
}

TEST(Bf16, MatmulPaddedStrides) {
  const int N = 8, IC = 16, OC = 40;
  const int64_t ldo = 56;
  VecF x = bf_rand(size_t(N) * IC, 13), w = bf_rand(size_t(IC) * OC, 14);
  VecB xb = to_bf(x), wb = to_bf(w);
  VecB out(size_t(N) * ldo, bf16_t{0x7fc0});  // NaN padding must stay untouched
  matmul_forward(out.data(), xb.data(), wb.data(), nullptr, N, IC, OC, WeightLayout::kInOut,
                 {.inp = 0, .out = ldo});
  VecF ref(size_t(N) * OC);
  matmul_forward(ref.data(), x.data(), w.data(), nullptr, N, IC, OC, WeightLayout::kInOut);
  for (int n = 0; n < N; ++n) {
    for (int c = 0; c < OC; ++c) {
      EXPECT_NEAR(to_f32(out[size_t(n) * ldo + c]), ref[size_t(n) * OC + c],
                  1e-5 + kRound * std::abs(ref[size_t(n) * OC + c]));
    }
    for (int64_t c = OC; c < ldo; ++c) EXPECT_EQ(out[size_t(n) * ldo + c].bits, 0x7fc0);
  }
}

// The weight gradient through transposed operands (Bf16WgradStaging) against the strided path
// and against fp32, both layouts, odd N and padded rows: the GEMM sums over N in a possibly
// different order, so within GEMM rounding (the fp32 accumulations of exact bf16 products),
// not bit for bit. dinp and dbias do not depend on the staging.
TEST(Bf16, MatmulTransposedWeightGradientMatchesTheStridedPath) {
  const int N = 45, IC = 40, OC = 72;
  const int64_t ldi = 48, ldo = 80;
  for (WeightLayout layout : {WeightLayout::kInOut, WeightLayout::kOutIn}) {
    SCOPED_TRACE(layout == WeightLayout::kInOut ? "in-out" : "out-in");
    VecF x = bf_rand(size_t(N) * ldi, 31), w = bf_rand(size_t(IC) * OC, 32);
    VecF dout = bf_rand(size_t(N) * ldo, 33);
    VecB xb = to_bf(x), wb = to_bf(w), doutb = to_bf(dout);
    const MatmulStrides st{.inp = ldi, .out = ldo};
    VecF dw(size_t(IC) * OC, 0.5f), db(OC, 0.25f);
    VecB dx(size_t(N) * ldi);
    VecF dw2 = dw, db2 = db;
    VecB dx2 = dx;
    VecB staging(size_t(N) * (IC + OC) + 7, bf16_t{0x7fc0});
    const Bf16WgradStaging ws{staging.data(), size_t(N) * IC, staging.data() + size_t(N) * IC,
                              size_t(N) * OC + 7};
    matmul_backward(dx.data(), dw.data(), db.data(), doutb.data(), xb.data(), wb.data(), N, IC, OC,
                    layout, st);
    matmul_backward(dx2.data(), dw2.data(), db2.data(), doutb.data(), xb.data(), wb.data(), N, IC,
                    OC, layout, st, ws);
    EXPECT_EQ(from_bf(dx2), from_bf(dx));
    EXPECT_EQ(db2, db);
    expect_close(dw2, dw, 1e-5, 1e-5, "dweight, transposed against strided");
    // The staging holds the copies the path names: inp^T [IC, N] then dout^T [OC, N]; a copy
    // not made (the B operand of our AMX kernel, read in place) leaves its area untouched.
    const Bf16WgradCopies copies = bf16_wgrad_copies(N, layout);
    EXPECT_TRUE(copies.inp_t || copies.out_t);
    EXPECT_EQ(staging[size_t(5) * N + 3].bits,
              copies.inp_t ? xb[size_t(3) * ldi + 5].bits : uint16_t{0x7fc0});
    EXPECT_EQ(staging[size_t(N) * IC + size_t(7) * N + 44].bits,
              copies.out_t ? doutb[size_t(44) * ldo + 7].bits : uint16_t{0x7fc0});
    // And against fp32 on the dense copies (the existing bf16 tolerance).
    VecF xd(size_t(N) * IC), doutd(size_t(N) * OC);
    for (int n = 0; n < N; ++n) {
      std::copy_n(x.begin() + n * ldi, IC, xd.begin() + n * IC);
      std::copy_n(dout.begin() + n * ldo, OC, doutd.begin() + n * OC);
    }
    VecF dwf(size_t(IC) * OC, 0.5f);
    matmul_backward(nullptr, dwf.data(), nullptr, doutd.data(), xd.data(), w.data(), N, IC, OC,
                    layout);
    expect_close(dw2, dwf, 1e-5, 1e-5, "dweight, transposed against fp32");
  }
}

// kOutIn (the LM head) with a staging that holds only some rows of dout^T: the rows go through
// it in chunks (a multiple of 16: here 32, 32 and 8 of 72), each a transpose and a GEMM into its
// rows of dweight. Within GEMM rounding of the whole staging, with dout rows of stride 2 ld as
// the bf16 loss leaves them.
TEST(Bf16, MatmulTransposedWeightGradientInChunksOfTheOutputRows) {
  const int N = 45, IC = 40, OC = 72;
  const int64_t ldo = 2 * 80;
  VecB xb = to_bf(bf_rand(size_t(N) * IC, 36)), doutb = to_bf(bf_rand(size_t(N) * ldo, 37));
  VecB wb = to_bf(bf_rand(size_t(IC) * OC, 38));
  auto run = [&](size_t out_rows) {
    VecB staging(size_t(N) * (IC + out_rows) + 5, bf16_t{0x7fc0});
    const Bf16WgradStaging ws{staging.data(), size_t(N) * IC, staging.data() + size_t(N) * IC,
                              size_t(N) * out_rows + 5};
    VecF dw(size_t(IC) * OC, 0.5f);
    VecB dx(size_t(N) * IC);
    matmul_backward(dx.data(), dw.data(), nullptr, doutb.data(), xb.data(), wb.data(), N, IC, OC,
                    WeightLayout::kOutIn, {.inp = 0, .out = ldo}, ws);
    return std::pair(dw, from_bf(dx));
  };
  const auto [whole, dx_whole] = run(OC);
  const auto [chunked, dx_chunked] = run(47);  // 47 rows of room: chunks of 32
  const auto [sixteen, dx_sixteen] = run(16);
  EXPECT_EQ(dx_chunked, dx_whole);
  EXPECT_EQ(dx_sixteen, dx_whole);
  expect_close(chunked, whole, 1e-5, 1e-5, "dweight in chunks of 32 rows against whole");
  expect_close(sixteen, whole, 1e-5, 1e-5, "dweight in chunks of 16 rows against whole");
  VecF strided(size_t(IC) * OC, 0.5f);
  matmul_backward(nullptr, strided.data(), nullptr, doutb.data(), xb.data(), wb.data(), N, IC, OC,
                  WeightLayout::kOutIn, {.inp = 0, .out = ldo});
  expect_close(chunked, strided, 1e-5, 1e-5, "dweight in chunks against the strided path");
  // A changed column of dout (row 70 of dout^T, in the third chunk) reaches only its row of
  // dweight.
  VecB dout2 = doutb;
  for (int n = 0; n < N; ++n) dout2[size_t(n) * ldo + 70] = bf16_t{0};
  std::swap(dout2, doutb);
  const auto [moved, unused] = run(47);
  std::swap(dout2, doutb);
  for (int o = 0; o < OC; ++o) {
    for (int i = 0; i < IC; ++i) {
      const size_t at = size_t(o) * IC + size_t(i);
      if (o == 70) {
        EXPECT_NEAR(moved[at], 0.5f, 1e-6) << "row " << o;
      } else {
        ASSERT_EQ(moved[at], chunked[at]) << "row " << o << ", column " << i;
      }
    }
  }
}

// The transposed path at a GPT-2-like shape (N = 256 tokens, 64 -> 3072: AMX tiles, the
// transposes' full 32 x 16 tiles) gives the same bits for 1, 2 and 3 threads, as the strided
// path does, and stays within GEMM rounding of it.
TEST(Bf16, MatmulTransposedWeightGradientThreadCountInvariant) {
  const int N = 256, IC = 64, OC = 3072;
  VecB xb = to_bf(bf_rand(size_t(N) * IC, 34)), doutb = to_bf(bf_rand(size_t(N) * OC, 35));
  VecB staging(size_t(N) * (IC + OC));
  const Bf16WgradStaging ws{staging.data(), size_t(N) * IC, staging.data() + size_t(N) * IC,
                            size_t(N) * OC};
  auto run = [&](int threads, bool transposed) {
    omp_set_num_threads(threads);
    VecF dw(size_t(IC) * OC, 0.0f);
    if (transposed) {
      matmul_backward(nullptr, dw.data(), nullptr, doutb.data(), xb.data(), nullptr, N, IC, OC,
                      WeightLayout::kInOut, {}, ws);
    } else {
      matmul_backward(nullptr, dw.data(), nullptr, doutb.data(), xb.data(), nullptr, N, IC, OC,
                      WeightLayout::kInOut);
    }
    return dw;
  };
  const int saved = omp_get_max_threads();
  VecF one = run(1, true), two = run(2, true), three = run(3, true);
  VecF strided1 = run(1, false), strided2 = run(2, false);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
  EXPECT_EQ(strided1, strided2);
  expect_close(one, strided1, 1e-5, 1e-5, "dweight, transposed against strided");
}

TEST(Bf16, WgradTransposeChoiceAndKnob) {
  const char* saved = std::getenv("HEADROOM_BF16_WGRAD_TRANSPOSE");
  unsetenv("HEADROOM_BF16_WGRAD_TRANSPOSE");
  EXPECT_TRUE(bf16_wgrad_transposes(2048, 768, 3072));   // MLP c_fc
  EXPECT_TRUE(bf16_wgrad_transposes(2048, 3072, 768));   // MLP c_proj
  EXPECT_TRUE(bf16_wgrad_transposes(2048, 768, 50257));  // LM head
  EXPECT_FALSE(bf16_wgrad_transposes(2048, 768, 2304));  // attention c_attn
  EXPECT_FALSE(bf16_wgrad_transposes(2048, 768, 768));   // attention c_proj
  setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", "1", 1);
  EXPECT_TRUE(bf16_wgrad_transposes(2048, 768, 768));
  setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", "0", 1);
  EXPECT_FALSE(bf16_wgrad_transposes(2048, 768, 3072));
  if (saved != nullptr) {
    setenv("HEADROOM_BF16_WGRAD_TRANSPOSE", saved, 1);
  } else {
    unsetenv("HEADROOM_BF16_WGRAD_TRANSPOSE");
  }
}

TEST(Bf16DeathTest, TransposedWeightGradientNeedsEnoughStaging) {
  const int N = 8, IC = 16, OC = 32;
  VecB xb(size_t(N) * IC), doutb(size_t(N) * OC), staging(size_t(N) * (IC + OC));
  VecF dw(size_t(IC) * OC);
  const Bf16WgradStaging small{staging.data(), size_t(N) * IC, staging.data() + size_t(N) * IC,
                               size_t(N) * OC - 1};
  EXPECT_DEATH(matmul_backward(nullptr, dw.data(), nullptr, doutb.data(), xb.data(), nullptr, N, IC,
                               OC, WeightLayout::kInOut, {}, small),
               "staging for dout.T is missing or too small");
  // kOutIn takes dout^T in chunks, but not under 16 rows of it.
  VecB staging15(size_t(N) * (IC + 15));
  const Bf16WgradStaging fifteen{staging15.data(), size_t(N) * IC,
                                 staging15.data() + size_t(N) * IC, size_t(N) * 15};
  EXPECT_DEATH(matmul_backward(nullptr, dw.data(), nullptr, doutb.data(), xb.data(), nullptr, N, IC,
                               OC, WeightLayout::kOutIn, {}, fifteen),
               "staging for dout.T is missing or too small");
}

// The fallback bf16 attention (fp32 kernels on widened copies), forced on any CPU: the bf16
// tile-product kernels are tested in fused_kernels_test.cc.
struct WidenedAttention {
  WidenedAttention() { set_attention_bf16_kernel(AttentionBf16Kernel::kWidenFp32); }
  ~WidenedAttention() { set_attention_bf16_kernel(AttentionBf16Kernel::kAuto); }
};

void check_attention(AttnShape s) {
  const WidenedAttention widened;
  testing::check_attention_widened<bf16_t>(s, kRound);
}

TEST(Bf16, AttentionTiledSmall) { check_attention({2, 7, 24, 3}); }
TEST(Bf16, AttentionTiledPartialBlocks) { check_attention({1, 130, 128, 2}); }

TEST(Bf16, AttentionTiledThreadCountInvariant) {
  const WidenedAttention widened;
  const AttnShape s{2, 70, 64, 2};
  const size_t n3 = size_t(s.B) * s.T * 3 * s.C, n1 = size_t(s.B) * s.T * s.C;
  VecB qkv = to_bf(rand_vec(n3, 22)), dout = to_bf(rand_vec(n1, 23));
  auto run = [&](int threads) {
    omp_set_num_threads(threads);
    VecB out(n1), dqkv(n3);
    VecF lse(size_t(s.B) * s.NH * s.T);
    VecF fs(attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, DType::kBF16));
    VecF bs(attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, DType::kBF16));
    attention_tiled_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, fs.data());
    attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T,
                             s.C, s.NH, bs.data());
    VecF all = from_bf(out);
    VecF d = from_bf(dqkv);
    all.insert(all.end(), d.begin(), d.end());
    return all;
  };
  const int saved = omp_get_max_threads();
  VecF one = run(1), two = run(2), three = run(3);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
}

TEST(Bf16, FusedHead) {
  const int N = 19, C = 32, V = 301, chunk = 8;
  VecF x = bf_rand(size_t(N) * C, 30, -2, 2), wte = bf_rand(size_t(V) * C, 31, -0.5f, 0.5f);
  VecB xb = to_bf(x), wteb = to_bf(wte);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[size_t(i)] = i == 4 ? -1 : (i * 37) % V;
  VecF losses(N), lse(N), losses2(N), lse2(N), scratch(lm_head_ce_scratch_floats(chunk, V));
  // bf16 also keeps the chunk's dlogits in bf16: a larger scratch.
  VecF scratch_bf(lm_head_ce_scratch_floats(chunk, V, DType::kBF16), NAN);
  EXPECT_EQ(scratch_bf.size(), scratch.size() + (scratch.size() + 1) / 2);
  lm_head_ce_forward(losses.data(), lse.data(), x.data(), wte.data(), targets.data(), N, C, V,
                     chunk, scratch.data());
  lm_head_ce_forward(losses2.data(), lse2.data(), xb.data(), wteb.data(), targets.data(), N, C, V,
                     chunk, scratch_bf.data());
  // fp32 logits from the same inputs: only the GEMM's accumulation order differs.
  expect_close(losses2, losses, 1e-5, 1e-5, "head losses");
  expect_close(lse2, lse, 1e-5, 1e-5, "head lse");

  const float dloss = 1.0f / 18;
  VecF dx(size_t(N) * C), dwte(size_t(V) * C, 0.5f), dwte2 = dwte;
  VecB dxb(size_t(N) * C);
  lm_head_ce_backward(dx.data(), dwte.data(), x.data(), wte.data(), targets.data(), lse.data(), N,
                      C, V, chunk, dloss, scratch.data());
  lm_head_ce_backward(dxb.data(), dwte2.data(), xb.data(), wteb.data(), targets.data(), lse.data(),
                      N, C, V, chunk, dloss, scratch_bf.data());
  // dlogits are rounded to bf16 before the GEMMs (one rounding, relative 2^-9 per term), and dx
  // once more when stored: atol covers the cancellation in sums of +/- terms.
  expect_close(from_bf(dxb), dx, 2e-4, 3 * kRound, "head dx");
  expect_close(dwte2, dwte, 2e-4, 3 * kRound, "head dwte");
}

// With wte_rows >= ld the chunk GEMMs compute the padded columns too (from wte's rows past V, any
// finite values): losses, lse, dx and dwte are those of the V-column GEMMs, and the scratch's
// padded columns are the only memory that changes.
TEST(Bf16, FusedHeadComputingThePaddedColumns) {
  const int N = 37, C = 64, V = 301, chunk = 16;
  const int ld = int(logits_row_stride(V));
  ASSERT_GT(ld, V);
  VecB xb = to_bf(bf_rand(size_t(N) * C, 50, -2, 2));
  // wte with ld rows: rows [V, ld) stand for the next tensor of the flat copy.
  VecB wteb = to_bf(bf_rand(size_t(ld) * C, 51, -0.5f, 0.5f));
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[size_t(i)] = i == 7 ? -1 : (i * 53) % V;
  struct Out {
    VecF losses, lse, dwte;
    VecB dx;
    bool padding_written = false;  // the scratch's logits columns [V, ld) hold values, not NaN
  };
  auto run = [&](int wte_rows) {
    Out o{VecF(N), VecF(N), VecF(size_t(V) * C, 0.25f), VecB(size_t(N) * C)};
    VecF scratch(lm_head_ce_scratch_floats(chunk, V, DType::kBF16), NAN);
    lm_head_ce_forward(o.losses.data(), o.lse.data(), xb.data(), wteb.data(), targets.data(), N, C,
                       V, chunk, scratch.data(), wte_rows);
    lm_head_ce_backward(o.dx.data(), o.dwte.data(), xb.data(), wteb.data(), targets.data(),
                        o.lse.data(), N, C, V, chunk, 1.0f / 36, scratch.data(), wte_rows);
    o.padding_written = std::isfinite(scratch[size_t(V)]) && std::isfinite(scratch[size_t(ld - 1)]);
    return o;
  };
  const Out dense = run(0), padded = run(ld);
  EXPECT_FALSE(dense.padding_written);
  EXPECT_TRUE(padded.padding_written);
  // The same products of the same bf16 values summed in fp32 over C = 64 terms: whichever oneDNN
  // kernel runs, a column's value may differ by the accumulation order only.
  expect_close(padded.losses, dense.losses, 1e-6, 1e-6, "losses");
  expect_close(padded.lse, dense.lse, 1e-6, 1e-6, "lse");
  expect_close(from_bf(padded.dx), from_bf(dense.dx), 1e-6, kRound, "dx");
  expect_close(padded.dwte, dense.dwte, 1e-6, 1e-5, "dwte");
  // Fewer rows than ld: V columns, the same bits as the default.
  const Out short_rows = run(ld - 1);
  EXPECT_EQ(short_rows.losses, dense.losses);
  EXPECT_EQ(short_rows.dwte, dense.dwte);
}

TEST(Bf16, AdamWWritesTheRoundedCopy) {
  const int64_t n = 1003;
  VecF p = rand_vec(n, 40), g = rand_vec(n, 41), m(n, 0.0f), v(n, 0.0f);
  VecF p2 = p, m2 = m, v2 = v;
  VecB copy(n);
  AdamWParams ap{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  adamw_update(p.data(), g.data(), m.data(), v.data(), n, ap);
  adamw_update(p2.data(), g.data(), m2.data(), v2.data(), n, ap, copy.data());
  EXPECT_EQ(p, p2);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(copy[i].bits, f32_to_bf16_bits(p[i])) << i;
}

// adamw_update_and_zero: adamw_update's params, m, v and copy bit for bit over three steps (the
// second with weight decay off, the third with a gradient scale), and grads zero afterwards,
// exactly their n floats. Runs `chunk`-float pieces of the reference separately (chunk a
// multiple of 16: the same vector/scalar split), so a large n compares the streaming path
// (prefetch, non-temporal copy) with the cached one.
void expect_update_and_zero_matches(int64_t n, int64_t chunk, size_t copy_offset) {
  VecF p = rand_vec(size_t(n), 50), m(size_t(n), 0.0f), v(size_t(n), 0.0f);
  VecF rp = p, rm = m, rv = v;
  // A 64-byte aligned copy, then copy_offset elements in (1: off the 32-byte boundary).
  VecB copy_store(static_cast<size_t>(n) + 64), rcopy(static_cast<size_t>(n));
  bf16_t* copy = copy_store.data();
  while (reinterpret_cast<uintptr_t>(copy) % 64 != 0) ++copy;
  copy += copy_offset;
  AdamWParams ap{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  for (int step = 1; step <= 3; ++step) {
    ap.step = step;
    ap.weight_decay = step == 2 ? 0.0f : 0.1f;
    ap.grad_scale = step == 3 ? 0.37f : 1.0f;
    const VecF g = rand_vec(size_t(n), 60 + uint32_t(step), -2, 2);
    VecF zg(size_t(n) + 2, 7.0f);  // one guard each side
    std::copy(g.begin(), g.end(), zg.begin() + 1);
    adamw_update_and_zero(p.data(), zg.data() + 1, m.data(), v.data(), n, ap, copy);
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
      const int64_t c = std::min(chunk, n - i0);
      adamw_update(rp.data() + i0, g.data() + i0, rm.data() + i0, rv.data() + i0, c, ap,
                   rcopy.data() + i0);
    }
    ASSERT_EQ(zg.front(), 7.0f);
    ASSERT_EQ(zg.back(), 7.0f);
    for (int64_t i = 1; i <= n; ++i) ASSERT_EQ(zg[size_t(i)], 0.0f) << "grad " << i - 1;
    ASSERT_EQ(0, std::memcmp(p.data(), rp.data(), size_t(n) * 4)) << "params, step " << step;
    ASSERT_EQ(0, std::memcmp(m.data(), rm.data(), size_t(n) * 4)) << "m, step " << step;
    ASSERT_EQ(0, std::memcmp(v.data(), rv.data(), size_t(n) * 4)) << "v, step " << step;
    ASSERT_EQ(0, std::memcmp(copy, rcopy.data(), size_t(n) * 2)) << "copy, step " << step;
  }
  ASSERT_NE(p, rand_vec(size_t(n), 50));  // the weights moved
}

TEST(Bf16, AdamWUpdateAndZeroMatchesAdamWUpdate) {
  for (int64_t n : {1, 15, 16, 1003}) {
    SCOPED_TRACE(n);
    expect_update_and_zero_matches(n, n, 0);
    expect_update_and_zero_matches(n, n, 1);
  }
}

// Past 8M floats adamw_update prefetches and streams the copy: the same bits as 1M-float pieces,
// from a 32-byte aligned copy (non-temporal stores) and from an unaligned one (plain stores).
TEST(Bf16, AdamWLargeBufferStreamsTheSameBits) {
  const int64_t n = (int64_t{8} << 20) + 1003;
  expect_update_and_zero_matches(n, int64_t{1} << 20, 0);
  expect_update_and_zero_matches(n, int64_t{1} << 20, 1);
}

}  // namespace
}  // namespace headroom::cpu
