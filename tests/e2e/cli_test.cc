// End-to-end tests of the headroom executable: real runs, real files, exit codes and messages.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "e2e_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

using e2e::Outcome;
using e2e::run;

class Cli : public e2e::TempDirTest {};

TEST_F(Cli, VersionAndHelp) {
  Outcome v = run("--version");
  EXPECT_EQ(v.code, 0);
  EXPECT_NE(v.out.find("headroom"), std::string::npos);
  for (const char* cmd : {"train", "generate", "prepare"}) {
    Outcome h = run(std::string(cmd) + " --help");
    EXPECT_EQ(h.code, 0) << cmd;
    EXPECT_NE(h.out.find("Usage"), std::string::npos) << cmd;
  }
  EXPECT_NE(run("").code, 0);
  EXPECT_NE(run("train --model gpt2-tiny --no-such-flag").code, 0);
}

TEST_F(Cli, PrepareRejectsEmptyAndBinaryInputs) {
  write("empty.txt", "");
  Outcome e = run("prepare " + path("empty.txt") + " --out " + path("e.tokens"));
  EXPECT_NE(e.code, 0);
  EXPECT_NE(e.out.find("empty"), std::string::npos) << e.out;
  EXPECT_FALSE(fs::exists(path("e.tokens")));

  write("blob.bin", std::string("\x7f"
                                "ELF\0\0\0\x01\x02\x03",
                                11));
  Outcome b = run("prepare " + path("blob.bin") + " --out " + path("b.tokens"));
  EXPECT_NE(b.code, 0);
  EXPECT_NE(b.out.find("binary"), std::string::npos) << b.out;
  EXPECT_FALSE(fs::exists(path("b.tokens")));

  Outcome m = run("prepare " + path("missing.txt") + " --out " + path("m.tokens"));
  EXPECT_NE(m.code, 0);
  EXPECT_NE(m.out.find("missing.txt"), std::string::npos) << m.out;
}

TEST_F(Cli, TrainLowersTheLossThenGenerates) {
  std::string data = corpus();
  std::string log = path("log.jsonl");
  Outcome r = run("train --model gpt2-tiny --data " + data +
                  " --seq 32 --batch 4 --steps 30 --lr 3e-3 --sample-tokens 8 --out " +
                  path("model") + " --log-json " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f(log);
  std::string line;
  std::vector<nlohmann::json> steps;
  while (std::getline(f, line)) steps.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(steps.size(), 30u);
  for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms",
                          "data_wait_ms", "device_bytes_in_use", "device_bytes_peak",
                          "planned_peak_bytes", "micro_batch", "accumulation"}) {
    EXPECT_TRUE(steps[0].contains(key)) << key;
  }
  double first = steps[0]["loss"], last = steps.back()["loss"];
  EXPECT_GT(first, 10.0);  // ln(50257) = 10.8 at initialisation
  EXPECT_LT(last, first - 2.0) << r.out;
  EXPECT_TRUE(fs::exists(path("model") + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(path("model") + "/config.json"));

  Outcome g = run("generate --model-dir " + path("model") +
                  " --prompt 'The computer' --max-new-tokens 5 --json");
  ASSERT_EQ(g.code, 0) << g.out;
  auto j = nlohmann::json::parse(g.out);
  EXPECT_EQ(j["prompt"], "The computer");
  EXPECT_GE(j["tokens"].size(), 1u);
}

