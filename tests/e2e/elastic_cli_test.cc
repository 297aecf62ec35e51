// `headroom train --device-memory-file` end to end: bad files and flag combinations are refused
// with the file named before anything trains; a run reads its budget from the file and logs the
// elastic fields (the re-plans themselves are tested in tests/train/elastic_test.cc).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "e2e_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

using e2e::Outcome;
using e2e::run;

class ElasticCli : public e2e::TempDirTest {};

TEST_F(ElasticCli, BadBudgetFilesAreRefusedWithTheFileNamed) {
  Outcome missing = run("train --model gpt2-tiny --steps 1 --device-memory-file " + path("nope") +
                        " --out " + path("o"));
  EXPECT_EQ(missing.code, 1) << missing.out;
  EXPECT_NE(missing.out.find("--device-memory-file " + path("nope") + ": cannot read it"),
            std::string::npos)
      << missing.out;

  write("budget", "two gigs\n");
  Outcome bad = run("train --model gpt2-tiny --steps 1 --device-memory-file " + path("budget") +
                    " --out " + path("o"));
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("'two gigs' is not a size"), std::string::npos) << bad.out;

  write("budget", "1GiB");
  Outcome both =
      run("train --model gpt2-tiny --steps 1 --device-memory 1GiB "
          "--device-memory-file " +
          path("budget") + " --out " + path("o"));
  EXPECT_EQ(both.code, 1) << both.out;
  EXPECT_NE(both.out.find("give one"), std::string::npos) << both.out;
}

TEST_F(ElasticCli, TrainReadsTheBudgetFileAndLogsTheElasticFields) {
  write("budget", "768MiB\n");
  Outcome r =
      run("train --model gpt2-tiny --seq 32 --global-batch 4 --steps 2 --sample-tokens 0 "
          "--device-memory-file " +
          path("budget") + " --out " + path("run") + " --log-json " + path("log.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("budget 768 MiB (from " + path("budget")), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expected step time:"), std::string::npos) << r.out;
  std::ifstream f(path("log.jsonl"));
  std::string line;
  ASSERT_TRUE(std::getline(f, line));
  nlohmann::json s = nlohmann::json::parse(line);
  EXPECT_EQ(s["device_budget"], 768ull << 20);
  EXPECT_EQ(s["replans"], 0);
  EXPECT_EQ(s["oom_recoveries"], 0);
  EXPECT_EQ(s["micro_batch"].get<int>() * s["accumulation"].get<int>(), 4);
  EXPECT_TRUE(s["recompute"].is_string());
  EXPECT_GT(s["predicted_step_ms"].get<double>(), 0.0);
}

TEST_F(ElasticCli, AnUnwritableOutputDirectoryIsRefusedBeforeTraining) {
  write("file", "x");  // --out below a regular file cannot be created
  Outcome r = run("train --model gpt2-tiny --seq 32 --steps 1 --sample-tokens 0 --out " +
                  path("file") + "/run");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("--out " + path("file") + "/run: cannot create the output directory"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("1/1"), std::string::npos) << r.out;  // no step ran
}

}  // namespace
}  // namespace headroom
