// Knowledge distillation (docs/notes/distillation.md): the fused KD head against PyTorch (the
// fixture of tools/reference/distill_reference.py) and against an unfused double-precision
// reference over full logits for several chunk sizes; alpha = 0 reproducing the CE head bit for
// bit; and, through the trainer, accumulation / micro-batch invariance with a teacher, measured
// peak = planned peak, plain training reproduced with alpha = 0, and the clear errors of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/distill_kernels.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "backend/ops.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/run_request.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace headroom {
namespace {

const std::string kFixture =
    std::string(HEADROOM_SOURCE_DIR) + "/tests/train/fixtures/distill_tiny.safetensors";

std::vector<float> floats(const model::SafetensorsFile& f, const std::string& name) {
  const model::SafetensorsTensor* t = f.find(name);
  if (t == nullptr) {
    ADD_FAILURE() << "fixture lacks " << name;
    return {};
  }
  std::vector<float> v(t->bytes / 4);
  std::memcpy(v.data(), t->data, t->bytes);
  return v;
}

// max |a - b| <= atol + rtol * max |b|, naming the worst index.
void expect_close(const float* a, const std::vector<float>& b, double atol, double rtol,
                  const std::string& what) {
  double scale = 0, worst = 0;
  size_t wi = 0;
  for (float x : b) scale = std::max(scale, double(std::fabs(x)));
  for (size_t i = 0; i < b.size(); i++) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (d > worst) worst = d, wi = i;
  }
  EXPECT_LE(worst, atol + rtol * scale)
      << what << ": worst at " << wi << " (" << a[wi] << " vs " << b[wi] << "), scale " << scale;
}

// The KD head's loss over a step and its gradients, from the kernels.
struct KdRun {
  double loss = 0, ce = 0;
  std::vector<float> losses, stats, dx, dw;
};
KdRun run_kd(const std::vector<float>& xs, const std::vector<float>& ws,
             const backend::KdTeacher& teacher, const std::vector<int32_t>& tg, int N, int C, int V,
             int chunk, backend::KdLoss kd) {
  KdRun r;
  r.losses.assign(size_t(N), NAN);
  r.stats.assign(size_t(4 * N), NAN);
  r.dx.assign(size_t(N) * C, NAN);
  r.dw.assign(size_t(V) * C, 0.0f);
  std::vector<float> scratch(cpu::lm_head_ce_scratch_floats(chunk, V), NAN),
      tchunk(cpu::lm_head_kd_teacher_floats(chunk, V), NAN);
  backend::KdTeacher t = teacher;
  t.logits_chunk = tchunk.data();
  cpu::lm_head_kd_forward(r.losses.data(), r.stats.data(), xs.data(), ws.data(), t, tg.data(), N, C,
                          V, chunk, kd, scratch.data());
  int valid = 0;
  for (int n = 0; n < N; n++) {
    if (tg[size_t(n)] < 0) continue;
    valid++;
    r.loss += r.losses[size_t(n)];
    r.ce += r.stats[size_t(3 * N + n)];
  }
  r.loss /= valid;
  r.ce /= valid;
  cpu::lm_head_kd_backward(r.dx.data(), r.dw.data(), xs.data(), ws.data(), t, tg.data(),
                           r.stats.data(), N, C, V, chunk, kd, 1.0f / float(valid), scratch.data());
  return r;
}