TEST_F(Cli, ClearErrorsForBadInput) {
  Outcome m = run("train --model gpt2-nano --steps 1");
  EXPECT_EQ(m.code, 1);
  EXPECT_NE(m.out.find("gpt2-nano"), std::string::npos) << m.out;

  write("bad_config.json", R"({"n_layer": 2, "n_head": 3, "n_embd": 64, "vocab_size": 100,
                                "n_positions": 32})");
  Outcome c = run("train --model " + path("bad_config.json") + " --steps 1");
  EXPECT_EQ(c.code, 1);
  EXPECT_NE(c.out.find("n_head"), std::string::npos) << c.out;

  write("missing_field.json", R"({"n_layer": 2, "n_head": 4, "n_embd": 64})");
  Outcome mf = run("train --model " + path("missing_field.json") + " --steps 1");
  EXPECT_EQ(mf.code, 1);
  EXPECT_NE(mf.out.find("vocab_size"), std::string::npos) << mf.out;

  std::string data = corpus();
  Outcome tiny = run("train --model gpt2-tiny --data " + data +
                     " --seq 32 --batch 4 --steps 1 --device-memory 8MiB");
  EXPECT_EQ(tiny.code, 1);
  EXPECT_NE(tiny.out.find("budget"), std::string::npos) << tiny.out;

  Outcome mem = run("train --model gpt2-tiny --data " + data + " --device-memory lots --steps 1");
  EXPECT_EQ(mem.code, 1);
  EXPECT_NE(mem.out.find("lots"), std::string::npos) << mem.out;

  Outcome seq = run("train --model gpt2-tiny --data " + data + " --seq 100000 --steps 1");
  EXPECT_EQ(seq.code, 1);
  EXPECT_NE(seq.out.find("--seq"), std::string::npos) << seq.out;

  // A token file cut short: the reader names expected and actual sizes.
  fs::copy_file(data, path("cut.tokens"));
  fs::resize_file(path("cut.tokens"), fs::file_size(data) - 3);
  Outcome cut =
      run("train --model gpt2-tiny --data " + path("cut.tokens") + " --seq 32 --batch 4 --steps 1");
  EXPECT_EQ(cut.code, 1);
  EXPECT_NE(cut.out.find("cut.tokens"), std::string::npos) << cut.out;
}

// A measurement knob with a bad value is an error naming it, not an uncaught exception.
TEST_F(Cli, BadMeasurementKnobsAreClearErrors) {
  struct Knob {
    const char *name, *value, *expected;
  };
  for (const Knob& k :
       {Knob{"HEADROOM_BF16_ATTENTION", "bogus", "expected auto, amx, avx512bf16 or widen"},
        Knob{"HEADROOM_BF16_WGRAD_TRANSPOSE", "yes", "expected 0 or 1"},
        Knob{"HEADROOM_BF16_GEMM", "amx-please", "expected auto (our AMX kernel"},
        Knob{"HEADROOM_GELU_TABLE", "on", "expected 0 or 1"}}) {
    SCOPED_TRACE(k.name);
    ::setenv(k.name, k.value, 1);
    Outcome r = run("bench --model gpt2-tiny --steps 1 --warmup 0 --precision bf16");
    ::unsetenv(k.name);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_NE(r.out.find(std::string(k.name) + "=" + k.value), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(k.expected), std::string::npos) << r.out;
  }
}

