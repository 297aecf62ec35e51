// Issue #26, "a newcomer's first hour", end to end: JSON output survives text that is not UTF-8
// (docs/notes/json-text.md), integer and size flags are validated by one set of rules
// (docs/notes/flags.md), and `headroom --version` says what the binary was built with.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "e2e_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using e2e::has;
using e2e::Outcome;
using e2e::run;
using nlohmann::json;

class FirstHour : public e2e::TempDirTest {};

const std::string kFffd = "\xEF\xBF\xBD";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Regression: `generate --json` aborted (nlohmann type_error 316, exit 134) on a prompt or a
// completion that is not valid UTF-8; every other JSON writer could too, given such a path.
TEST_F(FirstHour, JsonOutputSurvivesTextAndPathsThatAreNotUtf8) {
  // A directory whose name is not UTF-8 holds every file the run writes.
  const std::string bad = path("run-\xFF\xE2\x82");
  fs::create_directories(bad);
  Outcome p = run("prepare /usr/share/games/fortunes/computers --doc-separator % --json --out '" +
                  bad + "/corpus.tokens'");
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_EQ(e2e::json_of(p.out)["out"].get<std::string>(),
            path("run-") + kFffd + kFffd + "/corpus.tokens");

  Outcome t = run("train --model gpt2-tiny --data '" + bad +
                  "/corpus.tokens' --seq 16 --batch 2 --steps 2 --sample-tokens 8 --save-every 1 "
                  "--json --out '" +
                  bad + "/model' --log-json '" + bad + "/log.jsonl' --profile '" + bad + "/prof'");
  ASSERT_EQ(t.code, 0) << t.out;
  EXPECT_NO_THROW((void)e2e::json_of(t.out)) << t.out;
  std::istringstream log(read_file(bad + "/log.jsonl"));
  std::string line;
  int lines = 0;
  for (; std::getline(log, line); ++lines) EXPECT_NO_THROW((void)json::parse(line)) << line;
  EXPECT_EQ(lines, 2);
  for (const char* f :
       {"/prof/trace.json", "/prof/memory.json",
        "/model/checkpoints/step-000002/trainer_state.json", "/model/config.json"}) {
    EXPECT_NO_THROW((void)json::parse(read_file(bad + f))) << f;
  }

  // A prompt that is not UTF-8 (a lone 0xFF, then a character cut short): the text fields carry
  // U+FFFD, the token ids are exact and the completion's ids are there.
  Outcome g = run("generate --model-dir '" + bad +
                  "/model' --prompt 'x\xFF\xE2\x82' --max-new-tokens 12 --temperature 1.5 --json");
  ASSERT_EQ(g.code, 0) << g.out;
  const json j = e2e::json_of(g.out);
  EXPECT_EQ(j["prompt"].get<std::string>(), "x" + kFffd + kFffd);
  EXPECT_FALSE(j["text_is_exact"].get<bool>());
  ASSERT_TRUE(j["tokens"].is_array());
  EXPECT_GE(j["tokens"].size(), 1u);
  EXPECT_LE(j["tokens"].size(), 12u);
  for (const json& id : j["tokens"]) EXPECT_TRUE(id.is_number_integer()) << id;
  // GPT-2's byte-level BPE keeps every byte: 'x', 0xFF and E2 82 are at least three tokens.
  ASSERT_TRUE(j["prompt_tokens"].is_array());
  EXPECT_GE(j["prompt_tokens"].size(), 3u);

  // A plan for a config.json on that path.
  Outcome pl = run("plan --model '" + bad + "/model/config.json' --json");
  ASSERT_EQ(pl.code, 0) << pl.out;
  EXPECT_EQ(e2e::json_of(pl.out)["model"]["name"].get<std::string>(),
            path("run-") + kFffd + kFffd + "/model/config.json");
}

