// Optimizer offload through the command line: `plan` for the 7B on 4 x L4 (fits only
// with offload), `train --offload-optimizer on` with the offload tier's bytes equal to the plan,
// and bad values of the flags.
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

std::string seven_b_on_four_l4s() {
  return "plan --model " + std::string(HEADROOM_SOURCE_DIR) +
         "/configs/gpt-7b.json --devices 4 --device-memory 24GiB --device L4 --seq 2048 "
         "--global-batch 64";
}

TEST(PlanOffloadCli, SevenBOnFourL4sFitsWithOptimizerOffload) {
  Outcome r = run(seven_b_on_four_l4s());
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* what :
       {"4 x L4", "chosen: micro-batch", "optimizer offload", "ZeRO stage", "in the offload tier",
        "over the host link", "AdamW on the host", "memory per device at the peak", "planned in"}) {
    EXPECT_TRUE(has(r.out, what)) << what << "\n" << r.out;
  }
  Outcome j = run(seven_b_on_four_l4s() + " --json");
  ASSERT_EQ(j.code, 0) << j.out;
  nlohmann::json doc = e2e::json_of(j.out);
  const auto& c = doc["chosen"];
  EXPECT_EQ(c["offload"], "optimizer");
  EXPECT_LE(c["peak_bytes"].get<uint64_t>(), 24ull << 30);
  // About 16 bytes a parameter / 4 devices in the offload tier.
  const double P = double(doc["model"]["parameters"].get<int64_t>());
  EXPECT_NEAR(c["offload_bytes"].get<double>(), 16.0 * P / 4, 0.01 * 16.0 * P / 4);
  EXPECT_GT(c["offload_seconds"].get<double>(), 0);
  EXPECT_GT(c["host_optimizer_seconds"].get<double>(), 0);
  EXPECT_FALSE(c["by_category"].contains("optimizer"));
  EXPECT_GT(doc["device"]["offload_link_bandwidth"].get<double>(), 0);
  // A detector of a runaway search (seconds of planning), not a benchmark: far above what a
  // loaded machine takes (2.5 s measured at load average 10; 0.1 s quiet).
  EXPECT_LT(doc["planning_ms"].get<double>(), 30000.0);

  // Off: nothing fits (exit 3), and the advice names offload as built.
  Outcome off = run(seven_b_on_four_l4s() + " --offload-optimizer off");
  EXPECT_EQ(off.code, 3) << off.out;
  EXPECT_TRUE(has(off.out, "--offload-optimizer on")) << off.out;
  // An offload budget too small for the shard: nothing fits, the tier is named.
  Outcome starved = run(seven_b_on_four_l4s() + " --offload-memory 8GiB");
  EXPECT_EQ(starved.code, 3) << starved.out;
  EXPECT_TRUE(has(starved.out, "offload")) << starved.out;
}

TEST(PlanOffloadCli, BadValuesAreNamed) {
  Outcome a = run("plan --model gpt2-tiny --offload-optimizer maybe");
  EXPECT_EQ(a.code, 1) << a.out;
  EXPECT_TRUE(has(a.out, "--offload-optimizer maybe: use auto, on or off")) << a.out;
  Outcome b = run("plan --model gpt2-tiny --offload-memory lots");
  EXPECT_EQ(b.code, 1) << b.out;
  EXPECT_TRUE(has(b.out, "--offload-memory lots")) << b.out;
  Outcome z = run("plan --model gpt2-tiny --offload-memory 0");
  EXPECT_EQ(z.code, 1) << z.out;
  EXPECT_TRUE(has(z.out, "--offload-memory 0")) << z.out;
  Outcome t = run("train --model gpt2-tiny --offload-optimizer yes --steps 1");
  EXPECT_EQ(t.code, 1) << t.out;
  EXPECT_TRUE(has(t.out, "--offload-optimizer yes")) << t.out;
  Outcome h = run("train --model gpt2-tiny --help");
  EXPECT_TRUE(has(h.out, "--offload-optimizer")) << h.out;
  EXPECT_TRUE(has(h.out, "MemAvailable")) << h.out;
}

class TrainOffloadCli : public e2e::TempDirTest {};