// bench --alternate runs successive steps with a per-call knob at its two values and reports
// each value's steps and the ratio of every two adjacent steps; a knob that is not read per call, a
// bad value or a malformed spec is a clear error before any work.
TEST_F(Cli, BenchAlternatesAKnobBetweenSteps) {
  Outcome r =
      run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 5 --warmup 1 --precision bf16 "
          "--peak-between-steps false --alternate HEADROOM_BF16_GEMM=onednn, --json");
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json j = e2e::json_of(r.out);
  ASSERT_TRUE(j.contains("alternate")) << r.out;
  const nlohmann::json& a = j["alternate"];
  EXPECT_EQ(a["variable"], "HEADROOM_BF16_GEMM");
  EXPECT_EQ(a["values"], nlohmann::json({"onednn", ""}));
  // Warm-up step 1 ran onednn; timed steps 2..6 ran unset, onednn, unset, onednn, unset.
  EXPECT_EQ(a["step_ms"][0].size(), 2u);
  EXPECT_EQ(a["step_ms"][1].size(), 3u);
  ASSERT_EQ(a["pair_ratios"].size(), 4u);  // (2,3), (3,4), (4,5), (5,6): each value first twice
  for (const auto& x : a["pair_ratios"]) EXPECT_GT(x.get<double>(), 0.0);
  EXPECT_EQ(a["step_ms"][0].size() + a["step_ms"][1].size(), j["step_ms"].size());
  EXPECT_GT(a["tokens_per_s"][0].get<double>(), 0.0);
  EXPECT_GT(a["tokens_per_s"][1].get<double>(), 0.0);

  for (const char* bad : {"HEADROOM_BF16_ATTENTION=amx,widen", "HEADROOM_BF16_GEMM=onednn,fast",
                          "HEADROOM_BF16_GEMM=onednn", "HEADROOM_BF16_WGRAD_TRANSPOSE=0,1,2",
                          "HEADROOM_GELU_TABLE=1,maybe"}) {
    Outcome e = run(std::string("bench --model gpt2-tiny --steps 2 --alternate ") + bad);
    EXPECT_EQ(e.code, 1) << bad << ": " << e.out;
    EXPECT_NE(e.out.find("--alternate"), std::string::npos) << e.out;
  }
}

// bench times calibrate's square GEMM after every timed step and quotes MFU against it as well
// as against the cached peak; --peak-between-steps false leaves the probe (and its keys) out.
TEST_F(Cli, BenchQuotesMfuAgainstThePeakTimedBetweenSteps) {
  Outcome r = run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 2 --warmup 1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json j = e2e::json_of(r.out);
  ASSERT_TRUE(j.contains("gemm_peak_in_run_samples")) << r.out;
  EXPECT_EQ(j["gemm_peak_in_run_samples"].size(), 2u);  // one per timed step
  for (const auto& x : j["gemm_peak_in_run_samples"]) EXPECT_GT(x.get<double>(), 0.0);
  EXPECT_EQ(j["gemm_peak_in_run"].get<std::string>().rfind("fp32 GEMM 2048^3", 0), 0u);
  const double peak = j["gemm_peak_in_run_flops_per_s"].get<double>();
  const double mfu = j["mfu_in_run"].get<double>();
  EXPECT_GT(peak, 0.0);
  EXPECT_TRUE(std::isfinite(mfu) && mfu > 0) << mfu;
  // Each step's own ratio is (its model FLOP/s) / (the probe after it), so their median lies
  // between the slowest step over the fastest probe and the fastest step over the slowest probe,
  // however much a loaded machine moves either (CI runs tests side by side).
  const double flops = j["flops_per_token"].get<double>() * 2 * 32;  // tokens per step
  double lo = 1e300, hi = 0, fastest = 1e300, slowest = 0;
  for (const auto& x : j["gemm_peak_in_run_samples"]) {
    lo = std::min(lo, x.get<double>());
    hi = std::max(hi, x.get<double>());
  }
  for (const auto& x : j["step_ms"]) {
    fastest = std::min(fastest, x.get<double>());
    slowest = std::max(slowest, x.get<double>());
  }
  EXPECT_GE(mfu, 0.999 * flops / (slowest / 1e3) / hi);
  EXPECT_LE(mfu, 1.001 * flops / (fastest / 1e3) / lo);

  Outcome off =
      run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 1 --warmup 0 --peak-between-steps "
          "false --json");
  ASSERT_EQ(off.code, 0) << off.out;
  nlohmann::json jo = e2e::json_of(off.out);
  EXPECT_FALSE(jo.contains("mfu_in_run"));
  EXPECT_TRUE(jo.contains("mfu"));
}

