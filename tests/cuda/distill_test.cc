// The CUDA distillation head (Ops::lm_head_kd_*, backend/cuda/distill.cu) against the CPU op
// table on the same random inputs: fp32, bf16 and f16 students, fp32 and bf16 teachers, a teacher
// narrower and one wider than the student, two chunk sizes, alpha 0 / 0.5 / 1; with alpha 0 the
// CE head's bits; the same bits run to run.
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

template <typename T>
using HeadW = backend::Ops::GemmWeight<T>;

// The bytes of a host vector (the teacher's operands, fp32 or bf16).
std::vector<uint8_t> bytes_of(const VecF& v, DType dtype) {
  std::vector<uint8_t> out;
  if (dtype == DType::kBF16) {
    const auto b = cast<bf16_t>(v);
    out.resize(b.size() * sizeof(bf16_t));
    std::memcpy(out.data(), b.data(), out.size());
  } else {
    out.resize(v.size() * sizeof(float));
    std::memcpy(out.data(), v.data(), out.size());
  }
  return out;
}

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

struct KdCase {
  int N, C, V, chunk, Ct;
  DType teacher;
  float alpha, temperature;
};

// The outputs of one forward + backward on one table.
struct KdResult {
  VecF losses, stats, dx, dw;
};

// The inputs of a case (host), shared by both tables.
template <typename T>
struct KdInputs {
  std::vector<T> x;
  std::vector<HeadW<T>> w;
  std::vector<uint8_t> tx, tw;
  std::vector<int32_t> targets;
  VecF dw0;
  float dloss = 0;
};

template <typename T>
KdInputs<T> make_inputs(const KdCase& kc, uint32_t seed) {
  KdInputs<T> in;
  const int N = kc.N, C = kc.C, V = kc.V, Ct = kc.Ct;
  in.x = cast<T>(rnd(size_t(N) * C, seed, -2.0f, 2.0f));
  VecF wf = rnd(size_t(V) * C, seed + 1);
  if constexpr (std::is_same_v<T, f16_t>) wf = widen(cast<f16_t>(wf));
  in.w = cast<HeadW<T>>(wf);
  in.tx = bytes_of(rnd(size_t(N) * Ct, seed + 2, -2.0f, 2.0f), kc.teacher);
  in.tw = bytes_of(rnd(size_t(V) * Ct, seed + 3), kc.teacher);
  in.targets.resize(static_cast<size_t>(N));
  std::mt19937 rng(seed + 4);
  for (int n = 0; n < N; ++n) in.targets[n] = n % 7 == 3 ? -1 : int32_t(rng() % uint32_t(V));
  in.dw0 = rnd(size_t(V) * C, seed + 5);
  in.dloss = 1.0f / float(N);
  return in;
}

template <typename T>
KdResult run_cpu(const KdCase& kc, const KdInputs<T>& in) {
  const backend::Ops& cpu = backend::cpu_ops();
  const int N = kc.N, C = kc.C, V = kc.V, chunk = kc.chunk;
  KdResult r{VecF(static_cast<size_t>(N)), VecF(4 * size_t(N)), {}, in.dw0};
  std::vector<T> dx(size_t(N) * C, from_f<T>(5.0f));
  VecF scratch(cpu.lm_head_ce_scratch_floats(chunk, V, dtype_of<T>()), NAN);
  VecF tlogits(size_t(chunk) * size_t(cpu.logits_row_stride(V)), NAN);
  VecF staging(std::is_same_v<T, f16_t> ? cpu.f16_matmul_staging_floats(chunk, C, C) : 0);
  const backend::F16StagingScope scope(cpu, staging.data(), staging.size());
  const backend::KdTeacher teacher{in.tx.data(),  in.tw.data(), kc.teacher, kc.Ct, V,
                                   tlogits.data()};
  const backend::KdLoss kd{kc.alpha, kc.temperature};
  cpu.lm_head_kd_forward(r.losses.data(), r.stats.data(), in.x.data(), in.w.data(), teacher,
                         in.targets.data(), N, C, V, chunk, kd, scratch.data(), V);
  cpu.lm_head_kd_backward(dx.data(), r.dw.data(), in.x.data(), in.w.data(), teacher,
                          in.targets.data(), r.stats.data(), N, C, V, chunk, kd, in.dloss,
                          scratch.data(), V);
  r.dx = widen(dx);
  return r;
}

