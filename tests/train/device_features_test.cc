// Sparsity masks (--sparsity-mask, --prune-at), distillation (--teacher) and bucketed batching on
// a device the host cannot address (docs/notes/device-trainer.md), run on the fenced device
// (docs/notes/fenced-device.md: any host touch of a planned region dies with SIGSEGV) and compared
// with the same run on the CPU bit for bit: every step's loss, gradient norm and validation loss,
// the final weights, every file saved (model and checkpoints, optimizer state included), and the
// measured peak the planned one at every step.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/fenced/fenced_ops.h"
#include "data/token_file.h"
#include "fenced_test_util.h"
#include "model/prune.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using train::test::RunOutput;

using train::test::read_tree;

class DeviceFeatures : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = train::test::fresh_test_dir("headroom_fenced_features");
    data_ = (dir_ / "docs.tok").string();
    // Documents of 1..40 tokens (some longer than T = 16), each ended by the eot (210): packed
    // runs read them as one stream, bucketed runs as documents.
    std::mt19937 rng(17);
    std::vector<int32_t> toks;
    int docs = 0;
    while (toks.size() < 30000) {
      const int len = 1 + int(rng() % 40);
      for (int i = 0; i < len; i++) toks.push_back(int32_t(rng() % 210u));
      toks.push_back(210);
      docs++;
    }
    ASSERT_TRUE(data::write_token_file(data_, toks, 211, 210, docs).is_ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  train::TrainOptions options(model::Precision precision) {
    train::TrainOptions o;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.steps = 4;
    o.warmup_steps = 2;
    o.device_memory = uint64_t(1) << 30;
    o.eval_every = 2;  // validation after steps 2 and 4
    o.eval_batches = 2;
    o.eval_at_start = true;
    o.save_every = 2;  // checkpoints after steps 2 and 4
    o.exec.precision = precision;
    return o;
  }

  // `o` on the fenced device, fenced from before the first allocation; every block is returned
  // by the end.
  RunOutput run_fenced(train::TrainOptions o,
                       std::function<bool(const train::StepStats&)> stop = nullptr) {
    return train::test::run_fenced(std::move(o), nullptr, std::move(stop));
  }

  // The two runs' every step alike, bit for bit, and the final weights.
  static void expect_same(const RunOutput& a, const RunOutput& b) {
    train::test::expect_same_bits(a, b);
    for (size_t i = 0; i < a.steps.size() && i < b.steps.size(); i++) {
      EXPECT_EQ(a.steps[i].micro_batches, b.steps[i].micro_batches) << "step " << a.steps[i].step;
      EXPECT_EQ(a.steps[i].events, b.steps[i].events) << "step " << a.steps[i].step;
    }
  }

  // `o` on the CPU (into --out DIR/cpu-TAG) and on the fenced device (DIR/fenced-TAG): the same
  // steps, weights and files, the measured peak the planned one on every step of both. Returns
  // {cpu, fenced}.
  std::pair<RunOutput, RunOutput> compare(train::TrainOptions o, const std::string& tag) {
    o.out_dir = (dir_ / ("cpu-" + tag)).string();
    RunOutput cpu = train::test::run_collecting(o);
    EXPECT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
    o.out_dir = (dir_ / ("fenced-" + tag)).string();
    RunOutput dev = run_fenced(o);
    EXPECT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
    if (!cpu.result.is_ok() || !dev.result.is_ok()) return {cpu, dev};
    EXPECT_EQ(dev.steps.size(), size_t(o.steps));
    expect_same(dev, cpu);
    EXPECT_EQ(dev.result->initial_val_loss, cpu.result->initial_val_loss);
    EXPECT_TRUE(dev.result->initial_val_loss.has_value());
    EXPECT_EQ(dev.result->final_val_loss, cpu.result->final_val_loss);
    EXPECT_EQ(dev.result->device_bytes_peak, dev.result->planned_peak_bytes);
    EXPECT_EQ(cpu.result->device_bytes_peak, cpu.result->planned_peak_bytes);
    EXPECT_EQ(dev.result->planned_peak_bytes, cpu.result->planned_peak_bytes);
    for (const RunOutput* r : {&cpu, &dev}) {
      for (const train::StepStats& s : r->steps)
        EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
    }
    const std::map<std::string, std::string> cpu_files = read_tree(dir_ / ("cpu-" + tag));
    const std::map<std::string, std::string> dev_files = read_tree(dir_ / ("fenced-" + tag));
    EXPECT_TRUE(cpu_files.count("model.safetensors"));
    EXPECT_TRUE(cpu_files.count("checkpoints/step-000002/optimizer.safetensors"));
    train::test::expect_same_files(cpu_files, dev_files);
    return {cpu, dev};
  }

  fs::path dir_;
  std::string data_;
};