// --breakdown: wall and CPU time per kind of op, each no more than the step's own.
TEST_F(Cli, BenchBreakdownSplitsTheStepByKindInWallAndCpuTime) {
  Outcome r =
      run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 2 --warmup 1 --breakdown "
          "--peak-between-steps false --json");
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json j = e2e::json_of(r.out);
  ASSERT_TRUE(j.contains("breakdown_ms_per_step") && j.contains("breakdown_cpu_ms_per_step"))
      << r.out;
  const nlohmann::json& wall = j["breakdown_ms_per_step"];
  const nlohmann::json& cpu = j["breakdown_cpu_ms_per_step"];
  double mean_step = 0;
  for (const auto& x : j["step_ms"]) mean_step += x.get<double>() / double(j["step_ms"].size());
  double wall_sum = 0, cpu_sum = 0;
  for (const char* kind :
       {"gemm", "attention", "norm", "elementwise", "loss", "embedding", "optimizer"}) {
    SCOPED_TRACE(kind);
    ASSERT_TRUE(wall.contains(kind) && cpu.contains(kind));
    EXPECT_GE(wall[kind].get<double>(), 0.0);
    EXPECT_GE(cpu[kind].get<double>(), 0.0);
    wall_sum += wall[kind].get<double>();
    cpu_sum += cpu[kind].get<double>();
  }
  EXPECT_GT(wall["gemm"].get<double>(), 0.0);
  EXPECT_GT(cpu["gemm"].get<double>(), 0.0);
  EXPECT_LE(wall_sum, mean_step * 1.001 + 0.01);
  const double cpu_step = cpu["step"].get<double>();
  EXPECT_GT(cpu_step, 0.0);
  EXPECT_LE(cpu_sum, cpu_step * 1.001 + 0.01);

  Outcome text =
      run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 1 --warmup 0 --breakdown "
          "--peak-between-steps false");
  ASSERT_EQ(text.code, 0) << text.out;
  EXPECT_NE(text.out.find("CPU (all threads)"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("gemm"), std::string::npos) << text.out;
}

TEST_F(Cli, PlanAnswersWithJsonAndSweep) {
  Outcome r =
      run("plan --model gpt2 --device cpu --device-memory 4GiB --seq 256 --global-batch 64 "
          "--sweep --json");
  ASSERT_EQ(r.code, 0) << r.out;
  // Calibration may log to stderr on a first run; the JSON object is the last thing printed.
  auto j = e2e::json_of(r.out);
  const auto& c = j["chosen"];
  for (const char* key :
       {"micro_batch", "accumulation", "precision", "recompute", "offload", "zero", "peak_bytes",
        "lower_bound_bytes", "by_category", "predicted_tokens_per_s"}) {
    EXPECT_TRUE(c.contains(key)) << key;
  }
  EXPECT_LE(c["peak_bytes"].get<uint64_t>(), 4ull << 30);
  EXPECT_EQ(c["micro_batch"].get<int>() * c["accumulation"].get<int>(), 64);
  EXPECT_GT(j["max_micro_batch"].get<int>(), 0);
  EXPECT_GE(j["sweep"].size(), 2u);
  EXPECT_TRUE(j.contains("planning_ms"));
  EXPECT_TRUE(j.contains("candidates"));
  EXPECT_TRUE(j.contains("rejected"));
}

