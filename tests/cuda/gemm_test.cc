// The CUDA gemm family against the CPU op table on the same random inputs: every matmul overload
// in both weight layouts, dense and padded row strides, with and without a bias, parameter
// gradients accumulated from non-zero values; the fused LM head for each storage type, several
// chunk sizes and weights with padding rows; the determinism of the GEMMs and bias sums.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "core/dtype.h"
#include "cuda_test_util.h"

namespace headroom {
namespace {

using namespace cudatest;  // DeviceBuffer, rnd, cast, widen, ...

using backend::MatmulStrides;
using backend::WeightLayout;

// fp32 holding f16 values (the f16 GEMMs' weights, the LM head's f16 dlogits).
VecF f16_values(const VecF& v) { return widen(cast<f16_t>(v)); }

// |got - want| <= atol + rtol * |want| everywhere (NaN nowhere); the first misses reported.
void expect_close(const VecF& got, const VecF& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int misses = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - double(want[i]));
    if (!(err <= atol + rtol * std::abs(double(want[i])))) {
      if (++misses <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
      }
    }
    if (err > worst) worst = err;
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << got.size()
                       << " outside tolerance; worst abs err " << worst;
}
double max_abs(const VecF& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

struct Shape {
  int N, IC, OC;
};
// Odd sizes (no multiple of 8 in sight), one bigger than a tile, and a GPT-2-like one that takes
// the tensor-core algorithms.
const Shape kShapes[] = {{1, 1, 1}, {7, 13, 5}, {33, 64, 96}, {130, 257, 65}, {256, 768, 2304}};
const WeightLayout kLayouts[] = {WeightLayout::kInOut, WeightLayout::kOutIn};

// The padded strides of a case: dense, or rows a few elements longer (odd, so unaligned rows).
MatmulStrides strides_of(bool padded, const Shape& s) {
  return padded ? MatmulStrides{.inp = s.IC + 3, .out = s.OC + 5} : MatmulStrides{};
}
std::string name_of(const Shape& s, WeightLayout layout, bool padded, bool bias) {
  return "N=" + std::to_string(s.N) + " IC=" + std::to_string(s.IC) +
         " OC=" + std::to_string(s.OC) + (layout == WeightLayout::kInOut ? " in_out" : " out_in") +
         (padded ? " padded" : " dense") + (bias ? " bias" : "");
}

// Tolerance of an fp32-accumulated dot product of K terms in [-1, 1]: the two sides sum in
// different orders (rounding error grows with K).
double dot_atol(int K) { return 3e-6 * K + 1e-6; }

// One matmul case's operands on the host, every row padded as `st` says; padding holds values
// the ops must not read or write (checked: both sides leave the same bytes).
struct MatmulData {
  int64_t ldi, ldo;
  VecF inp, weight, bias, dout, out0, dinp0, dweight0, dbias0;
  MatmulData(const Shape& s, MatmulStrides st, uint32_t seed) {
    ldi = st.inp ? st.inp : s.IC;
    ldo = st.out ? st.out : s.OC;
    inp = rnd(size_t(s.N) * ldi, seed);
    weight = rnd(size_t(s.IC) * s.OC, seed + 1);
    bias = rnd(size_t(s.OC), seed + 2);
    dout = rnd(size_t(s.N) * ldo, seed + 3);
    out0 = VecF(size_t(s.N) * ldo, 0.25f);
    dinp0 = VecF(size_t(s.N) * ldi, -3.0f);
    dweight0 = rnd(size_t(s.IC) * s.OC, seed + 4);  // accumulated onto
    dbias0 = rnd(size_t(s.OC), seed + 5);
  }
};

TEST(CudaGemm, Fp32MatchesCpuEveryLayoutStrideAndBias) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  ASSERT_FALSE(backend::cuda::allow_tf32());
  uint32_t seed = 1;
  for (const Shape& s : kShapes) {
    for (WeightLayout layout : kLayouts) {
      for (bool padded : {false, true}) {
        for (bool with_bias : {false, true}) {
          const std::string what = name_of(s, layout, padded, with_bias);
          const MatmulStrides st = strides_of(padded, s);
          MatmulData d(s, st, seed += 10);
          const float* hb = with_bias ? d.bias.data() : nullptr;
          VecF out = d.out0;
          cpu.matmul_forward(out.data(), d.inp.data(), d.weight.data(), hb, s.N, s.IC, s.OC, layout,
                             st);
          DeviceBuffer<float> inp(d.inp), w(d.weight), b(d.bias), o(d.out0);
          ops->matmul_forward(o.get(), inp.get(), w.get(), with_bias ? b.get() : nullptr, s.N, s.IC,
                              s.OC, layout, st);
          expect_close(o.download(), out, dot_atol(s.IC), 1e-5, what + " out");

          VecF dinp = d.dinp0, dw = d.dweight0, db = d.dbias0;
          cpu.matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr,
                              d.dout.data(), d.inp.data(), d.weight.data(), s.N, s.IC, s.OC, layout,
                              st);
          DeviceBuffer<float> dout(d.dout), gi(d.dinp0), gw(d.dweight0), gb(d.dbias0);
          ops->matmul_backward(gi.get(), gw.get(), with_bias ? gb.get() : nullptr, dout.get(),
                               inp.get(), w.get(), s.N, s.IC, s.OC, layout, st);
          expect_close(gi.download(), dinp, dot_atol(s.OC), 1e-5, what + " dinp");
          expect_close(gw.download(), dw, dot_atol(s.N), 1e-5, what + " dweight (accumulated)");
          expect_close(gb.download(), db, dot_atol(s.N), 1e-5, what + " dbias (accumulated)");
        }
      }
    }
  }
}

