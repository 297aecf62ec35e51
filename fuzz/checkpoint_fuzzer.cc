// Fuzzes checkpoint discovery and loading: config.json, trainer_state.json, model.safetensors and
// optimizer.safetensors of one step-NNNNNN directory. Any contents give a checkpoint that loads,
// or an error naming the file; never a crash or a read outside a file.
//
// Input: the four files in that order, separated by kSeparator; a file absent from the input is
// absent from the directory (fuzz/corpus/checkpoint/ holds a real checkpoint in this format).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "train/checkpoint.h"

using namespace headroom;
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kSeparator = "\n--headroom-fuzz-next-file--\n";
constexpr const char* kFiles[] = {"config.json", "trainer_state.json", "model.safetensors",
                                  "optimizer.safetensors"};
// The caller (the trainer) sizes the buffers by its own config; a fuzzed config could ask for
// any size, so larger ones are checked up to find_checkpoint only.
constexpr int64_t kMaxFloats = int64_t(1) << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::ScratchDir scratch;
  static const std::string run = scratch.path() + "/run";
  static const std::string dir = run + "/checkpoints/step-000007";
  static bool made = [] {
    fs::create_directories(dir);
    return true;
  }();
  (void)made;

  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (const char* name : kFiles) {
    const std::string path = dir + "/" + name;
    if (rest.data() == nullptr) {
      std::error_code ec;
      fs::remove(path, ec);
      continue;
    }
    const size_t cut = rest.find(kSeparator);
    fuzz::write_file(path, rest.substr(0, cut));
    rest =
        cut == std::string_view::npos ? std::string_view() : rest.substr(cut + kSeparator.size());
  }

  // A run's output directory: find_checkpoint looks under checkpoints/ for the newest step.
  Result<train::LoadedCheckpoint> ck = train::find_checkpoint(run);
  if (!ck.is_ok()) {
    fuzz::expect_names(ck.status(), run);
    return 0;
  }
  if (ck->dir != dir) fuzz::fail("find_checkpoint picked another directory", ck->dir);
  Status valid = ck->config.validate();
  if (!valid.is_ok())
    fuzz::fail("an accepted checkpoint config does not validate", valid.to_string());
  const train::TrainerState& s = ck->state;
  if (s.step < 0 || s.data_position < 0 || s.micro_batch <= 0 || s.accumulation <= 0 ||
      s.seq <= 0) {
    fuzz::fail("an accepted trainer state is out of range", dir);
  }
  const model::ParamTable table = model::gpt2_param_table(ck->config);
  if (table.total_floats > kMaxFloats) return 0;
  std::vector<float> params(size_t(table.total_floats)), m(params.size()), v(params.size());
  Status loaded = train::load_checkpoint(*ck, table, params.data(), m.data(), v.data());
  fuzz::expect_names(loaded, dir);
  return 0;
}