TEST_F(Cli, TrainWithAPlanFileMeasuresThePlannedPeak) {
  std::string data = corpus();
  Outcome p = run("plan --model gpt2-tiny --device-memory 1GiB --seq 64 --global-batch 8 --json");
  ASSERT_EQ(p.code, 0) << p.out;
  std::string json_text = e2e::json_text(p.out);
  write("plan.json", json_text);
  auto plan = nlohmann::json::parse(json_text);
  Outcome t = run("train --model gpt2-tiny --plan " + path("plan.json") + " --data " + data +
                  " --steps 2 --sample-tokens 0 --device-memory 1GiB --out " + path("m") +
                  " --log-json " + path("log.jsonl"));
  ASSERT_EQ(t.code, 0) << t.out;
  std::ifstream f(path("log.jsonl"));
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    auto s = nlohmann::json::parse(line);
    EXPECT_EQ(s["planned_peak_bytes"], plan["chosen"]["peak_bytes"]);
    EXPECT_EQ(s["device_bytes_peak"], plan["chosen"]["peak_bytes"]);
    EXPECT_EQ(s["micro_batch"], plan["chosen"]["micro_batch"]);
    n++;
  }
  EXPECT_EQ(n, 2);

  write("broken_plan.json", R"({"chosen": {"micro_batch": "eight"}})");
  Outcome b = run("train --model gpt2-tiny --plan " + path("broken_plan.json") + " --data " + data +
                  " --steps 1");
  EXPECT_EQ(b.code, 1);
  EXPECT_NE(b.out.find("chosen.micro_batch"), std::string::npos) << b.out;
}

TEST_F(Cli, TightBudgetTrainsWithRecomputationAndTheSameLoss) {
  // The same 3 steps in a roomy budget and in one where only recomputation (and the fused head)
  // fit: the planner changes the techniques, never the mathematics.
  std::string data = corpus();
  auto losses = [&](const std::string& budget, std::string* techniques) {
    // fp32 and no offload in both: this is about recomputation (bf16 and offload have their own
    // tests; with offload allowed, 170 MiB fits without recomputation).
    Outcome t = run("train --model gpt2-tiny --data " + data +
                    " --seq 64 --batch 16 --steps 3 --sample-tokens 0 " +
                    "--precision fp32 --offload-optimizer off --offload-activations off "
                    "--device-memory " +
                    budget + " --out " + path("m" + budget) + " --log-json " + path("l" + budget));
    EXPECT_EQ(t.code, 0) << t.out;
    // The line under "plan: ...": "  fp32, tiled attention, ...".
    auto at = t.out.find("\n  fp32, ");
    *techniques =
        at == std::string::npos ? "" : t.out.substr(at + 3, t.out.find('\n', at + 1) - at - 3);
    std::vector<double> v;
    std::ifstream f(path("l" + budget));
    std::string line;
    while (std::getline(f, line)) v.push_back(nlohmann::json::parse(line)["loss"]);
    return v;
  };
  std::string roomy_tech, tight_tech;
  std::vector<double> roomy = losses("2GiB", &roomy_tech);
  std::vector<double> tight = losses("170MiB", &tight_tech);
  EXPECT_NE(roomy_tech.find("recompute none"), std::string::npos) << roomy_tech;
  EXPECT_EQ(tight_tech.find("recompute none"), std::string::npos) << tight_tech;
  ASSERT_EQ(roomy.size(), 3u);
  ASSERT_EQ(tight.size(), 3u);
  for (size_t i = 0; i < 3; i++) {
    // Recomputation is bit-identical; the fused head's chunked sums differ by rounding only.
    EXPECT_NEAR(roomy[i], tight[i], 1e-4 * roomy[i]) << "step " << i;
  }
}

