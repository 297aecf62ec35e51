// Checkpoint writing, finding and loading.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include <fmt/format.h>

#include "core/utf8.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace headroom::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kStateVersion = 1;

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::vector<fs::path> checkpoint_dirs(const fs::path& root) {
  std::vector<fs::path> dirs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_directory() && name.rfind("step-", 0) == 0 && name.size() == 11)
      dirs.push_back(e.path());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

json state_json(const TrainerState& s) {
  json j = {{"version", kStateVersion},
            {"step", s.step},
            {"data_position", s.data_position},
            {"total_steps", s.total_steps},
            {"warmup_steps", s.warmup_steps},
            {"lr", s.lr},
            {"min_lr_ratio", s.min_lr_ratio},
            {"micro_batch", s.micro_batch},
            {"accumulation", s.accumulation},
            {"seq", s.seq},
            {"seed", s.seed},
            {"data", s.data},
            {"batching", s.batching},
            {"bucket", s.bucket},
            {"data_order", s.data_order}};
  if (s.loss_scale) {
    j["loss_scale"] = {{"scale", s.loss_scale->scale},
                       {"good_steps", s.loss_scale->good_steps},
                       {"skipped", s.loss_scale->skipped}};
  }
  return j;
}

// A JSON value for an error message: scalars as written, containers and long strings shortened.
// Never recursive (json::dump is), so a deeply nested value cannot exhaust the stack.
std::string describe(const json& v) {
  if (v.is_array()) return fmt::format("an array of {} elements", v.size());
  if (v.is_object()) return fmt::format("an object of {} fields", v.size());
  std::string text = dump_json(v);
  if (text.size() <= 40) return text;
  size_t n = 37;  // cut at a UTF-8 character boundary: the message may be written as JSON
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) n--;
  return text.substr(0, n) + "...";
}

// Reads the fields of trainer_state.json, each checked for type and range before it is converted
// (a float or an out-of-range integer must not reach a narrowing conversion), every error naming
// the file, the field and the value.
class StateFields {
 public:
  StateFields(const json& j, const std::string& path) : j_(j), path_(path) {}

  Status integer(const char* name, int64_t lo, int64_t hi, int64_t* out) const {
    HR_ASSIGN_OR_RETURN(const json* v, get(name));
    bool ok = false;
    if (v->is_number_unsigned()) {  // before is_number_integer, which is true for both
      const uint64_t u = v->get<uint64_t>();
      ok = u <= uint64_t(hi) && int64_t(u) >= lo;
    } else if (v->is_number_integer()) {
      ok = v->get<int64_t>() >= lo && v->get<int64_t>() <= hi;
    }
    if (!ok) return bad(name, *v, fmt::format("an integer in [{}, {}]", lo, hi));
    *out = v->get<int64_t>();
    return Status::ok();
  }
  Status integer(const char* name, int lo, int* out) const {
    int64_t v = 0;
    HR_RETURN_IF_ERROR(integer(name, lo, std::numeric_limits<int>::max(), &v));
    *out = int(v);
    return Status::ok();
  }
  Status unsigned_integer(const char* name, uint64_t* out) const {
    HR_ASSIGN_OR_RETURN(const json* v, get(name));
    if (!v->is_number_unsigned()) return bad(name, *v, "a non-negative integer");
    *out = v->get<uint64_t>();
    return Status::ok();
  }
  Status number(const char* name, double lo, double hi, float* out) const {
    HR_ASSIGN_OR_RETURN(const json* v, get(name));
    if (!v->is_number() || !(v->get<double>() >= lo && v->get<double>() <= hi)) {
      return bad(name, *v, fmt::format("a number in [{}, {}]", lo, hi));
    }
    *out = float(v->get<double>());
    return Status::ok();
  }
  Status string(const char* name, std::string* out) const {
    HR_ASSIGN_OR_RETURN(const json* v, get(name));
    if (!v->is_string()) return bad(name, *v, "a string");
    *out = v->get<std::string>();
    return Status::ok();
  }
  Status bad(const char* name, const json& v, const std::string& expected) const {
    return Status::corrupt(
        fmt::format("{}: field '{}' = {} must be {}", path_, name, describe(v), expected));
  }