template <typename T>
KdResult run_cuda(const backend::Ops& cuda, const KdCase& kc, const KdInputs<T>& in) {
  const int N = kc.N, C = kc.C, V = kc.V, chunk = kc.chunk;
  DeviceBuffer<T> gx(in.x), gdx(std::vector<T>(size_t(N) * C, from_f<T>(5.0f)));
  DeviceBuffer<HeadW<T>> gw(in.w);
  DeviceBuffer<uint8_t> gtx(in.tx), gtw(in.tw);
  DeviceBuffer<int32_t> gt(in.targets);
  DeviceBuffer<float> losses(static_cast<size_t>(N)), stats(4 * size_t(N)), gdw(in.dw0);
  DeviceBuffer<float> scratch(cuda.lm_head_ce_scratch_floats(chunk, V, dtype_of<T>()));
  DeviceBuffer<float> tlogits(size_t(chunk) * size_t(cuda.logits_row_stride(V)));
  DeviceBuffer<float> staging(std::is_same_v<T, f16_t> ? cuda.f16_matmul_staging_floats(chunk, C, C)
                                                       : 0);
  {
    const backend::F16StagingScope scope(cuda, staging.get(), staging.size());
    const backend::KdTeacher teacher{gtx.get(), gtw.get(), kc.teacher, kc.Ct, V, tlogits.get()};
    const backend::KdLoss kd{kc.alpha, kc.temperature};
    cuda.lm_head_kd_forward(losses.get(), stats.get(), gx.get(), gw.get(), teacher, gt.get(), N, C,
                            V, chunk, kd, scratch.get(), V);
    cuda.lm_head_kd_backward(gdx.get(), gdw.get(), gx.get(), gw.get(), teacher, gt.get(),
                             stats.get(), N, C, V, chunk, kd, in.dloss, scratch.get(), V);
    cuda.synchronize();
  }
  return {losses.download(), stats.download(), widen(gdx.download()), gdw.download()};
}

std::string name_of(const KdCase& kc, const char* student) {
  return std::string(student) + " N=" + std::to_string(kc.N) + " C=" + std::to_string(kc.C) +
         " V=" + std::to_string(kc.V) + " chunk=" + std::to_string(kc.chunk) +
         " teacher C=" + std::to_string(kc.Ct) + (kc.teacher == DType::kBF16 ? " bf16" : " fp32") +
         " alpha=" + std::to_string(kc.alpha) + " T=" + std::to_string(kc.temperature);
}

template <typename T>
void check_kd(const backend::Ops& cuda, const KdCase& kc, uint32_t seed) {
  const std::string what = name_of(kc, std::is_same_v<T, float>    ? "fp32"
                                       : std::is_same_v<T, bf16_t> ? "bf16"
                                                                   : "f16");
  const KdInputs<T> in = make_inputs<T>(kc, seed);
  const KdResult want = run_cpu<T>(kc, in);
  const KdResult got = run_cuda<T>(cuda, kc, in);
  // Logits are sums of C (student) or Ct (teacher) products of values up to 2, fp32-accumulated
  // in different orders on the two sides; the lse's, CE and KL inherit that error (the KL's
  // through alpha tau^2 / tau). Gradients as the CE head's tests: relative to the largest one.
  const double tau2 = double(kc.temperature) * kc.temperature;
  const double lt = (4e-6 * std::max(kc.C, kc.Ct) + 1e-5) * (1.0 + tau2);
  expect_close(got.losses, want.losses, lt, 1e-4, what + " losses");
  expect_close(got.stats, want.stats, lt, 1e-4, what + " stats");
  const double g = std::is_same_v<T, float> ? 1e-4 : std::is_same_v<T, bf16_t> ? 2e-2 : 4e-3;
  expect_close(got.dx, want.dx, g * max_abs(want.dx) + 1e-7, g, what + " dx");
  VecF got_delta(want.dw.size()), want_delta(want.dw.size());
  for (size_t i = 0; i < want.dw.size(); ++i) {
    got_delta[i] = got.dw[i] - in.dw0[i];
    want_delta[i] = want.dw[i] - in.dw0[i];
  }
  expect_close(got_delta, want_delta, g * max_abs(want_delta) + 1e-7, g,
               what + " dw (accumulated)");
}