// 1. Against PyTorch 1.13 (float64 reference): the step's loss, its CE part, and the gradients
// w.r.t. the student's hidden states, head weight and logits. Tolerances: float32 arithmetic
// with float accumulators over V = 83 and C <= 12 terms, ~1e-6 relative.
TEST(DistillFixture, MatchesPyTorch) {
  Result<model::SafetensorsFile> f = model::SafetensorsFile::open(kFixture);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string()
                         << " (regenerate: /usr/bin/python3 tools/reference/distill_reference.py)";
  const auto& md = f->metadata();
  const int N = std::stoi(md.at("N")), V = std::stoi(md.at("V")), Cs = std::stoi(md.at("Cs")),
            Ct = std::stoi(md.at("Ct")), cases = std::stoi(md.at("cases"));
  const std::vector<float> xs = floats(*f, "xs"), ws = floats(*f, "ws"), xt = floats(*f, "xt"),
                           wt = floats(*f, "wt");
  std::vector<int32_t> tg(static_cast<size_t>(N));
  std::memcpy(tg.data(), f->find("targets")->data, tg.size() * 4);
  const backend::KdTeacher teacher{xt.data(), wt.data(), DType::kF32, Ct, 0};
  ASSERT_GE(cases, 3);
  for (int k = 0; k < cases; k++) {
    const std::string p = "case" + std::to_string(k) + ".";
    const backend::KdLoss kd{std::stof(md.at(p + "alpha")), std::stof(md.at(p + "temperature"))};
    SCOPED_TRACE(p + " alpha " + std::to_string(kd.alpha) + " T " + std::to_string(kd.temperature));
    for (int chunk : {1, 3, N}) {
      const KdRun r = run_kd(xs, ws, teacher, tg, N, Cs, V, chunk, kd);
      EXPECT_NEAR(r.loss, floats(*f, p + "loss")[0], 2e-6 * std::max(1.0, r.loss));
      EXPECT_NEAR(r.ce, floats(*f, p + "ce")[0], 2e-6 * std::max(1.0, r.ce));
      expect_close(r.dx.data(), floats(*f, p + "dxs"), 1e-7, 2e-5, p + "dxs");
      expect_close(r.dw.data(), floats(*f, p + "dws"), 1e-7, 2e-5, p + "dws");
    }
    // The gradient w.r.t. the logits themselves: a head whose input is the logits and whose
    // weight is the identity, so that dx = dlogits (the logits in double, rounded once).
    std::vector<float> z(size_t(N) * V), eye(size_t(V) * V, 0.0f);
    for (int n = 0; n < N; n++) {
      for (int v = 0; v < V; v++) {
        double s = 0;
        for (int c = 0; c < Cs; c++) s += double(xs[size_t(n * Cs + c)]) * ws[size_t(v * Cs + c)];
        z[size_t(n) * V + v] = float(s);
      }
    }
    for (int v = 0; v < V; v++) eye[size_t(v) * V + v] = 1.0f;
    const KdRun r = run_kd(z, eye, teacher, tg, N, V, V, 4, kd);
    expect_close(r.dx.data(), floats(*f, p + "dlogits"), 1e-7, 2e-5, p + "dlogits");
  }
}

// An unfused reference in double: full logits of both models, the loss per token and the
// student's dlogits, then dx and dw.
struct Reference {
  std::vector<double> losses, dx, dw;
};
Reference reference(const std::vector<float>& xs, const std::vector<float>& ws,
                    const std::vector<float>& xt, const std::vector<float>& wt,
                    const std::vector<int32_t>& tg, int N, int Cs, int Ct, int V,
                    backend::KdLoss kd, double dloss) {
  Reference r;
  r.losses.assign(size_t(N), 0);
  r.dx.assign(size_t(N) * Cs, 0);
  r.dw.assign(size_t(V) * Cs, 0);
  const double a = kd.alpha, tau = kd.temperature;
  for (int n = 0; n < N; n++) {
    if (tg[size_t(n)] < 0) continue;
    std::vector<double> s(static_cast<size_t>(V)), t(static_cast<size_t>(V));
    for (int v = 0; v < V; v++) {
      for (int c = 0; c < Cs; c++)
        s[size_t(v)] += double(xs[size_t(n * Cs + c)]) * ws[size_t(v * Cs + c)];
      for (int c = 0; c < Ct; c++)
        t[size_t(v)] += double(xt[size_t(n * Ct + c)]) * wt[size_t(v * Ct + c)];
    }
    auto lse = [&](const std::vector<double>& x, double scale) {
      double m = -INFINITY, sum = 0;
      for (double e : x) m = std::max(m, e * scale);
      for (double e : x) sum += std::exp(e * scale - m);
      return m + std::log(sum);
    };
    const double l = lse(s, 1), ls = lse(s, 1 / tau), lt = lse(t, 1 / tau);
    double kl = 0;
    for (int v = 0; v < V; v++) {
      const double pt = std::exp(t[size_t(v)] / tau - lt);
      kl += pt * ((t[size_t(v)] / tau - lt) - (s[size_t(v)] / tau - ls));
    }
    const int y = tg[size_t(n)];
    r.losses[size_t(n)] = (1 - a) * (l - s[size_t(y)]) + a * tau * tau * kl;
    for (int v = 0; v < V; v++) {
      const double d =
          dloss *
          ((1 - a) * (std::exp(s[size_t(v)] - l) - (v == y)) +
           a * tau * (std::exp(s[size_t(v)] / tau - ls) - std::exp(t[size_t(v)] / tau - lt)));
      for (int c = 0; c < Cs; c++) {
        r.dx[size_t(n * Cs + c)] += d * ws[size_t(v * Cs + c)];
        r.dw[size_t(v * Cs + c)] += d * xs[size_t(n * Cs + c)];
      }
    }
  }
  return r;
}