// Regression: `--batch 0` trained with the planner's choice, silently; garbage, negatives and
// overflow got CLI11's "Could not convert" or nothing (a negative --seed wrapped around). Every
// integer and size flag of every subcommand now answers the same way: exit 1 and a message that
// names the flag, the value and what to give instead.
TEST_F(FirstHour, IntegerAndSizeFlagsAreRefusedNamingTheFlagTheValueAndWhatToDo) {
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"train --batch 0",
       "--batch 0: must be at least 1 (the micro-batch in sequences); leave "
       "--batch out or give --batch auto for the planner's choice"},
      {"plan --batch 0", "--batch 0: must be at least 1"},
      {"bench --batch 0", "--batch 0: must be at least 1"},
      {"train --batch 12abc", "--batch 12abc: not a whole number"},
      {"train --batch -2", "--batch -2: must not be negative"},
      {"train --global-batch 99999999999", "--global-batch 99999999999: too large"},
      {"train --seq 0", "--seq 0: must be at least 1"},
      {"train --steps 0", "--steps 0: must be at least 1"},
      {"train --minutes 0", "--minutes 0: not a positive number of minutes"},
      {"train --minutes 2x", "--minutes 2x: not a positive number of minutes"},
      {"bench --steps 0", "--steps 0: must be at least 1"},
      {"train --seed -1", "--seed -1: must not be negative"},
      {"train --warmup -1", "--warmup -1: must not be negative"},
      {"train --threads 0", "--threads 0: must be at least 1"},
      {"train --save-every -1", "--save-every -1: must not be negative"},
      {"train --keep-checkpoints x", "--keep-checkpoints x: not a whole number"},
      {"train --eval-every 1.5", "--eval-every 1.5: not a whole number"},
      {"train --sample-tokens -3", "--sample-tokens -3: must not be negative"},
      {"train --loss-scale-window 0", "--loss-scale-window 0: must be at least 1"},
      {"train --bucket 0", "--bucket 0: must be at least 1"},
      {"plan --devices 0", "--devices 0: must be at least 1"},
      {"bench --warmup -1", "--warmup -1: must not be negative"},
      {"bench --head-chunk -1", "--head-chunk -1: must not be negative"},
      {"generate --model-dir x --max-new-tokens 0", "--max-new-tokens 0: must be at least 1"},
      {"generate --model-dir x --top-k -1", "--top-k -1: must not be negative"},
      {"generate --model-dir x --seed 18446744073709551616",
       "--seed 18446744073709551616: too "
       "large"},
      {"train --device-memory 0", "--device-memory 0: a budget of 0 bytes holds nothing"},
      {"plan --device-memory 12abc", "--device-memory 12abc: not a size"},
      {"bench --offload-memory 0", "--offload-memory 0: a budget of 0 bytes holds nothing"},
      // The GPU's flags on the CPU, and a device calibrate does not know.
      {"train --managed-memory", "--managed-memory: managed (unified) memory is a GPU's"},
      {"bench --managed-memory", "--managed-memory: managed (unified) memory is a GPU's"},
      {"calibrate --device gpu", "calibrate --device gpu: use cpu (this machine) or cuda"},
  };
  for (const Case& c : cases) {
    const bool train = c.args.rfind("train", 0) == 0;
    Outcome r = run(c.args + (train ? " --out " + path("o") : std::string()));
    EXPECT_EQ(r.code, 1) << c.args << ": " << r.out;
    EXPECT_TRUE(has(r.out, "headroom: error: " + c.expected)) << c.args << ": " << r.out;
    EXPECT_FALSE(has(r.out, "headroom train:")) << c.args << ": trained anyway";
  }
}