TEST(CudaGemm, Fp32NullGradientsAreSkipped) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  const Shape s{19, 24, 40};
  for (WeightLayout layout : kLayouts) {
    MatmulData d(s, {}, 77);
    // dinp only, then dweight only: each must match the CPU, and nothing else is touched.
    VecF dinp = d.dinp0, dw = d.dweight0;
    cpu.matmul_backward(dinp.data(), nullptr, nullptr, d.dout.data(), d.inp.data(), d.weight.data(),
                        s.N, s.IC, s.OC, layout, {});
    cpu.matmul_backward(nullptr, dw.data(), nullptr, d.dout.data(), d.inp.data(), nullptr, s.N,
                        s.IC, s.OC, layout, {});
    DeviceBuffer<float> inp(d.inp), w(d.weight), dout(d.dout), gi(d.dinp0), gw(d.dweight0);
    ops->matmul_backward(gi.get(), nullptr, nullptr, dout.get(), inp.get(), w.get(), s.N, s.IC,
                         s.OC, layout, {});
    ops->matmul_backward(nullptr, gw.get(), nullptr, dout.get(), inp.get(), nullptr, s.N, s.IC,
                         s.OC, layout, {});
    expect_close(gi.download(), dinp, dot_atol(s.OC), 1e-5, "dinp alone");
    expect_close(gw.download(), dw, dot_atol(s.N), 1e-5, "dweight alone");
  }
}

// Many rows: the bias gradient's sums go through several row partitions of unequal use (4099
// rows is not a multiple of any part size) and are summed in a fixed order.
TEST(CudaGemm, BiasGradientOverManyRowsMatchesCpuAndIsDeterministic) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  const Shape s{4099, 8, 37};
  MatmulData d(s, {}, 5);
  VecF db = d.dbias0;
  cpu.matmul_backward(nullptr, nullptr, db.data(), d.dout.data(), d.inp.data(), d.weight.data(),
                      s.N, s.IC, s.OC, WeightLayout::kInOut, {});
  DeviceBuffer<float> dout(d.dout), inp(d.inp), w(d.weight), g1(d.dbias0), g2(d.dbias0);
  ops->matmul_backward(nullptr, nullptr, g1.get(), dout.get(), inp.get(), w.get(), s.N, s.IC, s.OC,
                       WeightLayout::kInOut, {});
  ops->matmul_backward(nullptr, nullptr, g2.get(), dout.get(), inp.get(), w.get(), s.N, s.IC, s.OC,
                       WeightLayout::kInOut, {});
  const VecF a = g1.download(), b = g2.download();
  expect_close(a, db, dot_atol(s.N), 1e-5, "dbias over 4099 rows");
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "dbias run to run";
}

