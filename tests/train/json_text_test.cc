// trainer_state.json stays valid JSON whatever bytes the data path holds, and the checkpoint loads
// back with the path as core/utf8.h's valid_utf8 of it (docs/notes/json-text.md; issue #26).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "../json_text_cases.h"
#include "core/utf8.h"
#include "model/gpt2.h"
#include "train/checkpoint.h"
#include "train_test_util.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

TEST(JsonText, TrainerStateJsonParsesWithArbitraryBytesInTheDataPath) {
  const fs::path dir = train::test::fresh_test_dir("headroom_json_text");
  const model::Gpt2Config cfg = train::test::tiny_config();
  const model::ParamTable table = model::gpt2_param_table(cfg);
  const std::vector<float> zeros(size_t(table.total_floats), 0.0f);
  for (const std::string& s : test::json_text_cases(20)) {
    // Each checkpoint is fsync'ed: of the single bytes, only a few (the other tests take all).
    if (s.size() == 1 && s != "\x80" && s != "\xC3" && s != "\xFF" && s != "a") continue;
    train::CheckpointView v{&cfg, &table, zeros.data(), zeros.data(), zeros.data(), {}};
    v.state.step = 1;
    v.state.total_steps = 2;
    v.state.micro_batch = 1;
    v.state.accumulation = 1;
    v.state.seq = 16;
    v.state.data = s;
    Result<std::string> written = train::save_checkpoint((dir / "ck").string(), v, 1);
    ASSERT_TRUE(written.is_ok()) << testing::PrintToString(s) << ": " << written.status().message();
    std::ifstream in(fs::path(*written) / "trainer_state.json", std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(text.str())) << testing::PrintToString(s);
    EXPECT_EQ(j["data"].get<std::string>(), valid_utf8(s));
    Result<train::LoadedCheckpoint> back = train::find_checkpoint(*written);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(back->state.data, valid_utf8(s));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom
