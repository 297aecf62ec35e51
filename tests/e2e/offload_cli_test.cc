// End-to-end: activation offload through `headroom plan` and `headroom train` (flags, JSON,
// per-block schedule, bit-identical losses with offload on and off, plan file round trip).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "e2e_util.h"

namespace headroom {
namespace {

using e2e::Outcome;
using e2e::run;
using nlohmann::json;

class OffloadCli : public e2e::TempDirTest {
 protected:
  std::vector<double> losses(const std::string& log) {
    std::vector<double> v;
    std::ifstream f(log);
    std::string line;
    while (std::getline(f, line)) {
      json j = json::parse(line);
      v.push_back(j["loss"].get<double>());
      last_ = j;
    }
    return v;
  }
  json last_;
};

TEST_F(OffloadCli, BadFlagsNameTheFlagAndTheValue) {
  Outcome a = run("plan --model gpt2-tiny --offload-activations maybe");
  EXPECT_NE(a.code, 0);
  EXPECT_NE(a.out.find("--offload-activations maybe: use auto, on or off"), std::string::npos)
      << a.out;
  Outcome b = run("plan --model gpt2-tiny --offload-memory 0");
  EXPECT_NE(b.code, 0);
  EXPECT_NE(b.out.find("--offload-memory 0"), std::string::npos) << b.out;
  Outcome c = run("plan --model gpt2-tiny --offload-memory lots");
  EXPECT_NE(c.code, 0);
  EXPECT_NE(c.out.find("--offload-memory lots"), std::string::npos) << c.out;
  Outcome d = run("plan --model gpt2-tiny --offload-activations on --recompute full");
  EXPECT_NE(d.code, 0);
  EXPECT_NE(d.out.find("keeps nothing to offload"), std::string::npos) << d.out;
}

TEST_F(OffloadCli, PlanShowsThePerBlockScheduleAndTheOffloadTier) {
  Outcome p =
      run("plan --model gpt2 --device H100-80GB --seq 1024 --batch 8 --global-batch 8 "
          "--precision bf16 --offload-activations on --offload-memory 64GiB --json");
  ASSERT_EQ(p.code, 0) << p.out;
  json j = json::parse(p.out);
  const json& c = j["chosen"];
  EXPECT_EQ(c["offload"], "activations");
  ASSERT_EQ(c["offload_per_block"].size(), 12u);
  ASSERT_EQ(c["schedule_per_block"].size(), 12u);
  for (const json& b : c["offload_per_block"]) EXPECT_TRUE(b.get<bool>());
  for (const json& b : c["schedule_per_block"]) {
    EXPECT_TRUE(b == "offload" || b == "selective+offload") << b;
  }
  EXPECT_GT(c["offload_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(c["offload_link_bytes_per_step"].get<double>(), 0.0);
  EXPECT_GE(c["offload_seconds"].get<double>(), 0.0);
  EXPECT_GT(j["device"]["offload_link_bandwidth"].get<double>(), 0.0);
  EXPECT_EQ(j["offload_memory"].get<uint64_t>(), 64ull << 30);
  // Human output: the choice per block and the tier.
  Outcome h =
      run("plan --model gpt2 --device H100-80GB --seq 1024 --batch 8 --global-batch 8 "
          "--precision bf16 --offload-activations on --offload-memory 64GiB");
  ASSERT_EQ(h.code, 0) << h.out;
  // Runs of equal choices: every block offloads, with or without selective recomputation.
  EXPECT_TRUE(h.out.find("per block: 0-11: offload\n") != std::string::npos ||
              h.out.find("per block: 0-11: selective+offload\n") != std::string::npos)
      << h.out;
  EXPECT_NE(h.out.find("activation offload: 12 blocks"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("offload tier"), std::string::npos) << h.out;
  // Off: none of it.
  Outcome o =
      run("plan --model gpt2 --device H100-80GB --seq 1024 --batch 8 --global-batch 8 "
          "--precision bf16 --offload-activations off --json");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_EQ(json::parse(o.out)["chosen"]["offload"], "none");
}

TEST_F(OffloadCli, TrainWithOffloadOnGivesTheSameLossesAndRoundTripsThePlan) {
  const std::string data = corpus();
  const std::string common = "train --model gpt2-tiny --data " + data +
                             " --seq 64 --batch 4 --global-batch 8 --steps 3 --sample-tokens 0 "
                             "--precision fp32 --recompute selective --out ";
  Outcome off =
      run(common + path("off") + " --offload-activations off --log-json " + path("off.jsonl"));
  ASSERT_EQ(off.code, 0) << off.out;
  std::vector<double> a = losses(path("off.jsonl"));
  EXPECT_FALSE(last_.contains("offload_bytes"));
  Outcome on = run(common + path("on") + " --offload-activations on --offload-memory 1GiB " +
                   "--log-json " + path("on.jsonl"));
  ASSERT_EQ(on.code, 0) << on.out;
  EXPECT_NE(on.out.find("activations offloaded"), std::string::npos) << on.out;
  EXPECT_NE(on.out.find("offload tier"), std::string::npos) << on.out;
  std::vector<double> b = losses(path("on.jsonl"));
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(a, b);  // bit-identical: the copies are exact
  EXPECT_GT(last_["offload_bytes"].get<uint64_t>(), 0u);
  EXPECT_GE(last_["offload_wait_ms"].get<double>(), 0.0);
  EXPECT_EQ(last_["device_bytes_peak"], last_["planned_peak_bytes"]);

  // plan --json, then train --plan FILE: the offload choice per block travels in the file.
  Outcome p =
      run("plan --model gpt2-tiny --seq 64 --batch 4 --global-batch 8 --precision fp32 --recompute "
          "selective --offload-activations on --json");
  ASSERT_EQ(p.code, 0) << p.out;
  write("plan.json", p.out);
  Outcome t =
      run("train --model gpt2-tiny --plan " + path("plan.json") + " --data " + data +
          " --steps 3 --sample-tokens 0 --out " + path("pf") + " --log-json " + path("pf.jsonl"));
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_NE(t.out.find("activations offloaded"), std::string::npos) << t.out;
  EXPECT_EQ(losses(path("pf.jsonl")), a);
  // A flag that contradicts the file is refused, naming both.
  Outcome bad = run("train --model gpt2-tiny --plan " + path("plan.json") + " --data " + data +
                    " --steps 1 --offload-activations off --out " + path("bad"));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--offload-activations off contradicts"), std::string::npos) << bad.out;
}

TEST_F(OffloadCli, BenchReportsTheCopies) {
  Outcome b =
      run("bench --model gpt2-tiny --batch 2 --seq 64 --steps 2 --warmup 1 --precision fp32 "
          "--offload-activations on --peak-between-steps false --json");
  ASSERT_EQ(b.code, 0) << b.out;
  json j = json::parse(b.out);
  EXPECT_NE(j["techniques"].get<std::string>().find("activations offloaded"), std::string::npos);
  EXPECT_GT(j["offload_tier_bytes"].get<uint64_t>(), 0u);
  EXPECT_GT(j["offload_bytes_per_step"].get<double>(), 0.0);
  EXPECT_GT(j["offload_copy_bandwidth"].get<double>(), 0.0);
  EXPECT_LE(j["offload_hidden_fraction"].get<double>(), 1.0);
  Outcome bad = run("bench --model gpt2-tiny --offload-activations on --recompute full");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("keeps nothing to offload"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace headroom