TEST_F(TrainOffloadCli, TrainsWithTheOffloadTierAsPlanned) {
  const std::string data = corpus();
  const std::string common =
      "train --model gpt2-tiny --data " + data +
      " --seq 32 --batch 2 --global-batch 4 --steps 3 --sample-tokens 0 --precision fp32 "
      "--recompute none";
  Outcome r = run(common + " --offload-optimizer on --offload-memory 1GiB --json --log-json " +
                  path("log.jsonl") + " --out " + path("on"));
  ASSERT_EQ(r.code, 0) << r.out;
  nlohmann::json doc = e2e::json_of(r.out);
  EXPECT_EQ(doc["offload"], "optimizer");
  EXPECT_GT(doc["planned_offload_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(doc["offload_bytes_peak"], doc["planned_offload_bytes"]);
  EXPECT_EQ(doc["device_bytes_peak"], doc["planned_peak_bytes"]);
  EXPECT_EQ(doc["offload_memory"].get<uint64_t>(), 1ull << 30);
  std::ifstream f(path("log.jsonl"));
  std::string line;
  int steps = 0;
  while (std::getline(f, line)) {
    nlohmann::json s = nlohmann::json::parse(line);
    EXPECT_EQ(s["offload_bytes_peak"], s["planned_offload_bytes"]);
    EXPECT_TRUE(s.contains("offload_copy_ms"));
    steps++;
  }
  EXPECT_EQ(steps, 3);

  // The human start-up lines show the offload tier.
  Outcome h = run(common + " --offload-optimizer on --out " + path("human"));
  ASSERT_EQ(h.code, 0) << h.out;
  for (const char* what : {"optimizer offload: AdamW runs on the offload tier", "master_weights",
                           "adam_m", "offload_gradients", "offload tier: peak"}) {
    EXPECT_TRUE(has(h.out, what)) << what << "\n" << h.out;
  }

  // The same weights as without offload (bit for bit, through the saved model's bytes).
  Outcome off = run(common + " --offload-optimizer off --json --out " + path("off"));
  ASSERT_EQ(off.code, 0) << off.out;
  EXPECT_EQ(e2e::json_of(off.out)["offload"], "none");
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(path("on") + "/model.safetensors"), bytes(path("off") + "/model.safetensors"));

  // Too small an offload budget: the tier and the flag are named.
  Outcome small =
      run(common + " --offload-optimizer on --offload-memory 1MiB --out " + path("small"));
  EXPECT_EQ(small.code, 1) << small.out;
  EXPECT_TRUE(has(small.out, "offload tier")) << small.out;
  EXPECT_TRUE(has(small.out, "--offload-memory")) << small.out;

  // A plan file carries the choice; a flag that contradicts it is refused.
  Outcome p =
      run("plan --model gpt2-tiny --seq 32 --batch 2 --global-batch 4 --precision fp32 "
          "--recompute none --offload-optimizer on --json");
  ASSERT_EQ(p.code, 0) << p.out;
  write("plan.json", e2e::json_text(p.out));
  EXPECT_EQ(e2e::json_of(p.out)["chosen"]["offload"], "optimizer");
  Outcome from_file =
      run(common + " --plan " + path("plan.json") + " --json --out " + path("file"));
  ASSERT_EQ(from_file.code, 0) << from_file.out;
  EXPECT_EQ(e2e::json_of(from_file.out)["offload"], "optimizer");
  Outcome contra = run(common + " --plan " + path("plan.json") + " --offload-optimizer off --out " +
                       path("contra"));
  EXPECT_EQ(contra.code, 1) << contra.out;
  EXPECT_TRUE(has(contra.out, "contradicts")) << contra.out;
}

// Both kinds in one offload tier: `plan` shows both parts (text and JSON, offload "all"), a plan
// file carries them to `train`, which saves the same model as with neither, and a budget too
// small for the two together names the flag and both parts.
TEST_F(TrainOffloadCli, BothKindsInOneTier) {
  const std::string data = corpus();
  const std::string shape =
      " --model gpt2-tiny --seq 32 --batch 2 --global-batch 4 --precision fp32 --recompute none";
  const std::string both = " --offload-optimizer on --offload-activations on";
  Outcome p = run("plan" + shape + both + " --offload-memory 1GiB --json");
  ASSERT_EQ(p.code, 0) << p.out;
  nlohmann::json c = e2e::json_of(p.out)["chosen"];
  EXPECT_EQ(c["offload"], "all");
  const uint64_t opt = c["offload_optimizer_bytes"], act = c["offload_activation_bytes"];
  EXPECT_GT(opt, 0u);
  EXPECT_GT(act, 0u);
  EXPECT_EQ(c["offload_bytes"].get<uint64_t>(), opt + act);
  EXPECT_GT(c["offload_activation_link_bytes_per_step"].get<double>(), 0.0);
  EXPECT_GT(c["offload_link_bytes_per_step"].get<double>(),
            c["offload_activation_link_bytes_per_step"].get<double>());
  for (bool b : c["offload_per_block"]) EXPECT_TRUE(b);
  write("plan.json", e2e::json_text(p.out));

  Outcome text = run("plan" + shape + both + " --offload-memory 1GiB");
  ASSERT_EQ(text.code, 0) << text.out;
  for (const char* what : {"optimizer and activation offload", "activation offload: 4 blocks",
                           "shared with the optimizer state", "optimizer offload:", "offload tier:",
                           "adam_m", "offloaded activations", "optimizer state"}) {
    EXPECT_TRUE(has(text.out, what)) << what << "\n" << text.out;
  }

  const std::string train = "train --data " + data + shape + " --steps 3 --sample-tokens 0";
  Outcome on = run(train + " --plan " + path("plan.json") + " --offload-memory 1GiB --json " +
                   "--out " + path("both"));
  ASSERT_EQ(on.code, 0) << on.out;
  nlohmann::json doc = e2e::json_of(on.out);
  EXPECT_EQ(doc["offload"], "all");
  EXPECT_EQ(doc["planned_offload_bytes"].get<uint64_t>(), opt + act);
  EXPECT_EQ(doc["offload_bytes_peak"], doc["planned_offload_bytes"]);
  EXPECT_EQ(doc["device_bytes_peak"], doc["planned_peak_bytes"]);
  Outcome neither = run(train + " --offload-optimizer off --offload-activations off --json --out " +
                        path("neither"));
  ASSERT_EQ(neither.code, 0) << neither.out;
  EXPECT_EQ(e2e::json_of(neither.out)["offload"], "none");
  auto bytes = [](const std::string& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(bytes(path("both") + "/model.safetensors"),
            bytes(path("neither") + "/model.safetensors"));

  // Room for the optimizer state, not for the activations on top.
  Outcome small =
      run(train + both + " --offload-memory " + std::to_string(opt) + " --out " + path("small"));
  EXPECT_NE(small.code, 0) << small.out;
  for (const char* what :
       {"offload tier", "--offload-memory", "optimizer state", "offloaded activations"}) {
    EXPECT_TRUE(has(small.out, what)) << what << "\n" << small.out;
  }
}

}  // namespace
}  // namespace headroom