// Every combination of teacher dtype, teacher width (narrower, wider), chunk (several chunks,
// one chunk larger than N) and alpha, on a small vocabulary, then one GPT-2-sized vocabulary.
template <typename T>
void check_kds(const backend::Ops& cuda) {
  uint32_t seed = 2000;
  for (DType td : {DType::kF32, DType::kBF16}) {
    for (int Ct : {8, 48}) {
      for (int chunk : {5, 32}) {
        for (float alpha : {0.0f, 0.5f, 1.0f}) {
          check_kd<T>(cuda, {13, 16, 203, chunk, Ct, td, alpha, 2.0f}, seed += 10);
        }
      }
    }
  }
  check_kd<T>(cuda, {40, 64, 50257, 16, 96, DType::kBF16, 0.5f, 1.5f}, 77);
  check_kd<T>(cuda, {29, 24, 101, 7, 24, DType::kF32, 0.3f, 0.7f}, 78);
}

TEST(CudaDistill, Fp32StudentMatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_kds<float>(*ops);
}
TEST(CudaDistill, Bf16StudentMatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_kds<bf16_t>(*ops);
}
TEST(CudaDistill, F16StudentMatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_kd<f16_t>(*ops, {13, 16, 203, 5, 48, DType::kF32, 0.5f, 2.0f}, 91);
  check_kd<f16_t>(*ops, {13, 16, 203, 32, 8, DType::kBF16, 1.0f, 2.0f}, 92);
}

// With alpha = 0 the losses, stats[0, N) (the lse) and gradients are lm_head_ce's bit for bit.
TEST(CudaDistill, AlphaZeroIsTheCeHeadBitForBit) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const KdCase kc{37, 32, 1000, 16, 24, DType::kBF16, 0.0f, 2.0f};
  const KdInputs<float> in = make_inputs<float>(kc, 5);
  const KdResult kd = run_cuda<float>(*ops, kc, in);
  const int N = kc.N, C = kc.C, V = kc.V, chunk = kc.chunk;
  DeviceBuffer<float> gx(in.x), gw(in.w), losses(static_cast<size_t>(N)),
      lse(static_cast<size_t>(N)), gdw(in.dw0);
  DeviceBuffer<float> gdx(VecF(size_t(N) * C, 5.0f));
  DeviceBuffer<int32_t> gt(in.targets);
  DeviceBuffer<float> scratch(ops->lm_head_ce_scratch_floats(chunk, V, DType::kF32));
  ops->lm_head_ce_forward(losses.get(), lse.get(), gx.get(), gw.get(), gt.get(), N, C, V, chunk,
                          scratch.get(), V);
  ops->lm_head_ce_backward(gdx.get(), gdw.get(), gx.get(), gw.get(), gt.get(), lse.get(), N, C, V,
                           chunk, in.dloss, scratch.get(), V);
  const VecF l = losses.download(), s = lse.download(), dx = gdx.download(), dw = gdw.download();
  EXPECT_EQ(0, std::memcmp(kd.losses.data(), l.data(), l.size() * sizeof(float))) << "losses";
  EXPECT_EQ(0, std::memcmp(kd.stats.data(), s.data(), s.size() * sizeof(float))) << "lse";
  EXPECT_EQ(0, std::memcmp(kd.dx.data(), dx.data(), dx.size() * sizeof(float))) << "dx";
  EXPECT_EQ(0, std::memcmp(kd.dw.data(), dw.data(), dw.size() * sizeof(float))) << "dw";
}

TEST(CudaDistill, LossesAndGradientsAreBitIdenticalRunToRun) {
  HR_CUDA_OPS_OR_SKIP(ops);
  const KdCase kc{50, 32, 1000, 16, 48, DType::kF32, 0.5f, 2.0f};
  const KdInputs<bf16_t> in = make_inputs<bf16_t>(kc, 9);
  const KdResult a = run_cuda<bf16_t>(*ops, kc, in), b = run_cuda<bf16_t>(*ops, kc, in);
  EXPECT_EQ(0, std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.stats.data(), b.stats.data(), a.stats.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.dx.data(), b.dx.data(), a.dx.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(a.dw.data(), b.dw.data(), a.dw.size() * sizeof(float)));
}

}  // namespace
}  // namespace headroom