// Every weight the mask prunes is +0.0 exactly in `params`; returns how many.
int64_t expect_pruned_zeros(const model::ParamTable& t, const model::SparsityMask& mask,
                            const std::vector<float>& params) {
  int64_t pruned = 0;
  EXPECT_EQ(params.size(), mask.size());
  for (size_t i = 0; i < mask.size() && i < params.size(); i++) {
    if (mask[i]) continue;
    pruned++;
    uint32_t bits;
    std::memcpy(&bits, &params[i], 4);
    if (bits != 0u) {
      ADD_FAILURE() << "pruned weight " << i << " = " << params[i];
      break;
    }
  }
  (void)t;
  return pruned;
}

// --sparsity-mask DIR: the run starts from a 2:4-pruned model, whose zeros are the mask (built on
// the host from a copy of the device's weights, copied over, applied by the op on the device to
// the gradients and the updated weights). fp32 and bf16 (the bf16 copy of masked weights).
TEST_F(DeviceFeatures, SparsityMaskMatchesTheCpu) {
  const model::Gpt2Config c = train::test::tiny_config();
  const model::ParamTable t = model::gpt2_param_table(c);
  std::vector<float> start(size_t(t.total_floats), 0.0f);
  model::gpt2_init_params(c, t, start.data(), 99);
  Result<model::SparsityMask> mask = model::nm_mask(c, t, start.data(), 2, 4);
  ASSERT_TRUE(mask.is_ok()) << mask.status().to_string();
  model::apply_mask(*mask, start.data(), t.total_floats);
  const std::string pruned = (dir_ / "pruned").string();
  ASSERT_TRUE(model::save_pretrained(pruned, c, t, start.data()).is_ok());
  for (model::Precision p : {model::Precision::kFp32, model::Precision::kBf16}) {
    const std::string tag = std::string("mask-") + std::string(model::precision_name(p));
    SCOPED_TRACE(tag);
    train::TrainOptions o = options(p);
    o.sparsity_mask = pruned;
    if (p == model::Precision::kBf16) o.exec.head_chunk = 8;
    const auto [cpu, dev] = compare(o, tag);
    ASSERT_TRUE(dev.result.is_ok());
    // The pruned weights stayed exact zeros on the device; the others trained.
    EXPECT_GT(expect_pruned_zeros(t, *mask, dev.params), 0);
    int64_t moved = 0;
    for (size_t i = 0; i < start.size(); i++) moved += (*mask)[i] && dev.params[i] != start[i];
    EXPECT_GT(moved, t.num_parameters / 4);
  }
}