TEST(CudaGemm, Tf32IsOffByDefaultAndWhenAllowedStaysWithinTf32Rounding) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  EXPECT_FALSE(backend::cuda::allow_tf32());
  const Shape s{256, 768, 2304};
  MatmulData d(s, {}, 31);
  VecF out = d.out0;
  cpu.matmul_forward(out.data(), d.inp.data(), d.weight.data(), d.bias.data(), s.N, s.IC, s.OC,
                     WeightLayout::kInOut, {});
  DeviceBuffer<float> inp(d.inp), w(d.weight), b(d.bias), o(d.out0);
  backend::cuda::set_allow_tf32(true);
  ops->matmul_forward(o.get(), inp.get(), w.get(), b.get(), s.N, s.IC, s.OC, WeightLayout::kInOut,
                      {});
  const VecF tf32 = o.download();
  backend::cuda::set_allow_tf32(false);
  EXPECT_FALSE(backend::cuda::allow_tf32());
  // TF32 rounds each operand to 10 mantissa bits (relative 2^-11 each): sums of 768 such
  // products in [-1, 1] stay within several 1e-2.
  expect_close(tf32, out, 8e-2, 1e-2, "tf32 out");
  ops->matmul_forward(o.get(), inp.get(), w.get(), b.get(), s.N, s.IC, s.OC, WeightLayout::kInOut,
                      {});
  expect_close(o.download(), out, dot_atol(s.IC), 1e-5, "fp32 out after tf32 is turned off");
}

TEST(CudaGemm, Bf16MatchesCpuEveryLayoutStrideAndBias) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  // bf16 results are rounded once (relative 2^-9); where the two sides' fp32 sums straddle a
  // rounding boundary they differ by one bf16 step (2^-8 relative): rtol 8e-3.
  const double kBf16 = 8e-3;
  uint32_t seed = 100;
  for (const Shape& s : kShapes) {
    for (WeightLayout layout : kLayouts) {
      for (bool padded : {false, true}) {
        for (bool with_bias : {false, true}) {
          const std::string what = "bf16 " + name_of(s, layout, padded, with_bias);
          const MatmulStrides st = strides_of(padded, s);
          MatmulData d(s, st, seed += 10);
          const auto inp_h = cast<bf16_t>(d.inp), w_h = cast<bf16_t>(d.weight);
          const auto dout_h = cast<bf16_t>(d.dout), out0_h = cast<bf16_t>(d.out0);
          const auto dinp0_h = cast<bf16_t>(d.dinp0);
          const float* hb = with_bias ? d.bias.data() : nullptr;
          VecF outf = d.out0;
          std::vector<bf16_t> outb = out0_h;
          cpu.matmul_forward(outf.data(), inp_h.data(), w_h.data(), hb, s.N, s.IC, s.OC, layout,
                             st);
          cpu.matmul_forward(outb.data(), inp_h.data(), w_h.data(), hb, s.N, s.IC, s.OC, layout,
                             st);
          DeviceBuffer<bf16_t> inp(inp_h), w(w_h), ob(out0_h);
          DeviceBuffer<float> b(d.bias), of(d.out0);
          const float* gb_fwd = with_bias ? b.get() : nullptr;
          ops->matmul_forward(of.get(), inp.get(), w.get(), gb_fwd, s.N, s.IC, s.OC, layout, st);
          ops->matmul_forward(ob.get(), inp.get(), w.get(), gb_fwd, s.N, s.IC, s.OC, layout, st);
          expect_close(of.download(), outf, dot_atol(s.IC), 1e-5, what + " fp32 out");
          expect_close(widen(ob.download()), widen(outb), dot_atol(s.IC), kBf16,
                       what + " bf16 out");

          std::vector<bf16_t> dinp = dinp0_h;
          VecF dw = d.dweight0, db = d.dbias0;
          cpu.matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr,
                              dout_h.data(), inp_h.data(), w_h.data(), s.N, s.IC, s.OC, layout, st,
                              backend::WgradStaging{});
          DeviceBuffer<bf16_t> dout(dout_h), gi(dinp0_h);
          DeviceBuffer<float> gw(d.dweight0), gbias(d.dbias0);
          ops->matmul_backward(gi.get(), gw.get(), with_bias ? gbias.get() : nullptr, dout.get(),
                               inp.get(), w.get(), s.N, s.IC, s.OC, layout, st,
                               backend::WgradStaging{});
          expect_close(widen(gi.download()), widen(dinp), dot_atol(s.OC), kBf16, what + " dinp");
          expect_close(gw.download(), dw, dot_atol(s.N), 1e-5, what + " dweight (accumulated)");
          expect_close(gbias.download(), db, dot_atol(s.N), 1e-5, what + " dbias (accumulated)");
        }
      }
    }
  }
}