std::vector<float> randn(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// 2. The fused, chunked loss equals the unfused full-logits reference for several chunk sizes
// (chunks that divide N, that do not, one token, all tokens and more than N), with a teacher
// narrower and one wider than the student. Tolerance: float32 GEMMs over C <= 48 and exp/log in
// float, ~1e-5 relative.
TEST(DistillKernel, ChunkedEqualsUnfusedReference) {
  std::mt19937 rng(11);
  const int N = 37, V = 131, Cs = 16;
  for (int Ct : {8, 48}) {
    const std::vector<float> xs = randn(rng, size_t(N) * Cs, 1.0f),
                             ws = randn(rng, size_t(V) * Cs, 0.4f),
                             xt = randn(rng, size_t(N) * Ct, 1.0f),
                             wt = randn(rng, size_t(V) * Ct, 0.4f);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int n = 0; n < N; n++) tg[size_t(n)] = n % 7 == 3 ? -1 : int32_t(rng() % uint32_t(V));
    const backend::KdTeacher teacher{xt.data(), wt.data(), DType::kF32, Ct, 0};
    for (const backend::KdLoss kd : {backend::KdLoss{0.5f, 2.0f}, backend::KdLoss{0.9f, 0.7f}}) {
      int valid = 0;
      for (int32_t t : tg) valid += t >= 0;
      const Reference ref = reference(xs, ws, xt, wt, tg, N, Cs, Ct, V, kd, 1.0 / valid);
      const std::vector<float> want_losses(ref.losses.begin(), ref.losses.end()),
          want_dx(ref.dx.begin(), ref.dx.end()), want_dw(ref.dw.begin(), ref.dw.end());
      for (int chunk : {1, 5, 16, 37, 64}) {
        SCOPED_TRACE("Ct " + std::to_string(Ct) + " chunk " + std::to_string(chunk) + " alpha " +
                     std::to_string(kd.alpha));
        const KdRun r = run_kd(xs, ws, teacher, tg, N, Cs, V, chunk, kd);
        expect_close(r.losses.data(), want_losses, 1e-6, 1e-5, "losses");
        expect_close(r.dx.data(), want_dx, 1e-8, 1e-5, "dx");
        expect_close(r.dw.data(), want_dw, 1e-8, 1e-5, "dw");
        for (int n = 0; n < N; n++) {
          if (tg[size_t(n)] < 0) {
            EXPECT_EQ(r.losses[size_t(n)], 0.0f);
            for (int c = 0; c < Cs; c++) EXPECT_EQ(r.dx[size_t(n * Cs + c)], 0.0f);
          }
        }
      }
    }
  }
}

// A bf16 teacher (its hidden states and head weight in bf16) against the same reference on the
// bf16-rounded values: the teacher's GEMM runs in bf16 with fp32 accumulation.
TEST(DistillKernel, Bf16TeacherMatchesReferenceOnItsRoundedValues) {
  std::mt19937 rng(12);
  const int N = 19, V = 97, Cs = 16, Ct = 32;
  std::vector<float> xs = randn(rng, size_t(N) * Cs, 1.0f), ws = randn(rng, size_t(V) * Cs, 0.4f),
                     xt = randn(rng, size_t(N) * Ct, 1.0f), wt = randn(rng, size_t(V) * Ct, 0.4f);
  std::vector<bf16_t> xt16(xt.size()), wt16(wt.size());
  cpu::cast_to_bf16(xt16.data(), xt.data(), int64_t(xt.size()));
  cpu::cast_to_bf16(wt16.data(), wt.data(), int64_t(wt.size()));
  for (size_t i = 0; i < xt.size(); i++) xt[i] = cpu::to_f32(xt16[i]);
  for (size_t i = 0; i < wt.size(); i++) wt[i] = cpu::to_f32(wt16[i]);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int n = 0; n < N; n++) tg[size_t(n)] = int32_t(rng() % uint32_t(V));
  const backend::KdLoss kd{0.5f, 2.0f};
  const Reference ref = reference(xs, ws, xt, wt, tg, N, Cs, Ct, V, kd, 1.0 / N);
  const backend::KdTeacher teacher{xt16.data(), wt16.data(), DType::kBF16, Ct, 0};
  const KdRun r = run_kd(xs, ws, teacher, tg, N, Cs, V, 8, kd);
  expect_close(r.losses.data(), std::vector<float>(ref.losses.begin(), ref.losses.end()), 1e-6,
               1e-5, "losses");
  expect_close(r.dx.data(), std::vector<float>(ref.dx.begin(), ref.dx.end()), 1e-8, 1e-5, "dx");
}