// --prune-at 2 of 4 steps: after step 2's update the mask is taken from the device's weights (a
// host copy), the weights and both AdamW moments on the device are masked, the bf16 copy
// refreshed; then the mask holds. 2:4 in fp32, magnitude 60% in bf16. A run cut at step 2 (its
// checkpoint taken after the pruning) and resumed on the device, where the mask is rebuilt from
// the checkpoint's zeros, equals the uninterrupted run.
TEST_F(DeviceFeatures, PruneAtMidRunMatchesTheCpu) {
  const model::Gpt2Config c = train::test::tiny_config();
  const model::ParamTable t = model::gpt2_param_table(c);
  struct Case {
    const char* method;
    model::Precision precision;
  };
  for (const Case& k :
       {Case{"2:4", model::Precision::kFp32}, Case{"magnitude", model::Precision::kBf16}}) {
    const std::string tag = std::string("prune-") + std::string(model::precision_name(k.precision));
    SCOPED_TRACE(tag + " " + k.method);
    train::TrainOptions o = options(k.precision);
    o.prune.at_step = 2;
    Result<model::MaskSpec> spec = model::parse_mask_spec(k.method, "", 0.6, false, "--prune");
    ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
    o.prune.spec = *spec;
    const auto [cpu, dev] = compare(o, tag);
    ASSERT_TRUE(dev.result.is_ok());
    ASSERT_EQ(dev.steps.size(), 4u);
    ASSERT_EQ(dev.steps[1].events.size(), 1u);
    EXPECT_NE(dev.steps[1].events[0].find("pruned"), std::string::npos) << dev.steps[1].events[0];
    const model::SparsityMask mask = model::mask_from_zeros(t, dev.params.data());
    const model::MaskCounts mc = model::count_mask(t, mask);
    if (k.precision == model::Precision::kFp32) {
      EXPECT_EQ(mc.pruned * 2, mc.prunable);
      Result<model::SparsityMask> again = model::nm_mask(c, t, dev.params.data(), 2, 4);
      ASSERT_TRUE(again.is_ok());
      EXPECT_EQ(*again, mask) << "the 2:4 pattern broke on the device after pruning";
    } else {
      EXPECT_EQ(mc.pruned, std::llround(0.6 * double(mc.prunable)));
    }
    // The mask taken at step 2 held through steps 3 and 4: the zeros of step 2's checkpoint are
    // zeros at the end.
    const fs::path ck2 = dir_ / ("fenced-" + tag) / "checkpoints/step-000002";
    std::vector<float> w2(size_t(t.total_floats));
    ASSERT_TRUE(model::load_pretrained(ck2.string(), t, w2.data()).is_ok());
    const model::SparsityMask at2 = model::mask_from_zeros(t, w2.data());
    EXPECT_EQ(model::count_mask(t, at2).pruned, mc.pruned);
    EXPECT_EQ(expect_pruned_zeros(t, at2, dev.params), mc.pruned);
    // AdamW's moments were masked on the device at the pruning: zeros in step 2's checkpoint.
    Result<model::SafetensorsFile> opt =
        model::SafetensorsFile::open((ck2 / "optimizer.safetensors").string());
    ASSERT_TRUE(opt.is_ok()) << opt.status().to_string();
    for (const char* name : {"adam_m", "adam_v"}) {
      const model::SafetensorsTensor* m = opt->find(name);
      ASSERT_NE(m, nullptr) << name;
      std::vector<float> moment(m->bytes / sizeof(float));
      std::memcpy(moment.data(), m->data, m->bytes);
      EXPECT_EQ(expect_pruned_zeros(t, at2, moment), mc.pruned) << name;
    }

    // Cut at step 2 and resumed on the device: the uninterrupted run's steps and weights.
    train::TrainOptions a = o;
    a.out_dir = (dir_ / ("cut-" + tag)).string();
    const RunOutput first = run_fenced(a, [](const train::StepStats& s) { return s.step == 2; });
    ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
    train::TrainOptions b = a;
    b.eval_at_start = false;
    b.resume = a.out_dir;
    const RunOutput second = run_fenced(b);
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    ASSERT_EQ(first.steps.size(), 2u);
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, dev);
  }
}