// Where 0 or "auto" is meant, --help says so, and auto is accepted as the default it names.
TEST_F(FirstHour, AutoIsAcceptedAndDocumentedWhereItIsTheDefault) {
  Outcome h = run("train --help");
  ASSERT_EQ(h.code, 0);
  for (const char* s :
       {"INT|auto", "auto: the planner's choice", "(0: none)", "(0: all)", "SIZE|auto"}) {
    EXPECT_TRUE(has(h.out, s)) << s << "\n" << h.out;
  }
  Outcome a = run("plan --batch auto --global-batch auto --seq auto --threads auto --json");
  ASSERT_EQ(a.code, 0) << a.out;
  const json j = e2e::json_of(a.out);
  EXPECT_GE(j["chosen"]["micro_batch"].get<int>(), 1);
  Outcome b = run("plan --batch 4 --json");
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(e2e::json_of(b.out)["chosen"]["micro_batch"].get<int>(), 4);
}

TEST_F(FirstHour, VersionSaysWhatItWasBuiltWith) {
  Outcome v = run("--version");
  ASSERT_EQ(v.code, 0) << v.out;
  for (const char* s :
       {"headroom 0.", "built with", "AVX-512 kernels: compiled ", "AMX kernels: compiled ",
        "oneDNN ", "OpenMP ", " threads", "MPI: ", "CUDA: "}) {
    EXPECT_TRUE(has(v.out, s)) << s << "\n" << v.out;
  }
  Outcome vj = run("version --json");
  ASSERT_EQ(vj.code, 0) << vj.out;
  const json j = e2e::json_of(vj.out);
  for (const char* k : {"version", "compiler", "build_type", "onednn_version", "openmp_version"}) {
    EXPECT_TRUE(j[k].is_string() && !j[k].get<std::string>().empty()) << k;
  }
  for (const char* k : {"avx512_kernels_compiled", "avx512_detected", "avx512_bf16_detected",
                        "amx_kernels_compiled", "amx_detected", "mpi", "cuda"}) {
    EXPECT_TRUE(j[k].is_boolean()) << k;
  }
#ifdef HEADROOM_HAVE_CUDA
  EXPECT_TRUE(j["cuda"].get<bool>());
  EXPECT_TRUE(j["cuda_details"].is_object());
#else
  EXPECT_FALSE(j["cuda"].get<bool>());
  EXPECT_TRUE(j["cuda_details"].is_null());
  EXPECT_TRUE(has(v.out, "CUDA: no")) << v.out;
#endif
  EXPECT_GE(j["openmp_threads"].get<int>(), 1);
  // Kernels compiled for AVX-512 need it at run time (they would not have started otherwise).
  if (j["avx512_kernels_compiled"].get<bool>()) {
    EXPECT_TRUE(j["avx512_detected"].get<bool>());
  }
  // The human form says the same.
  EXPECT_TRUE(has(v.out, "oneDNN " + j["onednn_version"].get<std::string>())) << v.out;
}

// Issue #26, "a first run worth seeing": the summary says the validation loss before the first
// step and at the end (human and --json), and the loss before training is an untrained model's
// (about ln 50257 = 10.8 for GPT-2's vocabulary), measured, not the end's figure repeated.
TEST_F(FirstHour, SummaryCarriesTheValidationLossAtStartAndEnd) {
  const std::string data = corpus();
  const std::string args = "train --model gpt2-tiny --data " + data +
                           " --seq 32 --batch 4 --steps 12 --lr 3e-3 --sample-tokens 8 --out " +
                           path("o");
  Outcome j = run(args + " --json");
  ASSERT_EQ(j.code, 0) << j.out;
  const json r = e2e::json_of(j.out);
  ASSERT_TRUE(r.contains("initial_val_loss")) << j.out;
  ASSERT_TRUE(r.contains("final_val_loss")) << j.out;
  const double start = r["initial_val_loss"].get<double>(), end = r["final_val_loss"].get<double>();
  EXPECT_NEAR(start, std::log(50257.0), 0.5);
  EXPECT_LT(end, start - 0.5);  // 12 steps learn the frequent tokens
  EXPECT_TRUE(r["sample"].is_string());
  // The human form, in its own run (the planner may choose another plan there, which changes
  // the figures in their last digits): the start's figure, then "start -> end".
  Outcome h = run(args);
  ASSERT_EQ(h.code, 0) << h.out;
  std::smatch m0, m1;
  ASSERT_TRUE(std::regex_search(h.out, m0,
                                std::regex(R"(validation loss ([0-9.]+) before the first step)")))
      << h.out;
  ASSERT_TRUE(std::regex_search(h.out, m1, std::regex(R"(validation loss ([0-9.]+) -> ([0-9.]+))")))
      << h.out;
  EXPECT_EQ(m0[1].str(), m1[1].str());
  EXPECT_NEAR(std::stod(m0[1].str()), start, 0.05);
  EXPECT_NEAR(std::stod(m1[2].str()), end, 0.2);
  EXPECT_TRUE(has(h.out, "sample:\n")) << h.out;
}