TEST(CudaGemm, Bf16WeightGradientTakesNoStagingAndIgnoresOne) {
  HR_CUDA_OPS_OR_SKIP(ops);
  EXPECT_FALSE(ops->bf16_wgrad_transposes(4096, 768, 3072));
  EXPECT_FALSE(ops->bf16_wgrad_transposes(4096, 768, 50257));
  // A staging handed anyway changes nothing (and is not written).
  const Shape s{64, 48, 80};
  MatmulData d(s, {}, 9);
  const auto inp_h = cast<bf16_t>(d.inp), w_h = cast<bf16_t>(d.weight);
  const auto dout_h = cast<bf16_t>(d.dout);
  DeviceBuffer<bf16_t> inp(inp_h), w(w_h), dout(dout_h);
  DeviceBuffer<bf16_t> st_in(cast<bf16_t>(VecF(size_t(s.IC) * s.N, 2.0f)));
  DeviceBuffer<bf16_t> st_out(cast<bf16_t>(VecF(size_t(s.OC) * s.N, 2.0f)));
  DeviceBuffer<float> a(d.dweight0), b(d.dweight0);
  const backend::WgradStaging staging{st_in.get(), st_in.size(), st_out.get(), st_out.size()};
  for (WeightLayout layout : kLayouts) {
    a.upload(d.dweight0);
    b.upload(d.dweight0);
    ops->matmul_backward(nullptr, a.get(), nullptr, dout.get(), inp.get(), nullptr, s.N, s.IC, s.OC,
                         layout, {}, backend::WgradStaging{});
    ops->matmul_backward(nullptr, b.get(), nullptr, dout.get(), inp.get(), nullptr, s.N, s.IC, s.OC,
                         layout, {}, staging);
    const VecF va = a.download(), vb = b.download();
    EXPECT_EQ(0, std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)));
  }
  for (const bf16_t& x : st_in.download()) ASSERT_EQ(to_f(x), 2.0f);
}

// Both tables' f16 staging areas for the scope of a test (each sized by its own table).
class BothF16Staging {
 public:
  BothF16Staging(const backend::Ops& cuda, int64_t N, int64_t IC, int64_t OC)
      : host_(backend::cpu_ops().f16_matmul_staging_floats(N, IC, OC)),
        device_(cuda.f16_matmul_staging_floats(N, IC, OC)),
        cpu_scope_(backend::cpu_ops(), host_.data(), host_.size()),
        cuda_scope_(cuda, device_.get(), device_.size()) {}

 private:
  VecF host_;
  DeviceBuffer<float> device_;
  backend::F16StagingScope cpu_scope_, cuda_scope_;
};

