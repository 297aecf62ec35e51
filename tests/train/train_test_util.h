// What the trainer's tests share (tests/train/*_test.cc, tests/dist/trainer_dp_test.cc): small
// models, a fresh directory per test with a random or a learnable token file, a training run that
// collects every step's stats and the final weights, and one micro-batch's forward and backward
// from a planned arena poisoned with NaN bytes.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/kernels.h"
#include "data/token_file.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/offload_copier.h"
#include "plan/memory_plan.h"
#include "train/trainer.h"

namespace headroom::train::test {

inline model::Gpt2Config gpt2_config(int L, int C, int NH, int V, int P) {
  model::Gpt2Config c;
  c.n_layer = L;
  c.n_embd = C;
  c.n_head = NH;
  c.vocab_size = V;
  c.n_positions = P;
  return c;
}

// A Llama-family configuration (RMSNorm, RoPE, SwiGLU of width 11 C / 4) with NKV key/value
// heads and a tied or untied head.
inline model::TransformerConfig llama_config(int L, int C, int NH, int NKV, int V, int P,
                                             bool tied) {
  model::TransformerConfig c = gpt2_config(L, C, NH, V, P);
  c.model_type = "llama";
  c.norm = model::NormKind::kRmsNorm;
  c.positions = model::PositionKind::kRope;
  c.mlp = model::MlpKind::kSwiGlu;
  c.n_kv_head = NKV;
  c.intermediate_size = 11 * C / 4;
  c.qkv_bias = c.other_bias = false;
  c.tied_head = tied;
  return c;
}

// 3 layers, 64 wide, 4 heads, a 300-token vocabulary, 64 positions: the mixed-precision tests'.
inline model::Gpt2Config small_config() { return gpt2_config(3, 64, 4, 300, 64); }

// 2 layers, 64 wide, 4 heads, a 211-token vocabulary, 32 positions: a step takes milliseconds.
inline model::Gpt2Config tiny_config() {
  model::Gpt2Config c;
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.vocab_size = 211;
  c.n_positions = 32;
  return c;
}

// A fresh, empty directory for the running test: TempDir()/<prefix>_<pid>_<test name>.
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(testing::TempDir()) /
                       (prefix + "_" + std::to_string(getpid()) + "_" +
                        testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Writes `count` tokens drawn uniformly below 210 from `seed` to `path`, as one document of
// tiny_config()'s vocabulary (211 tokens, 210 the end-of-text token). Fails the test on error.
inline void write_random_tokens(const std::string& path, uint32_t seed, size_t count) {
  std::mt19937 rng(seed);
  std::vector<int32_t> toks(count);
  for (auto& t : toks) t = int32_t(rng() % 210u);
  ASSERT_TRUE(data::write_token_file(path, toks, 211, 210, 1).is_ok()) << path;
}

// A test with a fresh directory (fresh_test_dir, prefixed with the suite's name) holding
// `data.tok`, 30,000 random tokens of tiny_config()'s vocabulary (write_random_tokens, seed 5),
// removed afterwards.
class RandomTokensTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_test_dir(std::string("headroom_") +
                          testing::UnitTest::GetInstance()->current_test_info()->test_suite_name());
    data_ = (dir_ / "data.tok").string();
    write_random_tokens(data_, 5, 30000);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string data_;
};

// A run's outcome: the result, every step's stats (on_step) and the final weights (on_finish;
// empty when the run failed or was stopped early).
struct RunOutput {
  Result<TrainResult> result = Status::internal("not run");
  std::vector<StepStats> steps;
  std::vector<float> params;
};

// Runs `o` collecting a RunOutput. `on_step` runs after each step is collected (e.g. to edit a
// budget file); `should_stop` ends the run early as an interruption would.
inline RunOutput run_collecting(const TrainOptions& o,
                                std::function<void(const StepStats&)> on_step = nullptr,
                                std::function<bool(const StepStats&)> should_stop = nullptr) {
  RunOutput r;
  TrainCallbacks cb;
  cb.on_step = [&](const StepStats& s) {
    r.steps.push_back(s);
    if (on_step) on_step(s);
  };
  cb.should_stop = std::move(should_stop);
  cb.on_finish = [&](const model::Gpt2Config& c, const float* p, memory::MemoryResource*) {
    r.params.assign(p, p + model::gpt2_param_table(c).total_floats);
    return Status::ok();
  };
  r.result = run_training(o, cb);
  return r;
}

// Tokens with structure to learn, written to TempDir()/<name>_<pid>.tok: each next token is a
// function of the current one, with some noise, in documents of varying length (vocab - 1 ends
// a document). Returns the path.
inline std::string learnable_tokens(int vocab, int n, const std::string& name) {
  namespace fs = std::filesystem;
  std::string path =
      (fs::path(testing::TempDir()) / (name + "_" + std::to_string(getpid()) + ".tok")).string();
  std::mt19937 rng(9);
  std::vector<int32_t> toks(static_cast<size_t>(n));
  int32_t cur = 1;
  int docs = 0;
  for (int i = 0; i < n; i++) {
    if (rng() % 97 == 0) {
      toks[size_t(i)] = vocab - 1;  // end of document
      docs++;
      continue;
    }
    cur = rng() % 8 == 0 ? int32_t(rng() % 200) : (cur * 7 + 3) % 200;
    toks[size_t(i)] = cur;
  }
  EXPECT_TRUE(data::write_token_file(path, toks, vocab, vocab - 1, docs + 1).is_ok());
  return path;
}

// The loss-curve tests' run: gpt2-tiny's blocks (`cfg`) on `data`, 50 steps of 4 x 64 tokens in
// `precision`, with the fused LM head.
inline TrainOptions loss_curve_options(const model::Gpt2Config& cfg, const std::string& data,
                                       model::Precision precision) {
  TrainOptions o;
  o.config = cfg;
  o.model_name = "gpt2-tiny";
  o.data = data;
  o.seq = 64;
  o.micro_batch = 4;
  o.accumulation = 1;
  o.exec.head_chunk = 128;
  o.exec.precision = precision;
  o.steps = 50;
  o.warmup_steps = 5;
  o.adamw.lr = 1e-3f;
  o.device_memory = uint64_t(2) << 30;
  o.val_fraction = 0;
  return o;
}

struct StepResult {
  double loss = 0;
  std::vector<float> grads;  // unscaled
  int head_columns = 0;  // columns the head's forward GEMM computed (Gpt2::head_forward_columns)
};

// GPT-2 `c` planned for micro-batch B, accumulation K and length T under `exec`, set up as the
// trainer sets it up: parameters initialised with `seed`, gradients zero, the bf16 copy bound for
// bf16, and the planned step arena filled with NaN bytes (a read of memory the plan gave to another
// buffer shows). Activations are bound by bind() (the trainer binds them per micro-batch). The
// model points into this object, so it stays where make_planned_model built it.
struct PlannedModel {
  plan::MemoryPlan mp;
  std::vector<float> params, grads;
  std::vector<bf16_t> copy;
  memory::HostResource host;
  std::optional<memory::Arena> arena;
  std::optional<model::Gpt2> net;
  void bind(int B, int T) { net->bind_activations(&*arena, &mp.activations, B, T); }
};

// Null (with a test failure) if the plan or the arena cannot be made.
inline std::unique_ptr<PlannedModel> make_planned_model(const model::Gpt2Config& c,
                                                        model::ExecOptions exec, int B, int K,
                                                        int T, uint64_t seed) {
  const std::string precision(model::precision_name(exec.precision));
  Result<plan::MemoryPlan> mp =
      plan::plan_training_memory(c, plan::Policy{B, K, T, precision, exec});
  EXPECT_TRUE(mp.is_ok()) << mp.status().to_string();
  if (!mp.is_ok()) return nullptr;
  auto m = std::make_unique<PlannedModel>();
  m->mp = std::move(*mp);
  const model::ParamTable& t = m->mp.params;
  m->params.resize(size_t(t.total_floats));
  m->grads.assign(size_t(t.total_floats), 0.0f);
  model::gpt2_init_params(c, t, m->params.data(), seed);
  if (exec.precision == model::Precision::kBf16) {
    m->copy.resize(size_t(t.total_floats));
    cpu::cast_to_bf16(m->copy.data(), m->params.data(), t.total_floats);
  }
  Result<memory::Arena> arena = memory::Arena::create(
      &m->host, m->mp.step.buffers, m->mp.step.layout, memory::Category::kActivations);
  EXPECT_TRUE(arena.is_ok()) << arena.status().to_string();
  if (!arena.is_ok()) return nullptr;
  m->arena.emplace(std::move(*arena));
  std::memset(m->arena->base(), 0xff, m->arena->size());
  m->net.emplace(c, &t);
  m->net->bind_params(m->params.data(), m->grads.data(),
                      m->copy.empty() ? nullptr : m->copy.data());
  return m;
}

// Forward and backward of one micro-batch under `exec` (a bf16 weight copy bound for bf16) with
// the loss gradient scaled by `scale` (then the gradients unscaled, as the optimizer does), from
// the planned arena poisoned with NaN bytes (a read of memory the plan gave to another buffer
// shows).
inline StepResult one_step(const model::Gpt2Config& c, model::ExecOptions exec, int B, int T,
                           float scale = 1.0f) {
  StepResult r;
  std::unique_ptr<PlannedModel> m = make_planned_model(c, exec, B, 1, T, 21);
  if (!m) return r;
  m->bind(B, T);
  model::Gpt2& net = *m->net;
  const std::vector<float>& params = m->params;
  const model::ParamTable& t = m->mp.params;
  std::mt19937 rng(5);
  std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
  for (int i = 0; i < B * T; i++) {
    in[size_t(i)] = int32_t(rng() % uint32_t(c.vocab_size));
    tg[size_t(i)] = i % 11 == 3 ? -1 : int32_t(rng() % uint32_t(c.vocab_size));
  }
  int64_t valid = 0;
  r.loss = net.forward(in.data(), tg.data(), &valid) / double(valid);
  const float* wte = params.data() + t.params[0].offset;
  r.head_columns = exec.precision == model::Precision::kBf16 ? net.head_forward_columns<bf16_t>(wte)
                                                             : net.head_forward_columns<float>(wte);
  net.backward(in.data(), tg.data(), scale / float(valid));
  r.grads = m->grads;
  for (float& g : r.grads) g /= scale;
  return r;
}

// Cosine similarity and the largest difference relative to the largest gradient of b.
inline std::pair<double, double> compare(const std::vector<float>& a, const std::vector<float>& b) {
  double dot = 0, na = 0, nb = 0, worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); i++) {
    dot += double(a[i]) * b[i];
    na += double(a[i]) * a[i];
    nb += double(b[i]) * b[i];
    worst = std::max(worst, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return {dot / std::sqrt(na * nb), worst / scale};
}

// One micro-batch of plan `mp` (fp32) with its step buffers at `layout`, from an arena poisoned
// with NaN bytes (the offload regions too, bound with `copier` when the plan has them): the
// gradients and the summed loss.
inline std::pair<std::vector<float>, double> one_micro_batch(
    const model::Gpt2Config& c, const plan::MemoryPlan& mp, const memory::Layout& layout,
    model::OffloadCopier* copier = nullptr) {
  memory::HostResource host;
  const model::ParamTable& t = mp.params;
  std::vector<float> params(size_t(t.total_floats)), grads(size_t(t.total_floats), 0.0f);
  model::gpt2_init_params(c, t, params.data(), 3);
  auto arena =
      memory::Arena::create(&host, mp.step.buffers, layout, memory::Category::kActivations);
  EXPECT_TRUE(arena.is_ok());
  std::memset(arena->base(), 0xff, arena->size());
  std::optional<memory::Arena> tier;
  if (!mp.offload.empty()) {
    auto a = memory::Arena::create(&host, mp.offload[0].buffers, mp.offload[0].layout,
                                   memory::Category::kOffload);
    EXPECT_TRUE(a.is_ok());
    std::memset(a->base(), 0xff, a->size());
    tier.emplace(std::move(*a));
  }
  model::Gpt2 net(c, &t);
  net.bind_params(params.data(), grads.data());
  const int B = mp.policy.micro_batch, T = mp.policy.seq;
  net.bind_activations(&*arena, &mp.activations, B, T);
  if (tier) net.bind_offload(&*tier, copier);
  std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
  for (int i = 0; i < B * T; i++) {
    in[size_t(i)] = (i * 7 + 3) % c.vocab_size;
    tg[size_t(i)] = (i * 13 + 1) % c.vocab_size;
  }
  int64_t valid = 0;
  double loss = net.forward(in.data(), tg.data(), &valid);
  net.backward(in.data(), tg.data(), 1.0f / float(valid));
  return {grads, loss};
}

}  // namespace headroom::train::test