// --teacher: the teacher's fp32 weights read on the host and copied into their planned region,
// its forward run through the device's ops into its part of the step region, the fused KD head
// reading both models there. Students fp32 and bf16; teachers wider and deeper, computing in fp32
// and in bf16; a Llama student.
TEST_F(DeviceFeatures, DistillationMatchesTheCpu) {
  const model::Gpt2Config teacher = train::test::gpt2_config(3, 96, 6, 211, 32);
  const model::ParamTable tt = model::gpt2_param_table(teacher);
  std::vector<float> tw(size_t(tt.total_floats), 0.0f);
  model::gpt2_init_params(teacher, tt, tw.data(), 77);
  const std::string teacher_dir = (dir_ / "teacher").string();
  ASSERT_TRUE(model::save_pretrained(teacher_dir, teacher, tt, tw.data()).is_ok());
  struct Case {
    const char* name;
    model::TransformerConfig student;
    model::Precision precision, teacher_precision;
  };
  const Case cases[] = {
      {"fp32-student-fp32-teacher", train::test::tiny_config(), model::Precision::kFp32,
       model::Precision::kFp32},
      {"bf16-student-bf16-teacher", train::test::tiny_config(), model::Precision::kBf16,
       model::Precision::kBf16},
      {"bf16-student-fp32-teacher", train::test::tiny_config(), model::Precision::kBf16,
       model::Precision::kFp32},
      {"llama-fp32-student", train::test::llama_config(2, 64, 4, 2, 211, 32, false),
       model::Precision::kFp32, model::Precision::kFp32},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    train::TrainOptions o = options(k.precision);
    o.config = k.student;
    o.exec.head_chunk = 24;  // the KD head is the fused one; chunks that do not divide b x T
    o.exec.distill = model::Distill{{0.5f, 2.0f}, teacher, k.teacher_precision};
    o.teacher_dir = teacher_dir;
    const auto [cpu, dev] = compare(o, k.name);
    ASSERT_TRUE(dev.result.is_ok());
    EXPECT_GT(dev.result->memory.by_category[size_t(memory::Category::kTeacher)].peak, 0u);
  }
}

// --batching bucketed: each step one batch of documents (rows x length by bucket) uploaded from
// the loader's host slot, cut into micro-batches of their shape's plan; the valid-token count read
// from the host mirror; the step region re-bound per shape on the device. fp32 2 x 2 and bf16
// 2 x 3 (fused head, selective recompute), checkpoints and validation; and a resume on the device
// equal to the uninterrupted run.
TEST_F(DeviceFeatures, BucketedBatchingMatchesTheCpu) {
  struct Case {
    const char* name;
    model::Precision precision;
    int b, k, bucket, head_chunk;
    model::Recompute recompute;
  };
  const Case cases[] = {
      {"bucketed-fp32", model::Precision::kFp32, 2, 2, 8, 0, model::Recompute::kNone},
      {"bucketed-bf16", model::Precision::kBf16, 2, 3, 6, 8, model::Recompute::kSelective},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    train::TrainOptions o = options(k.precision);
    o.batching = data::Batching::kBucketed;
    o.bucket = k.bucket;
    o.micro_batch = k.b;
    o.accumulation = k.k;
    o.exec.head_chunk = k.head_chunk;
    if (k.recompute != model::Recompute::kNone)
      o.exec.recompute.assign(size_t(o.config.n_layer), k.recompute);
    const auto [cpu, dev] = compare(o, k.name);
    ASSERT_TRUE(dev.result.is_ok());
    // Several shapes ran, and steps with other numbers of micro-batches than k.
    EXPECT_GT(dev.result->shape_plans, 1u);
    EXPECT_EQ(dev.result->shape_plans, cpu.result->shape_plans);
    EXPECT_GT(dev.result->padding, 0.0);
    EXPECT_EQ(dev.result->padding, cpu.result->padding);

    train::TrainOptions a = o;
    a.out_dir = (dir_ / (std::string("cut-") + k.name)).string();
    const RunOutput first = run_fenced(a, [](const train::StepStats& s) { return s.step == 2; });
    ASSERT_TRUE(first.result.is_ok()) << first.result.status().to_string();
    train::TrainOptions b = a;
    b.eval_at_start = false;
    b.resume = a.out_dir;
    const RunOutput second = run_fenced(b);
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    ASSERT_EQ(first.steps.size(), 2u);
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, dev);
  }
}

}  // namespace
}  // namespace headroom
