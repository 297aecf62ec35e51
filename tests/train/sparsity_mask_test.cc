// Training with a sparsity mask (docs/notes/pruning.md): pruned weights stay exact zeros through
// AdamW while the others train, from a pruned model (--sparsity-mask) or from a mask taken
// during the run (--prune-at); the mask is a planned buffer (measured = planned).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "model/prune.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace headroom::train {
namespace {

namespace fs = std::filesystem;

TrainOptions small_run(const model::TransformerConfig& c, const std::string& data) {
  TrainOptions o = test::loss_curve_options(c, data, model::Precision::kFp32);
  o.seq = 32;
  o.micro_batch = 2;
  o.steps = 20;
  o.warmup_steps = 2;
  return o;
}

// Writes a 2:4-pruned copy of `c`'s initialisation to a fresh directory; returns it, with the
// starting weights.
std::string pruned_model_dir(const model::TransformerConfig& c, const std::string& name,
                             std::vector<float>* start, model::SparsityMask* mask) {
  const model::ParamTable t = model::gpt2_param_table(c);
  start->assign(size_t(t.total_floats), 0.0f);
  model::gpt2_init_params(c, t, start->data(), 99);
  Result<model::SparsityMask> m = model::nm_mask(c, t, start->data(), 2, 4);
  EXPECT_TRUE(m.is_ok());
  *mask = *m;
  model::apply_mask(*mask, start->data(), t.total_floats);
  const fs::path dir = test::fresh_test_dir(name);
  EXPECT_TRUE(model::save_pretrained(dir.string(), c, t, start->data()).is_ok());
  return dir.string();
}

// Every masked weight is +0.0 exactly; every other prunable weight moved. Returns how many moved.
void expect_mask_held(const model::ParamTable& t, const model::SparsityMask& mask,
                      const std::vector<float>& start, const std::vector<float>& end) {
  ASSERT_EQ(end.size(), start.size());
  int64_t pruned = 0, kept = 0, moved = 0;
  for (size_t i : model::prunable_tensors(t)) {
    const model::ParamDesc& p = t.params[i];
    for (int64_t k = p.offset; k < p.offset + p.shape.numel(); k++) {
      if (!mask[size_t(k)]) {
        pruned++;
        uint32_t bits;
        std::memcpy(&bits, &end[size_t(k)], 4);
        ASSERT_EQ(bits, 0u) << p.name << " element " << k - p.offset << " = " << end[size_t(k)];
      } else {
        kept++;
        moved += end[size_t(k)] != start[size_t(k)];
      }
    }
  }
  EXPECT_GT(pruned, 0);
  EXPECT_GT(double(moved), 0.99 * double(kept)) << "the unpruned weights did not train";
}

TEST(SparsityMask, PrunedWeightsStayZeroThrough20AdamWSteps) {
  const std::string data = test::learnable_tokens(256, 40000, "mask20");
  const model::TransformerConfig configs[] = {test::gpt2_config(2, 64, 4, 256, 64),
                                              test::llama_config(2, 64, 4, 2, 256, 64, false)};
  for (const model::TransformerConfig& c : configs) {
    for (model::Precision prec : {model::Precision::kFp32, model::Precision::kBf16}) {
      SCOPED_TRACE(c.model_type + " " + std::string(model::precision_name(prec)));
      std::vector<float> start;
      model::SparsityMask mask;
      const std::string dir = pruned_model_dir(c, "mask20_" + c.model_type, &start, &mask);
      TrainOptions o = small_run(c, data);
      o.exec.precision = prec;
      o.sparsity_mask = dir;
      test::RunOutput r = test::run_collecting(o);
      ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
      ASSERT_EQ(r.steps.size(), 20u);
      EXPECT_LT(r.steps.back().loss, r.steps.front().loss);
      expect_mask_held(model::gpt2_param_table(c), mask, start, r.params);
      fs::remove_all(dir);
    }
  }
  fs::remove(data);
}

TEST(SparsityMask, PruneAtTakesTheMaskMidRunAndHoldsIt) {
  const std::string data = test::learnable_tokens(256, 40000, "pruneat");
  const model::TransformerConfig c = test::gpt2_config(2, 64, 4, 256, 64);
  const model::ParamTable t = model::gpt2_param_table(c);
  for (const char* method : {"2:4", "magnitude"}) {
    SCOPED_TRACE(method);
    TrainOptions o = small_run(c, data);
    o.prune.at_step = 6;
    Result<model::MaskSpec> spec = model::parse_mask_spec(method, "", 0.6, false, "--prune-method");
    ASSERT_TRUE(spec.is_ok());
    o.prune.spec = *spec;
    test::RunOutput r = test::run_collecting(o);
    ASSERT_TRUE(r.result.is_ok()) << r.result.status().to_string();
    ASSERT_EQ(r.steps.size(), 20u);
    ASSERT_EQ(r.steps[5].events.size(), 1u);
    EXPECT_NE(r.steps[5].events[0].find("pruned"), std::string::npos) << r.steps[5].events[0];
    const model::SparsityMask mask = model::mask_from_zeros(t, r.params.data());
    const model::MaskCounts mc = model::count_mask(t, mask);
    if (std::string(method) == "2:4") {
      EXPECT_EQ(mc.pruned * 2, mc.prunable);
      Result<model::SparsityMask> again = model::nm_mask(c, t, r.params.data(), 2, 4);
      ASSERT_TRUE(again.is_ok());
      EXPECT_EQ(*again, mask) << "the 2:4 pattern broke after pruning";
    } else {
      EXPECT_EQ(mc.pruned, std::llround(0.6 * double(mc.prunable)));
    }
    // Steps after the pruning keep training the rest.
    EXPECT_LT(r.steps.back().loss, r.steps[6].loss);
  }
  fs::remove(data);
}

TEST(SparsityMask, TheMaskIsAPlannedBufferOfOneBytePerWeight) {
  const std::string data = test::learnable_tokens(256, 40000, "maskplan");
  const model::TransformerConfig c = test::llama_config(2, 64, 4, 2, 256, 64, true);
  for (model::Precision prec : {model::Precision::kFp32, model::Precision::kBf16}) {
    TrainOptions o = small_run(c, data);
    o.exec.precision = prec;
    o.steps = 4;
    o.prune.at_step = 2;
    uint64_t planned = 0, measured = 0;
    TrainCallbacks cb;
    cb.on_step = [&](const StepStats& s) {
      planned = s.planned_peak_bytes;
      measured = s.device_bytes_peak;
    };
    Result<TrainResult> r = run_training(o, cb);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    EXPECT_EQ(measured, planned);
    plan::Policy p{o.micro_batch, 1, o.seq, std::string(model::precision_name(prec)), o.exec};
    Result<plan::MemoryPlan> dense = plan::plan_training_memory(c, p);
    p.sparsity_mask = true;
    Result<plan::MemoryPlan> masked = plan::plan_training_memory(c, p);
    ASSERT_TRUE(dense.is_ok() && masked.is_ok());
    EXPECT_EQ(masked->peak_bytes, planned);
    const plan::Region& m = masked->persistent.back();
    EXPECT_EQ(m.name, plan::kSparsityMaskRegion);
    EXPECT_EQ(m.buffers.at(0).bytes(), uint64_t(masked->params.total_floats));
    EXPECT_EQ(masked->peak_bytes - dense->peak_bytes, m.layout.size);
    EXPECT_EQ(r->memory.allocations, masked->persistent.size() + 1);
  }
  fs::remove(data);
}

TEST(SparsityMask, RefusesWhatItCannotHold) {
  const std::string data = test::learnable_tokens(256, 20000, "maskbad");
  const model::TransformerConfig c = test::gpt2_config(2, 64, 4, 256, 64);
  auto refused = [&](const TrainOptions& o, const std::string& part) {
    Result<TrainResult> r = run_training(o, {});
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().to_string().find(part), std::string::npos) << r.status().to_string();
  };
  TrainOptions o = small_run(c, data);
  o.prune.at_step = 20;
  refused(o, "--prune-at 20");
  o.prune.at_step = 3;
  o.offload_optimizer = true;
  refused(o, "--zero 0 without --offload-optimizer");
  std::vector<float> start;
  model::SparsityMask mask;
  const std::string dir =
      pruned_model_dir(test::gpt2_config(2, 32, 4, 256, 64), "maskbad", &start, &mask);
  TrainOptions other = small_run(c, data);
  other.sparsity_mask = dir;
  refused(other, "is not --model");
  other.prune.at_step = 3;
  refused(other, "give one");
  fs::remove_all(dir);
  fs::remove(data);
}

}  // namespace
}  // namespace headroom::train
