// Fuzzes the Hugging Face config.json parser: any text gives a config that validates, round-trips
// through to_json and has a parameter table, or an error naming the file; never a crash.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "model/config.h"
#include "model/gpt2.h"

using namespace headroom;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  Result<model::Gpt2Config> c = model::parse_config_json(text, "fuzz/config.json");
  if (!c.is_ok()) {
    fuzz::expect_names(c.status(), "fuzz/config.json");
    return 0;
  }
  Status valid = c->validate();
  if (!valid.is_ok()) fuzz::fail("an accepted config does not validate", valid.to_string());

  // What we write, we read back unchanged.
  Result<model::Gpt2Config> again = model::parse_config_json(c->to_json(), "round trip");
  if (!again.is_ok())
    fuzz::fail("to_json of an accepted config is refused", again.status().to_string());
  if (again->to_json() != c->to_json()) fuzz::fail("config round trip changed it", c->to_json());

  // An accepted config must be one the model code can size without overflow or a huge table.
  model::ParamTable table = model::gpt2_param_table(*c);
  if (table.total_floats <= 0 || table.num_parameters <= 0 ||
      table.num_parameters > table.total_floats) {
    fuzz::fail("parameter table of an accepted config is inconsistent", c->to_json());
  }
  return 0;
}