 private:
  Result<const json*> get(const char* name) const {
    auto it = j_.find(name);
    if (it == j_.end()) {
      return Status::corrupt(fmt::format("{}: missing field '{}'", path_, name));
    }
    return &*it;
  }
  const json& j_;
  const std::string& path_;
};

Result<TrainerState> parse_state(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found(fmt::format("checkpoint state '{}' is missing", path));
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    return Status::corrupt(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  if (!j.is_object()) {
    return Status::corrupt(fmt::format("{}: expected a JSON object, found {}", path, describe(j)));
  }
  const StateFields fields(j, path);
  auto version = j.find("version");
  if (version == j.end()) return Status::corrupt(fmt::format("{}: missing field 'version'", path));
  if (!version->is_number_integer() || version->get<int64_t>() != kStateVersion) {
    return Status::unsupported(fmt::format("{}: version {} is not supported (expected {})", path,
                                           describe(*version), kStateVersion));
  }
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  TrainerState s;
  HR_RETURN_IF_ERROR(fields.integer("step", 0, &s.step));
  HR_RETURN_IF_ERROR(
      fields.integer("data_position", 0, std::numeric_limits<int64_t>::max(), &s.data_position));
  HR_RETURN_IF_ERROR(fields.integer("total_steps", 0, &s.total_steps));
  HR_RETURN_IF_ERROR(fields.integer("warmup_steps", 0, &s.warmup_steps));
  HR_RETURN_IF_ERROR(fields.number("lr", 0, std::numeric_limits<float>::max(), &s.lr));
  HR_RETURN_IF_ERROR(fields.number("min_lr_ratio", 0, 1, &s.min_lr_ratio));
  HR_RETURN_IF_ERROR(fields.integer("micro_batch", 1, &s.micro_batch));
  HR_RETURN_IF_ERROR(fields.integer("accumulation", 1, &s.accumulation));
  HR_RETURN_IF_ERROR(fields.integer("seq", 1, &s.seq));
  HR_RETURN_IF_ERROR(fields.unsigned_integer("seed", &s.seed));
  HR_RETURN_IF_ERROR(fields.string("data", &s.data));
  if (j.contains("batching")) {
    HR_RETURN_IF_ERROR(fields.string("batching", &s.batching));
    if (s.batching != "packed" && s.batching != "bucketed") {
      return Status::corrupt(fmt::format("{}: field 'batching' = \"{}\" must be packed or bucketed",
                                         path, s.batching));
    }
    if (s.batching == "bucketed") HR_RETURN_IF_ERROR(fields.integer("bucket", 1, &s.bucket));
  }
  if (j.contains("data_order")) {
    HR_RETURN_IF_ERROR(fields.string("data_order", &s.data_order));
    if (s.data_order != "shuffled" && s.data_order != "sequential") {
      return Status::corrupt(fmt::format(
          "{}: field 'data_order' = \"{}\" must be shuffled or sequential", path, s.data_order));
    }
  }
  if (auto ls = j.find("loss_scale"); ls != j.end()) {
    if (!ls->is_object()) return fields.bad("loss_scale", *ls, "an object");
    const std::string sub = path + " (loss_scale)";
    const StateFields lf(*ls, sub);
    LossScaleState st;
    HR_RETURN_IF_ERROR(lf.number("scale", 1, 16777216.0, &st.scale));
    HR_RETURN_IF_ERROR(lf.integer("good_steps", 0, &st.good_steps));
    HR_RETURN_IF_ERROR(lf.integer("skipped", 0, std::numeric_limits<int64_t>::max(), &st.skipped));
    s.loss_scale = st;
  }
  // The global batch, micro_batch x accumulation, is an int wherever it is used.
  if (int64_t(s.micro_batch) * s.accumulation > kMaxInt) {
    return Status::corrupt(fmt::format(
        "{}: field 'accumulation' = {} with 'micro_batch' = {} gives a global batch beyond {}",
        path, s.accumulation, s.micro_batch, kMaxInt));
  }
  return s;
}

}  // namespace