TEST_F(Cli, ProfileWritesTraceMemoryJsonAndReport) {
  std::string data = corpus();
  Outcome t = run("train --model gpt2-tiny --data " + data +
                  " --seq 32 --batch 4 --steps 3 --sample-tokens 0 --out " + path("m") +
                  " --profile " + path("prof"));
  ASSERT_EQ(t.code, 0) << t.out;
  std::ifstream tf(path("prof/trace.json"));
  auto trace = nlohmann::json::parse(tf);
  const auto& events = trace.is_object() ? trace["traceEvents"] : trace;
  std::set<std::string> phases, categories;
  for (const auto& e : events) {
    phases.insert(e["ph"].get<std::string>());
    if (e["ph"] == "X" || e["ph"] == "i") categories.insert(e["cat"].get<std::string>());
  }
  for (const char* ph : {"X", "C", "M", "i"}) EXPECT_TRUE(phases.count(ph)) << ph;
  // The recorded allocations and releases of the plan's buffers (docs/notes/report.md).
  for (const char* c : {"alloc", "free"}) EXPECT_TRUE(categories.count(c)) << c;
  for (const char* c : {"gemm", "attention", "optimizer", "op", "data"}) {
    EXPECT_TRUE(categories.count(c)) << c;
  }
  std::ifstream mf(path("prof/memory.json"));
  auto mem = nlohmann::json::parse(mf);
  // The timeline, built from the recorded alloc/free events of the plan's buffers, peaks exactly
  // at the planned peak, which is also the measured one.
  EXPECT_EQ(mem["peak_bytes"], mem["planned_peak_bytes"]);
  EXPECT_EQ(mem["timeline_peak"]["bytes"], mem["planned_peak_bytes"]);
  std::ifstream hf(path("prof/report.html"));
  std::string html((std::istreambuf_iterator<char>(hf)), std::istreambuf_iterator<char>());
  EXPECT_NE(html.find("<html"), std::string::npos);
  // Self-contained: no script, style or image is fetched (the inlined library's licence comment
  // may name its web site).
  for (const char* fetch : {"src=\"http", "href=\"http", "<script src", "@import"}) {
    EXPECT_EQ(html.find(fetch), std::string::npos) << fetch;
  }
}

TEST_F(Cli, SaveEveryThenResumeFromTheRunDirectory) {
  std::string data = corpus();
  Outcome a = run("train --model gpt2-tiny --data " + data +
                  " --seq 32 --batch 2 --global-batch 4 --steps 6 " +
                  "--save-every 3 --sample-tokens 0 --out " + path("run"));
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_TRUE(fs::exists(path("run/checkpoints/step-000003/model.safetensors")));
  EXPECT_TRUE(fs::exists(path("run/checkpoints/step-000006/optimizer.safetensors")));
  // The checkpoint supplies the data, shape and model; --steps is the run's total.
  Outcome b = run("train --resume " + path("run") + " --steps 8 --sample-tokens 0 --out " +
                  path("run") + " --log-json " + path("resumed.jsonl"));
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("resumed from"), std::string::npos) << b.out;
  std::ifstream f(path("resumed.jsonl"));
  std::string line;
  std::vector<int> steps;
  while (std::getline(f, line)) steps.push_back(nlohmann::json::parse(line)["step"]);
  EXPECT_EQ(steps, (std::vector<int>{7, 8}));

  Outcome c = run("train --resume " + path("nowhere") + " --steps 8");
  EXPECT_EQ(c.code, 1);
  EXPECT_NE(c.out.find("nowhere"), std::string::npos) << c.out;
}

TEST_F(Cli, PlanSaysWhatIsMissingWhenNothingFits) {
  write("gpt7b.json", R"({"n_layer": 32, "n_head": 32, "n_embd": 4096, "vocab_size": 50257,
                          "n_positions": 4096})");
  Outcome r = run("plan --model " + path("gpt7b.json") +
                  " --devices 4 --device-memory 24GiB --device L4 --seq 2048 --global-batch 64"
                  " --offload-optimizer off");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("nothing fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ZeRO-3"), std::string::npos) << r.out;

  Outcome d = run("plan --model gpt2-tiny --device NoSuchGPU");
  EXPECT_EQ(d.code, 1);
  EXPECT_NE(d.out.find("H100"), std::string::npos) << d.out;  // the known names are listed

  std::string data = corpus();
  // (Without optimizer offload: with it, gpt2's 124M parameters leave room in 1 GiB.)
  Outcome t = run("train --model gpt2 --data " + data +
                  " --device-memory 1GiB --steps 1 --offload-optimizer off");
  EXPECT_EQ(t.code, 1);
  EXPECT_NE(t.out.find("nothing fits"), std::string::npos) << t.out;
}

}  // namespace
}  // namespace headroom