// 6 (kernel level). alpha = 0: the KD head is the CE head bit for bit, whatever the teacher
// and the temperature: losses, log-sum-exps, dx and dw, in fp32 and bf16.
TEST(DistillKernel, AlphaZeroIsTheCeHeadBitForBit) {
  std::mt19937 rng(13);
  const int N = 29, V = 211, C = 32, Ct = 24, chunk = 8;
  const std::vector<float> xs = randn(rng, size_t(N) * C, 1.0f),
                           ws = randn(rng, size_t(V) * C, 0.3f),
                           xt = randn(rng, size_t(N) * Ct, 1.0f),
                           wt = randn(rng, size_t(V) * Ct, 0.3f);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int n = 0; n < N; n++) tg[size_t(n)] = n % 5 == 1 ? -1 : int32_t(rng() % uint32_t(V));
  std::vector<float> tchunk(cpu::lm_head_kd_teacher_floats(chunk, V));
  const backend::KdTeacher teacher{xt.data(), wt.data(), DType::kF32, Ct, 0, tchunk.data()};
  const backend::KdLoss kd{0.0f, 3.0f};
  const float dloss = 1.0f / 23.0f;
  {
    std::vector<float> l1(static_cast<size_t>(N)), lse(static_cast<size_t>(N)), dx1(size_t(N) * C),
        dw1(size_t(V) * C, 0.0f);
    std::vector<float> scratch(cpu::lm_head_ce_scratch_floats(chunk, V));
    cpu::lm_head_ce_forward(l1.data(), lse.data(), xs.data(), ws.data(), tg.data(), N, C, V, chunk,
                            scratch.data());
    cpu::lm_head_ce_backward(dx1.data(), dw1.data(), xs.data(), ws.data(), tg.data(), lse.data(), N,
                             C, V, chunk, dloss, scratch.data());
    std::vector<float> l2(static_cast<size_t>(N)), stats(size_t(4 * N)), dx2(size_t(N) * C),
        dw2(size_t(V) * C, 0.0f);
    std::vector<float> kscratch(cpu::lm_head_ce_scratch_floats(chunk, V));
    cpu::lm_head_kd_forward(l2.data(), stats.data(), xs.data(), ws.data(), teacher, tg.data(), N, C,
                            V, chunk, kd, kscratch.data());
    cpu::lm_head_kd_backward(dx2.data(), dw2.data(), xs.data(), ws.data(), teacher, tg.data(),
                             stats.data(), N, C, V, chunk, kd, dloss, kscratch.data());
    EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4)) << "losses";
    EXPECT_EQ(0, std::memcmp(lse.data(), stats.data(), lse.size() * 4)) << "lse";
    EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), dx1.size() * 4)) << "dx";
    EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4)) << "dw";
  }
  {  // bf16 storage
    std::vector<bf16_t> x16(xs.size()), w16(ws.size());
    cpu::cast_to_bf16(x16.data(), xs.data(), int64_t(xs.size()));
    cpu::cast_to_bf16(w16.data(), ws.data(), int64_t(ws.size()));
    std::vector<float> l1(static_cast<size_t>(N)), lse(static_cast<size_t>(N)),
        dw1(size_t(V) * C, 0.0f);
    std::vector<bf16_t> dx1(size_t(N) * C), dx2(size_t(N) * C);
    std::vector<float> scratch(cpu::lm_head_ce_scratch_floats(chunk, V, DType::kBF16));
    cpu::lm_head_ce_forward(l1.data(), lse.data(), x16.data(), w16.data(), tg.data(), N, C, V,
                            chunk, scratch.data());
    cpu::lm_head_ce_backward(dx1.data(), dw1.data(), x16.data(), w16.data(), tg.data(), lse.data(),
                             N, C, V, chunk, dloss, scratch.data());
    std::vector<float> l2(static_cast<size_t>(N)), stats(size_t(4 * N)), dw2(size_t(V) * C, 0.0f);
    std::vector<float> kscratch(cpu::lm_head_ce_scratch_floats(chunk, V, DType::kBF16));
    cpu::lm_head_kd_forward(l2.data(), stats.data(), x16.data(), w16.data(), teacher, tg.data(), N,
                            C, V, chunk, kd, kscratch.data());
    cpu::lm_head_kd_backward(dx2.data(), dw2.data(), x16.data(), w16.data(), teacher, tg.data(),
                             stats.data(), N, C, V, chunk, kd, dloss, kscratch.data());
    EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4)) << "bf16 losses";
    EXPECT_EQ(0, std::memcmp(dx1.data(), dx2.data(), dx1.size() * 2)) << "bf16 dx";
    EXPECT_EQ(0, std::memcmp(dw1.data(), dw2.data(), dw1.size() * 4)) << "bf16 dw";
  }
}

// ---- through the trainer -------------------------------------------------------------------

using train::test::gpt2_config;
using train::test::llama_config;

// A teacher model directory: `c` initialised from `seed` (a teacher need not be trained for the
// mathematics to be checked), saved as `headroom train --out` saves a model.
std::string write_teacher(const model::Gpt2Config& c, uint64_t seed, const std::string& name) {
  const std::string dir = (train::test::fresh_test_dir("distill") / name).string();
  const model::ParamTable t = model::gpt2_param_table(c);
  std::vector<float> p(static_cast<size_t>(t.total_floats), 0.0f);
  model::gpt2_init_params(c, t, p.data(), seed);
  EXPECT_TRUE(model::save_pretrained(dir, c, t, p.data()).is_ok()) << dir;
  return dir;
}

// The student: 2 layers 64 wide; the teacher wider and deeper (3 layers, 96 wide, 6 heads).
model::Gpt2Config student_gpt2() { return gpt2_config(2, 64, 4, 211, 32); }
model::Gpt2Config teacher_gpt2() { return gpt2_config(3, 96, 6, 211, 32); }

train::TrainOptions distill_options(const model::Gpt2Config& student, const std::string& data,
                                    int b, int k) {
  train::TrainOptions o;
  o.config = student;
  o.model_name = "student";
  o.data = data;
  o.seq = 16;
  o.micro_batch = b;
  o.accumulation = k;
  o.exec.head_chunk = 24;  // chunks that do not divide the micro-batch's tokens
  o.steps = 3;
  o.warmup_steps = 1;
  o.device_memory = uint64_t(1) << 30;
  o.val_fraction = 0;
  return o;
}
void add_teacher(train::TrainOptions* o, const model::Gpt2Config& teacher, const std::string& dir,
                 float alpha, float temperature,
                 model::Precision precision = model::Precision::kFp32) {
  o->exec.distill = model::Distill{{alpha, temperature}, teacher, precision};
  o->teacher_dir = dir;
}

std::vector<double> losses_of(const train::test::RunOutput& r) {
  std::vector<double> l;
  for (const train::StepStats& s : r.steps) l.push_back(s.loss);
  return l;
}

// 3. The effective batch is invariant with a teacher: three optimizer steps of 4 sequences as
// 4 x 1, 2 x 2 and 1 x 4 micro-batches give the same losses and weights to rounding (the
// accumulation tests' tolerances: GEMMs of other shapes round differently).
TEST(DistillTrainer, AccumulationAndMicroBatchInvariance) {
  const std::string data = train::test::learnable_tokens(211, 20000, "distill_inv");
  const std::string dir = write_teacher(teacher_gpt2(), 77, "teacher");
  auto run = [&](int b, int k) {
    train::TrainOptions o = distill_options(student_gpt2(), data, b, k);
    add_teacher(&o, teacher_gpt2(), dir, 0.5f, 2.0f);
    train::test::RunOutput r = train::test::run_collecting(o);
    EXPECT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    return r;
  };
  const train::test::RunOutput r41 = run(4, 1), r22 = run(2, 2), r14 = run(1, 4);
  const std::vector<double> l41 = losses_of(r41), l22 = losses_of(r22), l14 = losses_of(r14);
  ASSERT_EQ(l41.size(), 3u);
  ASSERT_EQ(l22.size(), 3u);
  ASSERT_EQ(l14.size(), 3u);
  for (size_t i = 0; i < 3; i++) {
    EXPECT_NEAR(l22[i], l41[i], 1e-5 * l41[i]);
    EXPECT_NEAR(l14[i], l41[i], 1e-5 * l41[i]);
  }
  auto max_abs = [](const std::vector<float>& a, const std::vector<float>& b) {
    double w = 0;
    for (size_t i = 0; i < a.size(); i++) w = std::max(w, double(std::fabs(a[i] - b[i])));
    return w;
  };
  ASSERT_EQ(r22.params.size(), r41.params.size());
  ASSERT_EQ(r14.params.size(), r41.params.size());
  EXPECT_LE(max_abs(r22.params, r41.params), 1e-4);
  EXPECT_LE(max_abs(r14.params, r41.params), 1e-4);
  // The teacher makes a difference: the same run without it is another run.
  train::TrainOptions plain = distill_options(student_gpt2(), data, 4, 1);
  const train::test::RunOutput rp = train::test::run_collecting(plain);
  ASSERT_EQ(losses_of(rp).size(), 3u);
  EXPECT_GT(std::fabs(losses_of(rp)[0] - l41[0]), 1e-3);
  std::filesystem::remove(data);
}