Result<std::string> save_checkpoint(const std::string& root, const CheckpointView& c, int keep) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::io_error(fmt::format("cannot create '{}': {}", root, ec.message()));
  const std::string name = fmt::format("step-{:06d}", c.state.step);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp = fs::path(root) / (".tmp-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(tmp, ec);
  auto fail = [&](Status s) {
    fs::remove_all(tmp, ec);
    return s;
  };
  Status s = model::save_pretrained(tmp.string(), *c.config, *c.table, c.params);
  if (!s.is_ok()) return fail(s.with_context("writing checkpoint " + final_dir.string()));
  const int64_t P = c.table->total_floats;
  std::vector<model::SafetensorsTensor> opt = {
      {"adam_m", DType::kF32, Shape{P}, c.adam_m, size_t(P) * 4},
      {"adam_v", DType::kF32, Shape{P}, c.adam_v, size_t(P) * 4}};
  s = model::write_safetensors((tmp / "optimizer.safetensors").string(), opt,
                               {{"layout", "headroom flat parameter buffer"}});
  if (!s.is_ok()) return fail(s.with_context("writing checkpoint " + final_dir.string()));
  {
    std::ofstream f(tmp / "trainer_state.json");
    f << dump_json(state_json(c.state), 2) << "\n";
    f.flush();
    if (!f) return fail(Status::io_error("writing trainer_state.json failed (disk full?)"));
  }
  fsync_path(tmp / "trainer_state.json");
  fsync_path(tmp);
  fs::remove_all(final_dir, ec);  // a checkpoint of the same step from an earlier attempt
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    return fail(Status::io_error(fmt::format("cannot rename '{}' to '{}': {}", tmp.string(),
                                             final_dir.string(), ec.message())));
  }
  fsync_path(root);
  if (keep > 0) {
    std::vector<fs::path> dirs = checkpoint_dirs(root);
    for (size_t i = 0; i + size_t(keep) < dirs.size(); i++) fs::remove_all(dirs[i], ec);
  }
  return final_dir.string();
}

Result<LoadedCheckpoint> find_checkpoint(const std::string& path) {
  fs::path dir = path;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return Status::not_found(fmt::format("--resume '{}' is not a directory", path));
  }
  if (!fs::exists(dir / "trainer_state.json")) {
    fs::path root = fs::exists(dir / "checkpoints") ? dir / "checkpoints" : dir;
    std::vector<fs::path> dirs = checkpoint_dirs(root);
    if (dirs.empty()) {
      return Status::not_found(fmt::format(
          "no checkpoint in '{}' (expected a step-NNNNNN directory, or checkpoints/ holding them)",
          path));
    }
    dir = dirs.back();
  }
  LoadedCheckpoint c;
  c.dir = dir.string();
  HR_ASSIGN_OR_RETURN(c.config, model::load_config_file((dir / "config.json").string()));
  HR_ASSIGN_OR_RETURN(c.state, parse_state((dir / "trainer_state.json").string()));
  if (c.state.seq > c.config.n_positions) {
    return Status::corrupt(
        fmt::format("{}: field 'seq' = {} exceeds n_positions = {} of the checkpoint's config.json",
                    (dir / "trainer_state.json").string(), c.state.seq, c.config.n_positions));
  }
  return c;
}

Status load_checkpoint(const LoadedCheckpoint& c, const model::ParamTable& table, float* params,
                       float* adam_m, float* adam_v) {
  const std::string opt_path = c.dir + "/optimizer.safetensors";
  HR_ASSIGN_OR_RETURN(model::SafetensorsFile opt, model::SafetensorsFile::open(opt_path));
  const model::SafetensorsTensor* m = opt.find("adam_m");
  const model::SafetensorsTensor* v = opt.find("adam_v");
  const size_t bytes = size_t(table.total_floats) * 4;
  for (const model::SafetensorsTensor* t : {m, v}) {
    if (!t || t->dtype != DType::kF32 || t->bytes != bytes) {
      return Status::corrupt(fmt::format(
          "{}: expected adam_m and adam_v, F32 with {} floats each (does the checkpoint belong to "
          "this model?)",
          opt_path, table.total_floats));
    }
  }
  // Weights are validated and copied by load_weights (names, shapes, dtypes); the moments only
  // after that succeeded.
  HR_RETURN_IF_ERROR(model::load_pretrained(c.dir, table, params));
  std::memcpy(adam_m, m->data, bytes);
  std::memcpy(adam_v, v->data, bytes);
  return Status::ok();
}

}  // namespace headroom::train
