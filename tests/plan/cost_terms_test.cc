// The cost model's measured terms and its self-correction (docs/notes/cost-model.md): the fits
// recover known coefficients from synthetic timings, a correction scales each kind and is kept
// per machine and thread count, the corrected model changes what the planner chooses, and a
// calibration shared by several processes is measured once. No test here times anything.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "core/check.h"
#include "core/units.h"
#include "model/config.h"
#include "plan/calibrate.h"
#include "plan/cost_model.h"
#include "plan/cost_terms.h"
#include "plan/memory_plan.h"
#include "plan/search.h"

namespace headroom::plan {
namespace {

namespace fs = std::filesystem;

fs::path fresh_dir(const char* name) {
  fs::path d = fs::temp_directory_path() / (std::string(name) + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// Terms of the order calibrate measures on this kind of machine (values, not measurements).
CostTerms synthetic_terms() {
  CostTerms t;
  t.fitted = true;
  for (size_t p = 0; p < 2; p++) {
    const double f = p ? 2.0 : 1.0;
    t.gemm_small[p] = {20e9 * f, 500};
    t.gemm_large[p] = {50e9 * f, 200};
    t.gemm_head_small[p] = {40e9 * f, 100};
    t.gemm_head[p] = {45e9 * f, 100};
    t.attention[p] = {1e-5, 1.0 / (30e9 * f)};
  }
  t.norm = {5e-6, 1e-9};
  t.gelu = {5e-6, 0.5e-9};
  t.residual = {2e-6, 0.3e-9};
  t.loss = {5e-6, 1.5e-9};
  t.embedding = {5e-6, 2e-9};
  t.optimizer = {{{1e-4, 4e-9}, {1e-4, 5e-9}}};
  return t;
}

DeviceSpec measured_cpu(uint64_t memory) {
  DeviceSpec d;
  d.name = "cpu";
  d.kind = "cpu";
  d.memory_bytes = memory;
  d.flops_fp32 = 50e9;
  d.flops_bf16 = 100e9;
  d.mem_bandwidth = 7e9;
  d.host_link_bandwidth = 5e9;
  d.host_memory_bandwidth = 7e9;
  d.interconnect_bandwidth = 0.4e9;
  d.terms = synthetic_terms();
  d.source = "synthetic";
  return d;
}

model::Gpt2Config tiny() {
  Result<model::Gpt2Config> c = model::preset_config("gpt2-tiny");
  HR_CHECK(c.is_ok());
  return *c;
}

MemoryPlan plan_of(const model::Gpt2Config& c, int b, int k, bool fused_head = false,
                   model::Recompute rc = model::Recompute::kNone) {
  Policy p;
  p.micro_batch = b;
  p.accumulation = k;
  p.seq = 128;
  p.exec.head_chunk = fused_head ? 256 : 0;
  if (rc != model::Recompute::kNone) p.exec.recompute.assign(size_t(c.n_layer), rc);
  Result<MemoryPlan> mp = plan_training_memory(c, p);
  HR_CHECK(mp.is_ok());
  return *mp;
}

TEST(CostFit, GemmFitRecoversRateAndHalfRows) {
  const double rate = 73e9, half = 180;
  std::vector<GemmSample> samples;
  for (double rows : {64.0, 256.0, 1024.0, 2048.0}) {
    const double flops = 6.0 * rows * 768 * 3072;
    samples.push_back({flops, rows, flops / (rate * rows / (rows + half))});
  }
  const GemmTerm t = fit_gemm(samples);
  EXPECT_NEAR(t.rate, rate, 1e-6 * rate);
  EXPECT_NEAR(t.half_rows, half, 1e-6 * half);
  EXPECT_NEAR(t.seconds(samples[1].flops, 256), samples[1].seconds, 1e-9);
}

// The forward's share of the pair comes from the samples that timed it (a third without any);
// a degenerate timing cannot make a recomputation free or dearer than the whole pair.
TEST(CostFit, GemmFitMeasuresTheForwardShare) {
  std::vector<GemmSample> samples = {
      {6e9, 256, 0.03, 0.006}, {6e9 * 8, 2048, 0.2, 0.05}, {6e9 * 8, 2048, 0.2}};
  EXPECT_NEAR(fit_gemm(samples).forward_share, 0.056 / 0.23, 1e-12);
  samples = {{6e9, 256, 0.03}, {6e9 * 8, 2048, 0.2}};
  EXPECT_EQ(fit_gemm(samples).forward_share, 1.0 / 3.0);
  samples = {{6e9, 256, 0.03, 0.0001}};
  EXPECT_EQ(fit_gemm(samples).forward_share, 0.15);
  samples = {{6e9, 256, 0.03, 0.05}};
  EXPECT_EQ(fit_gemm(samples).forward_share, 0.6);
}

// Full recomputation adds each block GEMM's forward at the class's measured share of the pair.
TEST(CostModel, RecomputedGemmsCostTheirForwardShare) {
  const model::Gpt2Config c = tiny();
  const MemoryPlan none = plan_of(c, 8, 1), full = plan_of(c, 8, 1, false, model::Recompute::kFull);
  DeviceSpec d = measured_cpu(8 * kGiB);
  auto gemm = [&](const DeviceSpec& spec, const MemoryPlan& mp) {
    return estimate_step(c, mp, spec).by_kind[size_t(CostKind::kGemm)];
  };
  const double third = gemm(d, full) - gemm(d, none);
  d.terms.gemm_small[0].forward_share = 0.2;  // every block GEMM of C = 128 is in the small class
  const double fifth = gemm(d, full) - gemm(d, none);
  EXPECT_GT(third, 0);
  EXPECT_NEAR(fifth / third, 0.2 * 3.0, 1e-9);
}

TEST(CostFit, KernelFitRecoversCallAndUnitCosts) {
  const double call = 7e-6, unit = 1.3e-9;
  std::vector<std::pair<double, double>> xy;
  for (double n : {1e4, 1e5, 1e6}) xy.push_back({n, call + unit * n});
  const KernelTerm t = fit_kernel(xy);
  EXPECT_NEAR(t.call_seconds, call, 1e-9);
  EXPECT_NEAR(t.unit_seconds, unit, 1e-15);
}

TEST(CostFit, AttentionFitSeparatesThePerHeadCostFromTheFlops) {
  // Long sequences (FLOPs dominate) and short ones of many sequences (the per-head cost does):
  // both costs come back, and a fit on the FLOPs alone (the old per-call term) would miss the
  // short sequences by far more than this one misses any.
  const double head = 3e-6, unit = 1.0 / 350e9;
  std::vector<AttentionSample> samples;
  for (const auto [B, T, C, NH] : {std::array<double, 4>{2, 256, 128, 4},
                                   {2, 256, 768, 12},
                                   {64, 32, 128, 4},
                                   {8, 32, 768, 12}}) {
    const double heads = B * NH, units = 12.0 * T * C * B * T;
    samples.push_back({heads, units, heads * head + units * unit});
  }
  const KernelTerm t = fit_attention(samples);
  EXPECT_NEAR(t.call_seconds, head, 1e-6 * head);
  EXPECT_NEAR(t.unit_seconds, unit, 1e-6 * unit);
  // GPT-2 124M at 32 tokens, 32 sequences, one layer: 384 heads cost more than the FLOPs.
  const double heads = 32 * 12, units = 12.0 * 32 * 768 * 32 * 32;
  EXPECT_GT(t.seconds(heads, 0), t.seconds(0, units));
  // Noise that makes the per-head cost negative: the FLOPs alone, never a negative cost.
  const KernelTerm n = fit_attention({{10, 1e9, 1e-3}, {1000, 1e9, 0.5e-3}});
  EXPECT_EQ(n.call_seconds, 0);
  EXPECT_GT(n.unit_seconds, 0);
}

TEST(CostFit, NoisySamplesNeverGiveANegativeCost) {
  // The larger size timed faster than the smaller (a scheduling hiccup on the small one): no
  // negative per-unit cost, the largest sample's rate instead.
  const KernelTerm t = fit_kernel({{1e4, 1e-3}, {1e6, 5e-4}});
  EXPECT_EQ(t.call_seconds, 0);
  EXPECT_NEAR(t.unit_seconds, 5e-10, 1e-18);
  // A negative intercept: the line through the origin.
  const LineFit f = fit_line({{1, 1}, {2, 3}});
  EXPECT_EQ(f.intercept, 0);
  EXPECT_GT(f.slope, 0);
}

TEST(CostFit, ShapeClasses) {
  EXPECT_EQ(gemm_class(128, 384), GemmClass::kSmall);
  EXPECT_EQ(gemm_class(512, 128), GemmClass::kSmall);
  EXPECT_EQ(gemm_class(768, 3072), GemmClass::kLarge);
  EXPECT_EQ(gemm_class(128, 50257), GemmClass::kHeadSmall);
  EXPECT_EQ(gemm_class(768, 50257), GemmClass::kHead);
}

// Pruned heads (an explicit head_dim, Note [Attention width]): the attention's FLOPs and its
// output projection's are those of A = n_head x head_dim, not of n_embd, in the analytic count
// and in the measured terms' prices.
TEST(CostModel, AnAttentionNarrowerThanNEmbdIsPricedAtItsWidth) {
  const model::Gpt2Config c = tiny();  // 4 heads of 32
  model::Gpt2Config half = c;
  half.n_head = 2;
  half.head_dim = 32;  // A = 64 of C = 128
  const MemoryPlan mp = plan_of(c, 8, 1), mh = plan_of(half, 8, 1);
  for (const DeviceSpec& d : {measured_cpu(8 * kGiB), *named_device("A100-80GB")}) {
    SCOPED_TRACE(d.name);
    const StepCost full = estimate_step(c, mp, d), pruned = estimate_step(half, mh, d);
    const double tokens = 8.0 * 128, L = 4, T = 128, A = 64;
    const double non_embedding =
        double(mh.params.num_parameters) - double(half.lookup_parameters());
    EXPECT_DOUBLE_EQ(pruned.model_flops, (6.0 * non_embedding + 12.0 * L * T * A) * tokens);
    // Heads removed: 2 C x A fewer q, k, v columns and A x C fewer projection weights per block.
    EXPECT_DOUBLE_EQ(full.gemm_flops - pruned.gemm_flops,
                     (6.0 * L * 4.0 * 128 * 64 + 12.0 * L * T * 64) * tokens);
    EXPECT_LT(pruned.by_kind[size_t(CostKind::kAttention)],
              full.by_kind[size_t(CostKind::kAttention)]);
  }
}

TEST(CostModel, MeasuredTermsPriceEachKind) {
  const model::Gpt2Config c = tiny();
  const MemoryPlan mp = plan_of(c, 8, 2);
  const StepCost s = estimate_step(c, mp, measured_cpu(8 * kGiB));
  // Every kind the executor times is priced, and the step is their sum (no correction).
  double sum = 0;
  for (size_t k = 0; k < kCostKinds; k++) {
    EXPECT_GT(s.by_kind[k], 0) << cost_kind_name(CostKind(k));
    EXPECT_EQ(s.by_kind[k], s.uncorrected_by_kind[k]);
    sum += s.by_kind[k];
  }
  EXPECT_NEAR(s.step_seconds, sum, 1e-12 * sum);
  // The head (128 -> 50257: the narrow head class) at 1024 rows, forward and backward, twice
  // (accumulation 2), is in the GEMM kind.
  const GemmTerm head = synthetic_terms().gemm_head_small[0];
  EXPECT_GT(s.by_kind[size_t(CostKind::kGemm)], 2 * head.seconds(6.0 * 1024 * 128 * 50257, 1024));
  // The loss: one pass over 1024 x V per micro-batch.
  EXPECT_NEAR(s.by_kind[size_t(CostKind::kLoss)],
              2 * synthetic_terms().loss.seconds(1, 1024.0 * 50257), 1e-12);
  // Attention: 8 sequences x 4 heads in each of the 4 layers, plus 12 T C FLOP units per token.
  EXPECT_NEAR(s.by_kind[size_t(CostKind::kAttention)],
              2 * synthetic_terms().attention[0].seconds(4.0 * 8 * 4, 4.0 * 12 * 128 * 128 * 1024),
              1e-12);
}

// The optimizer kind: AdamW over every parameter, timed without the bf16 copy for fp32 and with
// it (calibrate's second term) for bf16 with the weight copy; without the copy, bf16 casts the
// weights in the step instead and AdamW is the fp32 pass.
TEST(CostModel, OptimizerTermFollowsThePrecisionAndTheCopy) {
  const model::Gpt2Config c = tiny();
  const CostTerms t = synthetic_terms();
  auto optimizer_seconds = [&](model::Precision precision, bool copy) {
    Policy p;
    p.micro_batch = 8;
    p.accumulation = 1;
    p.seq = 128;
    p.exec.precision = precision;
    p.exec.bf16_weight_copy = copy;
    p.precision = precision == model::Precision::kBf16 ? "bf16" : "fp32";
    Result<MemoryPlan> mp = plan_training_memory(c, p);
    HR_CHECK(mp.is_ok());
    const StepCost s = estimate_step(c, *mp, measured_cpu(8 * kGiB));
    return std::pair{s.by_kind[size_t(CostKind::kOptimizer)], double(mp->params.total_floats)};
  };
  const auto [fp32, n] = optimizer_seconds(model::Precision::kFp32, true);
  EXPECT_NEAR(fp32, t.optimizer[0].seconds(1, n), 1e-12);
  EXPECT_NEAR(optimizer_seconds(model::Precision::kBf16, true).first, t.optimizer[1].seconds(1, n),
              1e-12);
  EXPECT_NEAR(optimizer_seconds(model::Precision::kBf16, false).first, t.optimizer[0].seconds(1, n),
              1e-12);
}

TEST(CostModel, CorrectionMakesThePredictionTheMeasurement) {
  const model::Gpt2Config c = tiny();
  DeviceSpec d = measured_cpu(8 * kGiB);
  const MemoryPlan mp = plan_of(c, 8, 1);
  const StepCost before = estimate_step(c, mp, d);
  std::array<double, kCostKinds> measured{};
  const double factors[kCostKinds] = {1.5, 0.8, 2.0, 3.0, 1.1, 4.0, 1.2};
  double step = 0;
  for (size_t k = 0; k < kCostKinds; k++) {
    measured[k] = before.uncorrected_by_kind[k] * factors[k];
    step += measured[k];
  }
  const double tokens = 8.0 * 128;
  step += 0.010;  // outside every kind (data, zeroing)
  d.correction = correction_from(before.uncorrected_by_kind, measured, step, tokens, 2);
  for (size_t k = 0; k < kCostKinds; k++) EXPECT_NEAR(d.correction.scale[k], factors[k], 1e-9);
  const StepCost after = estimate_step(c, mp, d);
  EXPECT_NEAR(after.step_seconds, step, 1e-9 * step);
  for (size_t k = 0; k < kCostKinds; k++) {
    EXPECT_NEAR(after.by_kind[k], measured[k], 1e-9 * measured[k]);
    EXPECT_EQ(after.uncorrected_by_kind[k], before.uncorrected_by_kind[k]);
  }
  // The same correction at another micro-batch: each kind scaled alike, the rest per token.
  const MemoryPlan other = plan_of(c, 4, 2);
  const StepCost o0 = estimate_step(c, other, measured_cpu(8 * kGiB));
  const StepCost o1 = estimate_step(c, other, d);
  for (size_t k = 0; k < kCostKinds; k++)
    EXPECT_NEAR(o1.by_kind[k], o0.by_kind[k] * factors[k], 1e-9 * o1.by_kind[k]);
  EXPECT_NEAR(o1.other_seconds, 0.010, 1e-12);
}

TEST(CostModel, FusedHeadGemmsTakeTheGemmScale) {
  const model::Gpt2Config c = tiny();
  DeviceSpec d = measured_cpu(8 * kGiB);
  const MemoryPlan mp = plan_of(c, 8, 1, /*fused_head=*/true);
  const StepCost s = estimate_step(c, mp, d);
  ASSERT_GT(s.fused_head_gemm_seconds, 0);
  std::array<double, kCostKinds> measured = s.uncorrected_by_kind;
  // GEMMs 2x slower than modelled, the loss's own pass as modelled: the head's GEMMs (timed as
  // loss by the executor) are 2x too.
  const double gemm = s.uncorrected_by_kind[0],
               own = measured[size_t(CostKind::kLoss)] - s.fused_head_gemm_seconds;
  measured[0] = 2 * gemm;
  measured[size_t(CostKind::kLoss)] = own + 2 * s.fused_head_gemm_seconds;
  double step = 0;
  for (double m : measured) step += m;
  d.correction =
      correction_from(s.uncorrected_by_kind, measured, step, 1024, 1, s.fused_head_gemm_seconds);
  EXPECT_NEAR(d.correction.scale[0], 2.0, 1e-9);
  EXPECT_NEAR(d.correction.scale[size_t(CostKind::kLoss)], 1.0, 1e-9);
  // Applied to the unfused head, its GEMMs (in the GEMM kind) are scaled by 2 as well.
  const MemoryPlan full = plan_of(c, 8, 1, false);
  EXPECT_NEAR(estimate_step(c, full, d).by_kind[0],
              2 * estimate_step(c, full, measured_cpu(8 * kGiB)).by_kind[0], 1e-9);
}

TEST(CostModel, UnmeasuredDevicesKeepTheirFigures) {
  // A named GPU (no measured terms): the kinds split the old GEMM + memory-bound figures.
  const model::Gpt2Config c = tiny();
  Result<DeviceSpec> d = named_device("A100-80GB");
  ASSERT_TRUE(d.is_ok());
  const StepCost s = estimate_step(c, plan_of(c, 8, 1), *d);
  double sum = 0;
  for (double k : s.by_kind) sum += k;
  EXPECT_NEAR(sum, s.gemm_seconds + s.memory_seconds, 1e-12 * sum);
  EXPECT_NEAR(s.step_seconds, s.gemm_seconds + s.memory_seconds, 1e-12 * sum);
}

TEST(CostCorrection, KeptPerMachineAndThreadCount) {
  const fs::path dir = fresh_dir("headroom_corrections");
  const std::string path = corrections_path((dir / "calibration.json").string());
  EXPECT_EQ(fs::path(path).filename(), "corrections.json");
  CostCorrection c;
  c.scale[0] = 1.7;
  c.scale[3] = 0.4;
  c.other_seconds_per_token = 2e-6;
  c.steps = 2;
  const std::string two = correction_machine_key("AMD EPYC", 2);
  const std::string one = correction_machine_key("AMD EPYC", 1);
  ASSERT_TRUE(save_correction(path, two, "gpt2-L4-C128-H4-V50257-fp32", c).is_ok());
  CostCorrection other;
  other.steps = 3;
  ASSERT_TRUE(save_correction(path, two, "gpt2-L12-C768-H12-V50257-fp32", other).is_ok());
  Result<CostCorrection> back = load_correction(path, two, "gpt2-L4-C128-H4-V50257-fp32");
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->scale, c.scale);
  EXPECT_EQ(back->other_seconds_per_token, c.other_seconds_per_token);
  EXPECT_EQ(back->steps, 2);
  // Another thread count on the same machine is another machine for the cache.
  EXPECT_EQ(load_correction(path, one, "gpt2-L4-C128-H4-V50257-fp32").status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(load_correction(path, two, "llama-L4-C128-H4-V50257-fp32").status().code(),
            StatusCode::kNotFound);
  // A damaged cache is named.
  { std::ofstream(path, std::ios::trunc) << "{\"AMD EPYC|2 threads\": {\"k\": {\"scale\": 3}}}"; }
  Result<CostCorrection> bad = load_correction(path, two, "k");
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(bad.status().message().find(path), std::string::npos);
  fs::remove_all(dir);
}

TEST(CostCorrection, CalibrationFileKeepsTheTerms) {
  const fs::path dir = fresh_dir("headroom_calibration_terms");
  Calibration cal;
  cal.gemm_flops_fp32 = cal.gemm_peak_fp32 = 50e9;
  cal.mem_bandwidth = 7e9;
  cal.copy_bandwidth = 5e9;
  cal.threads = 2;
  cal.cpu_model = "test";
  cal.date = "2026-12-03";
  cal.terms = synthetic_terms();
  const std::string path = (dir / "calibration.json").string();
  ASSERT_TRUE(save_calibration(cal, path).is_ok());
  Result<Calibration> back = load_calibration(path);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_TRUE(back->terms.fitted);
  EXPECT_EQ(back->terms.gemm_small[1].rate, cal.terms.gemm_small[1].rate);
  EXPECT_EQ(back->terms.gemm_head[0].half_rows, cal.terms.gemm_head[0].half_rows);
  EXPECT_EQ(back->terms.optimizer[0].call_seconds, cal.terms.optimizer[0].call_seconds);
  EXPECT_EQ(back->terms.optimizer[1].unit_seconds, cal.terms.optimizer[1].unit_seconds);
  EXPECT_EQ(back->terms.attention[1].unit_seconds, cal.terms.attention[1].unit_seconds);
  EXPECT_TRUE(cpu_device_spec(*back, kGiB).terms.fitted);
  fs::remove_all(dir);
}

// A correction that says the GEMMs run 20x slower than the terms say (and the memory-bound kernels
// 20x faster) must change the plan chosen at some budget: recomputation, which re-runs GEMMs,
// becomes dearer than a smaller micro-batch. Without the correction applied, every choice would be
// the same.
TEST(CostCorrection, CorrectedModelChangesThePlannersChoice) {
  const model::Gpt2Config c = tiny();
  SearchRequest r;
  r.config = c;
  r.seq = 256;
  r.global_batch = 32;
  r.device = measured_cpu(0);
  SearchRequest corrected = r;
  corrected.device.correction.steps = 1;
  corrected.device.correction.scale.fill(0.05);
  corrected.device.correction.scale[size_t(CostKind::kGemm)] = 20;
  corrected.device.correction.scale[size_t(CostKind::kAttention)] = 20;
  int flips = 0;
  for (uint64_t mib = 200; mib <= 4000; mib += 100) {
    r.device_memory = corrected.device_memory = mib * kMiB;
    Result<SearchResult> a = search_plan(r), b = search_plan(corrected);
    ASSERT_TRUE(a.is_ok() && b.is_ok());
    if (!a->chosen || !b->chosen) continue;
    const Policy &pa = a->chosen->policy, &pb = b->chosen->policy;
    flips += pa.micro_batch != pb.micro_batch || !(pa.exec == pb.exec);
  }
  EXPECT_GT(flips, 0);
}

// The corrections a machine measured are per precision (SearchRequest::corrections): with
// --precision auto, a bf16 correction that says its GEMMs run 4x slower than the terms say must
// make fp32 the choice, while the same correction for fp32 leaves bf16 chosen; and the chosen
// plan's prediction is the one its precision's correction gives.
TEST(CostCorrection, EachPrecisionIsPricedWithItsOwnCorrection) {
  SearchRequest r;
  r.config = tiny();
  r.seq = 128;
  r.global_batch = 8;
  r.precision = "auto";
  r.device = measured_cpu(8 * kGiB);
  r.device_memory = 8 * kGiB;
  CostCorrection slow;
  slow.steps = 3;
  slow.scale.fill(1.0);
  slow.scale[size_t(CostKind::kGemm)] = 4;
  slow.scale[size_t(CostKind::kAttention)] = 4;
  Result<SearchResult> plain = search_plan(r);
  ASSERT_TRUE(plain.is_ok() && plain->chosen);
  EXPECT_EQ(plain->chosen->policy.precision, "bf16");

  SearchRequest bf16_slow = r;
  bf16_slow.corrections["bf16"] = slow;
  Result<SearchResult> a = search_plan(bf16_slow);
  ASSERT_TRUE(a.is_ok() && a->chosen);
  EXPECT_EQ(a->chosen->policy.precision, "fp32");
  // fp32 had no correction: its prediction is the uncorrected one.
  DeviceSpec d = r.device;
  EXPECT_DOUBLE_EQ(a->chosen->cost.step_seconds,
                   estimate_step(r.config, *a->chosen_plan, d).step_seconds);

  SearchRequest fp32_slow = r;
  fp32_slow.corrections["fp32"] = slow;
  Result<SearchResult> b = search_plan(fp32_slow);
  ASSERT_TRUE(b.is_ok() && b->chosen);
  EXPECT_EQ(b->chosen->policy.precision, "bf16");
  EXPECT_DOUBLE_EQ(b->chosen->cost.step_seconds, plain->chosen->cost.step_seconds);

  // An explicit precision takes its own correction too.
  SearchRequest only_bf16 = bf16_slow;
  only_bf16.precision = "bf16";
  Result<SearchResult> c = search_plan(only_bf16);
  ASSERT_TRUE(c.is_ok() && c->chosen);
  d.correction = slow;
  EXPECT_DOUBLE_EQ(c->chosen->cost.step_seconds,
                   estimate_step(r.config, *c->chosen_plan, d).step_seconds);
  EXPECT_GT(c->chosen->cost.step_seconds, plain->chosen->cost.step_seconds);
}

// Two processes asking for the calibration at once (two ranks of `mpirun -np 2` on one machine):
// one measures, the other waits for it and loads its figures.
TEST(CalibrationLock, TwoProcessesMeasureOnce) {
  const fs::path dir = fresh_dir("headroom_calibration_lock");
  const std::string path = (dir / "calibration.json").string();
  pid_t kids[2];
  for (int i = 0; i < 2; i++) {
    kids[i] = ::fork();
    ASSERT_GE(kids[i], 0);
    if (kids[i] == 0) {
      const std::string log = (dir / ("log" + std::to_string(i))).string();
      std::ofstream out(log);
      Result<Calibration> cal = load_or_calibrate(
          path, [&](const std::string& line) { out << line << "\n"
                                                   << std::flush; },
          CalibrationOptions{.quick = true});
      ::_exit(cal.is_ok() ? 0 : 1);
    }
  }
  for (pid_t k : kids) {
    int status = 0;
    ASSERT_EQ(::waitpid(k, &status, 0), k);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  int measured = 0;
  for (int i = 0; i < 2; i++) {
    std::ifstream in(dir / ("log" + std::to_string(i)));
    std::string line;
    while (std::getline(in, line)) measured += line.rfind("calibrating ", 0) == 0;
  }
  EXPECT_EQ(measured, 1);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom::plan