TEST(CudaGemm, F16MatchesCpuEveryLayoutStrideAndBias) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const backend::Ops& cpu = backend::cpu_ops();
  // f16 outputs: one f16 step (2^-10 relative) where the sums straddle a rounding boundary.
  const double kF16 = 2e-3;
  uint32_t seed = 300;
  for (const Shape& s : kShapes) {
    const BothF16Staging staging(*ops, s.N + 3, s.IC + 3, s.OC + 5);  // padded rows included
    for (WeightLayout layout : kLayouts) {
      for (bool padded : {false, true}) {
        for (bool with_bias : {false, true}) {
          const std::string what = "f16 " + name_of(s, layout, padded, with_bias);
          const MatmulStrides st = strides_of(padded, s);
          MatmulData d(s, st, seed += 10);
          // The weight is fp32 holding f16 values (the model rounds it per layer), so is the
          // LM head's fp32 dout.
          const VecF w_h = f16_values(d.weight), dout_f = f16_values(d.dout);
          const auto inp_h = cast<f16_t>(d.inp), dout_h = cast<f16_t>(d.dout);
          const auto out0_h = cast<f16_t>(d.out0), dinp0_h = cast<f16_t>(d.dinp0);
          const float* hb = with_bias ? d.bias.data() : nullptr;
          VecF outf = d.out0;
          std::vector<f16_t> outh = out0_h;
          cpu.matmul_forward(outf.data(), inp_h.data(), w_h.data(), hb, s.N, s.IC, s.OC, layout,
                             st);
          cpu.matmul_forward(outh.data(), inp_h.data(), w_h.data(), hb, s.N, s.IC, s.OC, layout,
                             st);
          DeviceBuffer<f16_t> inp(inp_h), oh(out0_h);
          DeviceBuffer<float> w(w_h), b(d.bias), of(d.out0);
          const float* gb_fwd = with_bias ? b.get() : nullptr;
          ops->matmul_forward(of.get(), inp.get(), w.get(), gb_fwd, s.N, s.IC, s.OC, layout, st);
          ops->matmul_forward(oh.get(), inp.get(), w.get(), gb_fwd, s.N, s.IC, s.OC, layout, st);
          expect_close(of.download(), outf, dot_atol(s.IC), 1e-5, what + " fp32 out");
          expect_close(widen(oh.download()), widen(outh), dot_atol(s.IC), kF16, what + " f16 out");

          // f16 dout.
          std::vector<f16_t> dinp = dinp0_h;
          VecF dw = d.dweight0, db = d.dbias0;
          cpu.matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr,
                              dout_h.data(), inp_h.data(), w_h.data(), s.N, s.IC, s.OC, layout, st);
          DeviceBuffer<f16_t> dout(dout_h), gi(dinp0_h);
          DeviceBuffer<float> gw(d.dweight0), gbias(d.dbias0);
          ops->matmul_backward(gi.get(), gw.get(), with_bias ? gbias.get() : nullptr, dout.get(),
                               inp.get(), w.get(), s.N, s.IC, s.OC, layout, st);
          expect_close(widen(gi.download()), widen(dinp), dot_atol(s.OC), kF16, what + " dinp");
          expect_close(gw.download(), dw, dot_atol(s.N), 1e-5, what + " dweight (accumulated)");
          expect_close(gbias.download(), db, dot_atol(s.N), 1e-5, what + " dbias (accumulated)");

          // fp32 dout holding f16 values (the LM head's backward).
          dinp = dinp0_h;
          dw = d.dweight0;
          db = d.dbias0;
          cpu.matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr,
                              dout_f.data(), inp_h.data(), w_h.data(), s.N, s.IC, s.OC, layout, st);
          DeviceBuffer<float> doutf(dout_f);
          gi.upload(dinp0_h);
          gw.upload(d.dweight0);
          gbias.upload(d.dbias0);
          ops->matmul_backward(gi.get(), gw.get(), with_bias ? gbias.get() : nullptr, doutf.get(),
                               inp.get(), w.get(), s.N, s.IC, s.OC, layout, st);
          expect_close(widen(gi.download()), widen(dinp), dot_atol(s.OC), kF16,
                       what + " dinp (fp32 dout)");
          expect_close(gw.download(), dw, dot_atol(s.N), 1e-5,
                       what + " dweight (fp32 dout, accumulated)");
          expect_close(gbias.download(), db, dot_atol(s.N), 1e-5,
                       what + " dbias (fp32 dout, accumulated)");
        }
      }
    }
  }
}