// 4. Measured peak = planned peak with a teacher, fp32 and bf16 teachers, GPT-2 and Llama: every
// byte the teacher uses (weights, working set, logits chunk) comes from the plan, which names
// them (category teacher) in the startup table.
TEST(DistillTrainer, MeasuredPeakEqualsPlannedPeak) {
  const std::string data = train::test::learnable_tokens(211, 20000, "distill_peak");
  struct Case {
    std::string name;
    model::Gpt2Config student, teacher;
    model::Precision teacher_precision;
  };
  const std::vector<Case> cases = {
      {"gpt2 fp32 teacher", student_gpt2(), teacher_gpt2(), model::Precision::kFp32},
      {"gpt2 bf16 teacher", student_gpt2(), teacher_gpt2(), model::Precision::kBf16},
      {"llama from a gpt2 teacher", llama_config(2, 64, 4, 2, 211, 32, false), teacher_gpt2(),
       model::Precision::kFp32},
      {"gpt2 from a llama teacher", student_gpt2(), llama_config(3, 96, 6, 2, 211, 32, true),
       model::Precision::kFp32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = write_teacher(c.teacher, 5, "teacher");
    train::TrainOptions o = distill_options(c.student, data, 2, 2);
    add_teacher(&o, c.teacher, dir, 0.5f, 2.0f, c.teacher_precision);
    std::string table;
    train::TrainCallbacks cb;
    std::vector<train::StepStats> steps;
    cb.on_setup = [&](const train::SetupInfo& s) { table = s.memory_table; };
    cb.on_step = [&](const train::StepStats& s) { steps.push_back(s); };
    Result<train::TrainResult> r = train::run_training(o, cb);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    ASSERT_EQ(steps.size(), 3u);
    for (const train::StepStats& s : steps) {
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
      EXPECT_TRUE(std::isfinite(s.loss));
    }
    EXPECT_EQ(r->device_bytes_peak, r->planned_peak_bytes);
    EXPECT_NE(table.find("teacher"), std::string::npos) << table;
    // The plan holds the teacher's weights (fp32) and its working set; the tracked allocations
    // of category teacher peak at exactly the plan's teacher bytes live at once.
    plan::Policy p{2, 2, 16, "fp32", o.exec};
    Result<plan::MemoryPlan> mp = plan::plan_training_memory(c.student, p);
    ASSERT_TRUE(mp.is_ok()) << mp.status().to_string();
    const plan::Region* w = plan::persistent_region(*mp, plan::kTeacherWeightsRegion);
    ASSERT_NE(w, nullptr);
    EXPECT_GE(w->layout.size,
              uint64_t(model::gpt2_param_table(c.teacher).num_parameters) * sizeof(float));
    uint64_t teacher_step = 0;
    for (const memory::BufferDesc& b : mp->step.buffers) {
      if (b.category == memory::Category::kTeacher) teacher_step += b.bytes();
    }
    EXPECT_GT(teacher_step, 0u);  // its working set and logits chunk, in the step region
    // The tracked allocations tagged teacher: its weights' region (the step region is one
    // allocation, tagged activations).
    EXPECT_EQ(r->memory.by_category[size_t(memory::Category::kTeacher)].peak, w->layout.size);
  }
  std::filesystem::remove(data);
}

// 6. alpha = 0 is plain training bit for bit: the teacher runs, its KL term is weighted 0, and
// every loss and weight is the plain run's, GPT-2 and Llama.
TEST(DistillTrainer, AlphaZeroIsPlainTrainingBitForBit) {
  const std::string data = train::test::learnable_tokens(211, 20000, "distill_a0");
  for (const model::Gpt2Config& student :
       {student_gpt2(), llama_config(2, 64, 4, 2, 211, 32, false)}) {
    SCOPED_TRACE(student.model_type);
    const std::string dir = write_teacher(teacher_gpt2(), 9, "teacher");
    train::TrainOptions plain = distill_options(student, data, 2, 2);
    train::TrainOptions kd = plain;
    add_teacher(&kd, teacher_gpt2(), dir, 0.0f, 3.0f);
    const train::test::RunOutput rp = train::test::run_collecting(plain);
    const train::test::RunOutput rk = train::test::run_collecting(kd);
    ASSERT_TRUE(rp.result.is_ok()) << rp.result.status().to_string();
    ASSERT_TRUE(rk.result.is_ok()) << rk.result.status().to_string();
    const std::vector<double> lp = losses_of(rp), lk = losses_of(rk);
    ASSERT_EQ(lp.size(), 3u);
    ASSERT_EQ(lk.size(), 3u);
    for (size_t i = 0; i < 3; i++) EXPECT_EQ(lk[i], lp[i]) << "step " << i + 1;
    ASSERT_EQ(rk.params.size(), rp.params.size());
    EXPECT_EQ(0, std::memcmp(rk.params.data(), rp.params.data(), rp.params.size() * 4));
    // And the run with the teacher held more memory: its bytes are really there.
    EXPECT_GT(rk.result->planned_peak_bytes, rp.result->planned_peak_bytes);
  }
  std::filesystem::remove(data);
}

// 5. Bad input gets a clear error naming the directory, the field and the value.
TEST(DistillErrors, ClearMessages) {
  const model::Gpt2Config student = student_gpt2();
  const std::string dir = write_teacher(teacher_gpt2(), 1, "teacher");
  auto err = [&](const std::string& d, std::optional<float> a, std::optional<float> t,
                 const std::string& dtype = "auto", model::Gpt2Config s = student_gpt2()) {
    Result<std::optional<model::Distill>> r =
        train::resolve_distill(d, a, t, dtype, s, "student-dir");
    EXPECT_FALSE(r.is_ok());
    return r.is_ok() ? std::string() : r.status().message();
  };
  const std::string missing = dir + "-missing";
  std::string m = err(missing, std::nullopt, std::nullopt);
  EXPECT_NE(m.find(missing), std::string::npos) << m;
  EXPECT_NE(m.find("no such directory"), std::string::npos) << m;
  std::filesystem::create_directories(missing);
  m = err(missing, std::nullopt, std::nullopt);
  EXPECT_NE(m.find("no config.json"), std::string::npos) << m;
  std::filesystem::remove_all(missing);

  model::Gpt2Config other = student;
  other.vocab_size = 300;
  m = err(dir, std::nullopt, std::nullopt, "auto", other);
  EXPECT_NE(m.find(dir), std::string::npos) << m;
  EXPECT_NE(m.find("student-dir"), std::string::npos) << m;
  EXPECT_NE(m.find("211"), std::string::npos) << m;
  EXPECT_NE(m.find("300"), std::string::npos) << m;

  for (float a : {-0.1f, 1.5f, float(NAN)}) {
    m = err(dir, a, std::nullopt);
    EXPECT_NE(m.find("--distill-alpha"), std::string::npos) << m;
    EXPECT_NE(m.find("[0, 1]"), std::string::npos) << m;
  }
  for (float t : {0.0f, -2.0f, float(INFINITY)}) {
    m = err(dir, std::nullopt, t);
    EXPECT_NE(m.find("--distill-temperature"), std::string::npos) << m;
  }
  m = err(dir, std::nullopt, std::nullopt, "fp16");
  EXPECT_NE(m.find("--teacher-dtype fp16"), std::string::npos) << m;
  m = err("", 0.3f, std::nullopt);
  EXPECT_NE(m.find("--teacher DIR"), std::string::npos) << m;

  // The good case: the defaults, 0.5 and 2, and the teacher's own config.
  Result<std::optional<model::Distill>> ok =
      train::resolve_distill(dir, std::nullopt, std::nullopt, "auto", student, "student");
  ASSERT_TRUE(ok.is_ok()) << ok.status().to_string();
  ASSERT_TRUE(ok->has_value());
  EXPECT_EQ((*ok)->loss.alpha, 0.5f);
  EXPECT_EQ((*ok)->loss.temperature, 2.0f);
  EXPECT_EQ((*ok)->teacher, teacher_gpt2());
  EXPECT_EQ((*ok)->teacher_precision, model::Precision::kFp32);

  // The planner refuses what cannot run: full logits, a teacher with fewer positions than seq.
  model::ExecOptions e;
  e.distill = **ok;
  e.head_chunk = 0;
  Result<plan::MemoryPlan> mp =
      plan::plan_training_memory(student, plan::Policy{2, 1, 16, "fp32", e});
  ASSERT_FALSE(mp.is_ok());
  EXPECT_NE(mp.status().message().find("fused"), std::string::npos) << mp.status().message();
  e.head_chunk = 16;
  model::Gpt2Config longer = student;
  longer.n_positions = 128;
  mp = plan::plan_training_memory(longer, plan::Policy{2, 1, 64, "fp32", e});
  ASSERT_FALSE(mp.is_ok());
  EXPECT_NE(mp.status().message().find("n_positions 32"), std::string::npos)
      << mp.status().message();
}

// Regression: a fused head whose chunk is larger than the micro-batch's tokens (head_chunk 256,
// 2 x 16 tokens). The plan sizes the head's scratch for min(chunk, tokens) rows; the kernels were
// given the larger chunk, and in bf16 put the chunk's dlogits at scratch + chunk x ld, past the
// buffer, over other step buffers (`headroom train --precision bf16 --global-batch 2 --seq 32`,
// with or without a teacher, exploded at step 2). The model now passes the planned chunk: the
// results equal those with a chunk of exactly the tokens, bit for bit, CE and KD heads.
TEST(DistillTrainer, FusedHeadChunkLargerThanTheTokensStaysInItsScratch) {
  const model::Gpt2Config c = student_gpt2();
  for (const bool kd : {false, true}) {
    SCOPED_TRACE(kd ? "KD head" : "CE head");
    model::ExecOptions big;
    big.precision = model::Precision::kBf16;
    big.head_chunk = 256;
    if (kd) big.distill = model::Distill{{0.5f, 2.0f}, teacher_gpt2(), model::Precision::kFp32};
    model::ExecOptions exact = big;
    exact.head_chunk = 2 * 16;
    auto run = [&](const model::ExecOptions& e) {
      std::unique_ptr<train::test::PlannedModel> m =
          train::test::make_planned_model(c, e, 2, 1, 16, 21);
      EXPECT_NE(m, nullptr);
      std::vector<float> teacher_params;
      std::optional<model::Gpt2> teacher;
      const model::ParamTable tt = model::gpt2_param_table(teacher_gpt2());
      std::mt19937 rng(5);
      std::vector<int32_t> in(32), tg(32);
      for (int i = 0; i < 32; i++) {
        in[size_t(i)] = int32_t(rng() % 211u);
        tg[size_t(i)] = int32_t(rng() % 211u);
      }
      m->bind(2, 16);
      backend::KdTeacher kt;
      if (kd) {
        teacher_params.assign(size_t(tt.total_floats), 0.0f);
        model::gpt2_init_params(teacher_gpt2(), tt, teacher_params.data(), 3);
        teacher.emplace(teacher_gpt2(), &tt);
        teacher->bind_params(teacher_params.data(), nullptr);
        teacher->bind_activations(&*m->arena, m->mp.activations.teacher.get(), 2, 16);
        teacher->forward(in.data(), nullptr);
        kt = teacher->kd_teacher();
        m->net->set_teacher(&kt);
      }
      const double loss = m->net->forward(in.data(), tg.data());
      m->net->backward(in.data(), tg.data(), 1.0f / 32);
      m->net->set_teacher(nullptr);
      std::vector<float> out = m->grads;
      out.push_back(float(loss));
      return out;
    };
    const std::vector<float> a = run(big), b = run(exact);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4));
  }
}

