// A model in the layout Hugging Face writes, made by another program
// (tools/reference/hf_sharded_fixture.py: bf16 tensors in two shards, an index, the tensors in
// alphabetical order, a config with the fields transformers adds) loads into the parameter
// table: every tensor's values where the table puts them.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/gpt2.h"
#include "model/weights.h"

namespace headroom::model {
namespace {

const std::string kDir =
    std::string(HEADROOM_SOURCE_DIR) + "/tests/model/fixtures/hf_sharded_llama";

TEST(HfLayout, ShardedBf16LlamaWrittenByAnotherProgramLoads) {
  Result<TransformerConfig> c = load_config_file(kDir + "/config.json");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->kv_heads(), 2);
  EXPECT_FALSE(c->tied_head);
  EXPECT_EQ(c->mlp_width(), 88);
  const ParamTable table = gpt2_param_table(*c);
  std::vector<float> params(size_t(table.total_floats), NAN);
  Status s = load_pretrained(kDir, table, params.data());
  ASSERT_TRUE(s.is_ok()) << s.to_string();

  std::ifstream in(kDir + "/expected.json");
  const nlohmann::json expected = nlohmann::json::parse(in);
  std::set<std::string> seen;
  for (const auto& [name, e] : expected.items()) {
    const ParamDesc* p = table.find(name);
    ASSERT_NE(p, nullptr) << name;
    seen.insert(name);
    EXPECT_EQ(p->shape.dims(), e["shape"].get<std::vector<int64_t>>()) << name;
    const float* v = params.data() + p->offset;
    double sum = 0;
    for (int64_t i = 0; i < p->shape.numel(); i++) sum += v[i];
    EXPECT_NEAR(sum, e["sum"].get<double>(), 1e-9) << name;
    const std::vector<float> first = e["first"].get<std::vector<float>>();
    for (size_t i = 0; i < first.size(); i++) EXPECT_EQ(v[i], first[i]) << name << "[" << i << "]";
  }
  EXPECT_EQ(seen.size(), table.params.size());
}

}  // namespace
}  // namespace headroom::model