TEST(CudaGemm, GemmsAreBitIdenticalRunToRun) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const Shape s{512, 768, 3072};
  MatmulData d(s, {}, 41);
  const auto inp_h = cast<bf16_t>(d.inp), w_h = cast<bf16_t>(d.weight);
  const auto dout_h = cast<bf16_t>(d.dout);
  DeviceBuffer<bf16_t> inp(inp_h), w(w_h), dout(dout_h), gi(size_t(s.N) * s.IC);
  std::vector<VecF> dws, dbs;
  std::vector<std::vector<bf16_t>> dis;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer<float> gw(d.dweight0), gb(d.dbias0);
    ops->matmul_backward(gi.get(), gw.get(), gb.get(), dout.get(), inp.get(), w.get(), s.N, s.IC,
                         s.OC, WeightLayout::kInOut, {}, backend::WgradStaging{});
    dws.push_back(gw.download());
    dbs.push_back(gb.download());
    dis.push_back(gi.download());
  }
  EXPECT_EQ(0, std::memcmp(dws[0].data(), dws[1].data(), dws[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dbs[0].data(), dbs[1].data(), dbs[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dis[0].data(), dis[1].data(), dis[0].size() * sizeof(bf16_t)));
}

TEST(CudaGemm, RowStridesAndStagingSizes) {
  HR_CUDA_OPS_OR_SKIP(ops);
  // Rows on 16 bytes, never shorter than the row.
  for (int64_t cols : {1, 7, 768, 3072, 50257}) {
    for (int64_t elem : {2, 4}) {
      const int64_t ld = ops->activation_row_stride(cols, elem);
      EXPECT_GE(ld, cols);
      EXPECT_EQ(0, ld * elem % 16) << cols << " x " << elem;
      EXPECT_LT(ld - cols, 16 / elem);
    }
  }
  for (int64_t V : {1, 37, 50257, 128256}) {
    const int64_t ld = ops->logits_row_stride(V);
    EXPECT_GE(ld, V);
    EXPECT_EQ(0, ld % 8);
  }
  EXPECT_GE(ops->lm_head_ce_scratch_floats(8, 50257, DType::kBF16),
            size_t(8) * 50264 + size_t(8) * 50264 / 2);
  // The f16 staging of the blocks' GEMMs covers the LM head's (N x C per GEMM).
  EXPECT_GE(ops->f16_matmul_staging_floats(1024, 768, 768), size_t(1024) * 768 * 2);
}

// ---- the fused LM head ---------------------------------------------------------------------
struct HeadCase {
  int N, C, V, chunk, pad_rows;
};

template <typename T>
using HeadW = backend::Ops::GemmWeight<T>;

template <typename T>
void check_head(const backend::Ops& cuda, const HeadCase& hc, uint32_t seed, bool with_dx,
                bool with_dw) {
  const backend::Ops& cpu = backend::cpu_ops();
  const int N = hc.N, C = hc.C, V = hc.V, chunk = hc.chunk, w_rows = V + hc.pad_rows;
  const std::string what = std::string(std::is_same_v<T, float>    ? "fp32"
                                       : std::is_same_v<T, bf16_t> ? "bf16"
                                                                   : "f16") +
                           " N=" + std::to_string(N) + " C=" + std::to_string(C) +
                           " V=" + std::to_string(V) + " chunk=" + std::to_string(chunk) +
                           " w_rows=" + std::to_string(w_rows) + (with_dx ? "" : " no dx") +
                           (with_dw ? "" : " no dw");
  const VecF xf = rnd(size_t(N) * C, seed, -2.0f, 2.0f);
  VecF wf = rnd(size_t(w_rows) * C, seed + 1, -1.0f, 1.0f);
  if constexpr (std::is_same_v<T, f16_t>) wf = f16_values(wf);
  std::vector<int32_t> targets(static_cast<size_t>(N));
  std::mt19937 rng(seed + 2);
  for (int n = 0; n < N; ++n) targets[n] = n % 7 == 3 ? -1 : int32_t(rng() % uint32_t(V));
  const auto x = cast<T>(xf);
  const auto w = cast<HeadW<T>>(wf);
  const float dloss = 1.0f / float(N);
  const VecF dw0 = rnd(size_t(w_rows) * C, seed + 3);
  const auto dx0 = cast<T>(VecF(size_t(N) * C, 5.0f));

  // CPU.
  VecF losses(static_cast<size_t>(N)), lse(static_cast<size_t>(N)), dw = dw0;
  std::vector<T> dx = dx0;
  {
    VecF scratch(cpu.lm_head_ce_scratch_floats(chunk, V, dtype_of<T>()), NAN);
    VecF staging(std::is_same_v<T, f16_t> ? cpu.f16_matmul_staging_floats(chunk, C, C) : 0);
    const backend::F16StagingScope scope(cpu, staging.data(), staging.size());
    cpu.lm_head_ce_forward(losses.data(), lse.data(), x.data(), w.data(), targets.data(), N, C, V,
                           chunk, scratch.data(), w_rows);
    cpu.lm_head_ce_backward(with_dx ? dx.data() : nullptr, with_dw ? dw.data() : nullptr, x.data(),
                            w.data(), targets.data(), lse.data(), N, C, V, chunk, dloss,
                            scratch.data(), w_rows);
  }
  // CUDA.
  DeviceBuffer<T> gx(x), gdx(dx0);
  DeviceBuffer<HeadW<T>> gw(w);
  DeviceBuffer<int32_t> gt(targets);
  DeviceBuffer<float> glosses(static_cast<size_t>(N)), glse(static_cast<size_t>(N)), gdw(dw0);
  DeviceBuffer<float> scratch(cuda.lm_head_ce_scratch_floats(chunk, V, dtype_of<T>()));
  DeviceBuffer<float> staging(std::is_same_v<T, f16_t> ? cuda.f16_matmul_staging_floats(chunk, C, C)
                                                       : 0);
  {
    const backend::F16StagingScope scope(cuda, staging.get(), staging.size());
    cuda.lm_head_ce_forward(glosses.get(), glse.get(), gx.get(), gw.get(), gt.get(), N, C, V, chunk,
                            scratch.get(), w_rows);
    cuda.lm_head_ce_backward(with_dx ? gdx.get() : nullptr, with_dw ? gdw.get() : nullptr, gx.get(),
                             gw.get(), gt.get(), glse.get(), N, C, V, chunk, dloss, scratch.get(),
                             w_rows);
    cuda.synchronize();
  }
  // Logits are sums of C products of values up to 2 (fp32 accumulation on both sides); the loss
  // and lse inherit their error. The gradients are sums of V (dx) or N (dw) terms each up to
  // dloss; bf16 rounds dlogits to 8 bits and dx to bf16, f16 to 11 bits: tolerances relative to
  // the largest gradient.
  const double lt = 4e-6 * C + 1e-5;
  expect_close(glosses.download(), losses, lt, 1e-5, what + " losses");
  expect_close(glse.download(), lse, lt, 1e-5, what + " lse");
  const double g = std::is_same_v<T, float> ? 1e-4 : std::is_same_v<T, bf16_t> ? 2e-2 : 4e-3;
  if (with_dx) {
    const VecF want = widen(dx);
    expect_close(widen(gdx.download()), want, g * max_abs(want), g, what + " dx");
  } else {
    const VecF got = widen(gdx.download()), want = widen(dx0);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
        << what << ": dx written though null";
  }
  // dw from its non-zero start: compare the accumulated part, relative to its size.
  const VecF got_dw = gdw.download();
  VecF got_delta(dw.size()), want_delta(dw.size());
  for (size_t i = 0; i < dw.size(); ++i) {
    got_delta[i] = got_dw[i] - dw0[i];
    want_delta[i] = dw[i] - dw0[i];
  }
  expect_close(got_delta, want_delta, g * max_abs(want_delta) + 1e-7, g,
               what + " dw (accumulated)");
  // Padding rows of the weight are never a class: their gradient stays as it was.
  for (size_t i = size_t(V) * C; i < dw.size(); ++i) {
    ASSERT_EQ(got_dw[i], dw0[i]) << what << ": a padding row's gradient changed";
  }
}

template <typename T>
void check_heads(const backend::Ops& cuda) {
  const HeadCase cases[] = {
      {13, 16, 37, 1, 0},   {13, 16, 37, 5, 3},   {13, 16, 37, 13, 0},     {13, 16, 37, 20, 27},
      {64, 48, 203, 24, 5}, {64, 48, 203, 64, 0}, {40, 64, 50257, 16, 47},
  };
  uint32_t seed = 1000;
  for (const HeadCase& hc : cases) check_head<T>(cuda, hc, seed += 10, true, true);
  check_head<T>(cuda, {29, 24, 101, 7, 3}, 77, false, true);
  check_head<T>(cuda, {29, 24, 101, 7, 3}, 78, true, false);
}

TEST(CudaLmHead, Fp32MatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_heads<float>(*ops);
}
TEST(CudaLmHead, Bf16MatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_heads<bf16_t>(*ops);
}
TEST(CudaLmHead, F16MatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_heads<f16_t>(*ops);
}

TEST(CudaLmHead, LossesAndGradientsAreBitIdenticalRunToRun) {
  HR_CUDA_OPS_OR_SKIP(ops);
  // Each row's loss and dlogits come from one block in a fixed order, the GEMMs from the one
  // algorithm cached for their shape: the same call twice gives the same bits.
  const int N = 50, C = 32, V = 1000, chunk = 16;
  const VecF x = rnd(size_t(N) * C, 3), w = rnd(size_t(V) * C, 4);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int n = 0; n < N; ++n) t[n] = (n * 37) % V;
  DeviceBuffer<float> gx(x), gw(w), l1(static_cast<size_t>(N)), l2(static_cast<size_t>(N)),
      lse(static_cast<size_t>(N));
  DeviceBuffer<int32_t> gt(t);
  DeviceBuffer<float> scratch(ops->lm_head_ce_scratch_floats(chunk, V, DType::kF32));
  ops->lm_head_ce_forward(l1.get(), lse.get(), gx.get(), gw.get(), gt.get(), N, C, V, chunk,
                          scratch.get(), V);
  ops->lm_head_ce_forward(l2.get(), lse.get(), gx.get(), gw.get(), gt.get(), N, C, V, chunk,
                          scratch.get(), V);
  const VecF a = l1.download(), b = l2.download();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "losses";
  DeviceBuffer<float> dx1(x.size()), dx2(x.size()), dw1(w), dw2(w);
  ops->lm_head_ce_backward(dx1.get(), dw1.get(), gx.get(), gw.get(), gt.get(), lse.get(), N, C, V,
                           chunk, 0.02f, scratch.get(), V);
  ops->lm_head_ce_backward(dx2.get(), dw2.get(), gx.get(), gw.get(), gt.get(), lse.get(), N, C, V,
                           chunk, 0.02f, scratch.get(), V);
  const VecF x1 = dx1.download(), x2 = dx2.download(), w1 = dw1.download(), w2 = dw2.download();
  EXPECT_EQ(0, std::memcmp(x1.data(), x2.data(), x1.size() * sizeof(float))) << "dx";
  EXPECT_EQ(0, std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(float))) << "dw";
}

}  // namespace
}  // namespace headroom