// The same at the kernel: a KD head given a chunk larger than its tokens needs scratch for the
// tokens only; the bytes after it are untouched (bf16, whose dlogits follow the logits).
TEST(DistillKernel, ChunkLargerThanTheTokensWritesOnlyItsScratch) {
  std::mt19937 rng(14);
  const int N = 32, V = 211, C = 32, Ct = 16, chunk = 256;
  const std::vector<float> xs = randn(rng, size_t(N) * C, 1.0f),
                           ws = randn(rng, size_t(V) * C, 0.3f),
                           xt = randn(rng, size_t(N) * Ct, 1.0f),
                           wt = randn(rng, size_t(V) * Ct, 0.3f);
  std::vector<bf16_t> x16(xs.size()), w16(ws.size());
  cpu::cast_to_bf16(x16.data(), xs.data(), int64_t(xs.size()));
  cpu::cast_to_bf16(w16.data(), ws.data(), int64_t(ws.size()));
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int n = 0; n < N; n++) tg[size_t(n)] = int32_t(rng() % uint32_t(V));
  const size_t need = cpu::lm_head_ce_scratch_floats(N, V, DType::kBF16), guard = 1 << 16;
  std::vector<float> scratch(need + guard, 12345.0f),
      tchunk(cpu::lm_head_kd_teacher_floats(N, V) + guard, 12345.0f);
  const backend::KdTeacher teacher{xt.data(), wt.data(), DType::kF32, Ct, 0, tchunk.data()};
  std::vector<float> losses(static_cast<size_t>(N)), stats(size_t(4 * N)), dw(size_t(V) * C, 0.0f);
  std::vector<bf16_t> dx(size_t(N) * C);
  const backend::KdLoss kd{0.5f, 2.0f};
  cpu::lm_head_kd_forward(losses.data(), stats.data(), x16.data(), w16.data(), teacher, tg.data(),
                          N, C, V, chunk, kd, scratch.data());
  cpu::lm_head_kd_backward(dx.data(), dw.data(), x16.data(), w16.data(), teacher, tg.data(),
                           stats.data(), N, C, V, chunk, kd, 1.0f / N, scratch.data());
  EXPECT_TRUE(std::all_of(scratch.begin() + int64_t(need), scratch.end(),
                          [](float v) { return v == 12345.0f; }));
  EXPECT_TRUE(std::all_of(tchunk.begin() + int64_t(cpu::lm_head_kd_teacher_floats(N, V)),
                          tchunk.end(), [](float v) { return v == 12345.0f; }));
}

}  // namespace
}  // namespace headroom