// Regression: `train --json` returned before saving the tokenizer with the model, so `generate
// --model-dir` of a byte model trained with --json could not decode. And `--minutes`: the run
// fixes its count at the end of the warmup, reports it, and takes exactly that many steps.
TEST_F(FirstHour, JsonRunSavesTheTokenizerAndMinutesFixesTheCount) {
  const std::string data = path("bytes.tokens");
  Outcome p =
      run("prepare /usr/share/games/fortunes/computers --doc-separator % --tokenizer bytes "
          "--out " +
          data);
  ASSERT_EQ(p.code, 0) << p.out;
  Outcome t = run("train --data " + data +
                  " --seq 32 --global-batch 4 --minutes 0.05 --warmup 6 --sample-tokens 8 --json "
                  "--out " +
                  path("m"));
  ASSERT_EQ(t.code, 0) << t.out;
  const json r = e2e::json_of(t.out);
  // Fixed by the budget (after the warmup's 6 steps, at least one more), not the cap of 1e8.
  EXPECT_GT(r["total_steps"].get<int>(), 6) << t.out;
  EXPECT_LT(r["total_steps"].get<int>(), 100'000) << t.out;
  EXPECT_EQ(r["steps"].get<int>(), r["total_steps"].get<int>());
  EXPECT_TRUE(has(t.out, "--minutes 0.05: about")) << t.out;
  EXPECT_TRUE(fs::exists(path("m") + "/tokenizer_config.json"));
  Outcome g =
      run("generate --model-dir " + path("m") + " --prompt 'The ' --max-new-tokens 6 --json");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_TRUE(e2e::json_of(g.out)["completion"].is_string()) << g.out;
}

// Issue #26: `prepare` reads JSON Lines (--field) and directories; a bad line is refused naming
// the file and the line, and nothing is written.
TEST_F(FirstHour, PrepareReadsJsonLinesAndDirectories) {
  fs::create_directories(path("in/sub"));
  write("in/a.txt", "A plain text file.");
  write("in/sub/b.jsonl", "{\"body\": \"first\"}\n{\"body\": \"second\"}\n");
  Outcome p = run("prepare " + path("in") + " --field body --json --out " + path("c.tokens"));
  ASSERT_EQ(p.code, 0) << p.out;
  const json j = e2e::json_of(p.out);
  EXPECT_EQ(j["files"].get<int>(), 2);
  EXPECT_EQ(j["documents"].get<int>(), 3);
  // The default field is "text": these lines have none.
  Outcome bad = run("prepare " + path("in") + " --out " + path("d.tokens"));
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_TRUE(has(bad.out, path("in/sub/b.jsonl") + ":1: no field \"text\" (the object has "
                                                    "\"body\"); name the text's field with "
                                                    "--field"))
      << bad.out;
  EXPECT_FALSE(fs::exists(path("d.tokens")));
  Outcome help = run("prepare --help");
  EXPECT_TRUE(has(help.out, "--field")) << help.out;
}

}  // namespace
}  // namespace headroom
