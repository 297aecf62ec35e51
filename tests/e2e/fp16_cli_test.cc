// End-to-end tests of fp16 mixed precision on the command line: the flags, their errors, the
// per-step loss scale in --log-json, an injected overflow's skipped step, plan and bench.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "e2e_util.h"

namespace headroom {
namespace {

using e2e::has;
using e2e::Outcome;
using e2e::run;

class Fp16Cli : public e2e::TempDirTest {};

TEST_F(Fp16Cli, BadLossScaleFlagsGetClearErrors) {
  const std::string data = corpus();
  const std::string base = "train --model gpt2-tiny --data " + data +
                           " --seq 32 --batch 2 --steps 1 --out " + path("m") +
                           " --sample-tokens 0 ";
  for (const char* bad : {"-3", "foo", "0"}) {
    Outcome r = run(base + "--precision fp16 --loss-scale " + bad);
    EXPECT_EQ(r.code, 1) << bad << ": " << r.out;
    EXPECT_TRUE(has(r.out, std::string("--loss-scale ") + bad)) << r.out;
    EXPECT_TRUE(has(r.out, "dynamic")) << r.out;
  }
  Outcome w = run(base + "--precision fp16 --loss-scale-window 0");
  EXPECT_EQ(w.code, 1) << w.out;
  EXPECT_TRUE(has(w.out, "--loss-scale-window 0")) << w.out;
  // Loss scaling is fp16's: asking for it with another precision is an error, not ignored.
  Outcome b = run(base + "--precision bf16 --loss-scale 1024");
  EXPECT_EQ(b.code, 1) << b.out;
  EXPECT_TRUE(has(b.out, "fp16 only")) << b.out;
  Outcome p = run(base + "--precision fp8");
  EXPECT_EQ(p.code, 1) << p.out;
  EXPECT_TRUE(has(p.out, "--precision fp8")) << p.out;
  EXPECT_TRUE(has(p.out, "fp16")) << p.out;
}

TEST_F(Fp16Cli, TrainLogsTheLossScaleAndSkipsAnInjectedOverflow) {
  const std::string data = corpus();
  const std::string log = path("log.jsonl");
  Outcome r = run("train --model gpt2-tiny --data " + data +
                  " --seq 32 --batch 2 --steps 4 --precision fp16 --loss-scale-window 2"
                  " --inject-overflow-at 2 --sample-tokens 0 --out " +
                  path("m") + " --log-json " + log);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "\n  fp16, ")) << r.out;  // the plan line
  EXPECT_TRUE(has(r.out, "step 2: gradient overflow")) << r.out;
  std::ifstream f(log);
  std::string line;
  std::vector<nlohmann::json> steps;
  while (std::getline(f, line)) steps.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(steps.size(), 4u);
  // 2^16, overflow at step 2 (skipped, halved), two good steps, doubled after step 4.
  const std::vector<double> scale = {65536, 65536, 32768, 32768};
  for (size_t i = 0; i < 4; i++) {
    EXPECT_EQ(steps[i]["loss_scale"].get<double>(), scale[i]) << i;
    EXPECT_EQ(steps[i]["skipped"].get<bool>(), i == 1) << i;
  }
  EXPECT_TRUE(steps[1].contains("events"));
  // The same run in fp32 logs an unscaled step.
  Outcome f32 = run("train --model gpt2-tiny --data " + data +
                    " --seq 32 --batch 2 --steps 1 --precision fp32 --sample-tokens 0 --out " +
                    path("m32") + " --log-json " + path("log32.jsonl"));
  ASSERT_EQ(f32.code, 0) << f32.out;
  std::ifstream f2(path("log32.jsonl"));
  ASSERT_TRUE(std::getline(f2, line));
  nlohmann::json s = nlohmann::json::parse(line);
  EXPECT_EQ(s["loss_scale"].get<double>(), 1.0);
  EXPECT_FALSE(s["skipped"].get<bool>());
}

TEST_F(Fp16Cli, PlanAndBenchTakeFp16) {
  Outcome p = run("plan --model gpt2-tiny --seq 64 --global-batch 4 --precision fp16 --json");
  ASSERT_EQ(p.code, 0) << p.out;
  nlohmann::json j = nlohmann::json::parse(p.out);
  EXPECT_EQ(j["chosen"]["precision"], "fp16");
  // auto never picks fp16 (an explicit choice).
  Outcome a = run("plan --model gpt2-tiny --seq 64 --global-batch 4 --json");
  ASSERT_EQ(a.code, 0) << a.out;
  nlohmann::json ja = nlohmann::json::parse(a.out);
  EXPECT_NE(ja["chosen"]["precision"], "fp16");
  for (const auto& c : ja["candidates"]) EXPECT_NE(c["precision"], "fp16");

  Outcome b =
      run("bench --model gpt2-tiny --batch 2 --seq 32 --steps 2 --warmup 1 "
          "--precision fp16 --json");
  ASSERT_EQ(b.code, 0) << b.out;
  nlohmann::json jb = nlohmann::json::parse(b.out);
  EXPECT_EQ(jb["precision"], "fp16");
  // fp16's GEMMs are fp32 GEMMs here: MFU in the run is against the fp32 peak.
  EXPECT_EQ(jb["gemm_peak_in_run"].get<std::string>().rfind("fp32 GEMM", 0), 0u);
  EXPECT_GT(jb["tokens_per_s"].get<double>(), 0.0);
}

}  // namespace
}  // namespace headroom
