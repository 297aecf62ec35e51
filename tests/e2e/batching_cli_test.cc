// `headroom train --batching bucketed` end to end on the default corpus (Debian's fortunes, each
// fortune a document): the run trains, reports its padding and plans per shape, logs the real
// tokens per step, and measures the planned peak; bad values are refused naming the flag.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e_util.h"

namespace headroom {
namespace {

using e2e::Outcome;
using e2e::run;

class BatchingCli : public e2e::TempDirTest {};

TEST_F(BatchingCli, BucketedTrainsOnTheFortunesAndMeasuresThePlannedPeak) {
  Outcome r =
      run("train --model gpt2-tiny --batching bucketed --steps 5 --sample-tokens 0 --json"
          " --out " +
          path("run") + " --log-json " + path("log.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = e2e::json_of(r.out);
  EXPECT_EQ(j["batching"], "bucketed");
  EXPECT_EQ(j["bucket"], 32);
  EXPECT_GT(j["padding"].get<double>(), 0.0);
  EXPECT_LT(j["padding"].get<double>(), 0.5);
  EXPECT_GT(j["shape_plans"].get<int>(), 1);
  EXPECT_EQ(j["device_bytes_peak"], j["planned_peak_bytes"]);
  std::ifstream f(path("log.jsonl"));
  int lines = 0;
  for (std::string line; std::getline(f, line); lines++) {
    const nlohmann::json s = nlohmann::json::parse(line);
    const int G = s["micro_batch"].get<int>() * s["accumulation"].get<int>();
    EXPECT_GT(s["tokens"].get<int64_t>(), 0);
    EXPECT_LE(s["tokens"].get<int64_t>(), int64_t(G) * 128);  // real tokens within G x T
    EXPECT_GE(s["micro_batches"].get<int>(), 1);
    EXPECT_EQ(s["device_bytes_peak"], s["planned_peak_bytes"]);
  }
  EXPECT_EQ(lines, 5);
}

TEST_F(BatchingCli, BadValuesAreRefusedNamingTheFlag) {
  Outcome mode = run("train --model gpt2-tiny --steps 1 --batching sorted --out " + path("o"));
  EXPECT_EQ(mode.code, 1) << mode.out;
  EXPECT_NE(mode.out.find("--batching 'sorted': use packed"), std::string::npos) << mode.out;
  Outcome zero =
      run("train --model gpt2-tiny --steps 1 --batching bucketed --bucket 0 --out " + path("o"));
  EXPECT_EQ(zero.code, 1) << zero.out;
  EXPECT_NE(zero.out.find("--bucket 0: must be at least 1"), std::string::npos) << zero.out;
  Outcome packed = run("train --model gpt2-tiny --steps 1 --bucket 16 --out " + path("o"));
  EXPECT_EQ(packed.code, 1) << packed.out;
  EXPECT_NE(packed.out.find("--bucket 16 applies to --batching bucketed only"), std::string::npos)
      << packed.out;
}

}  // namespace
}  // namespace headroom
