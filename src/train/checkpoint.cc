// Checkpoint writing, finding and loading.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include <fmt/format.h>

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
  return {{"version", kStateVersion},
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
          {"data", s.data}};
}

Result<TrainerState> parse_state(const std::string& path) {
  std::ifstream f(path);
  if (!f) return Status::not_found(fmt::format("checkpoint state '{}' is missing", path));
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    return Status::corrupt(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  TrainerState s;
  try {
    if (j.at("version").get<int>() != kStateVersion) {
      return Status::unsupported(fmt::format("{}: version {} is not supported (expected {})", path,
                                             j.at("version").dump(), kStateVersion));
    }
    s.step = j.at("step").get<int>();
    s.data_position = j.at("data_position").get<int64_t>();
    s.total_steps = j.at("total_steps").get<int>();
    s.warmup_steps = j.at("warmup_steps").get<int>();
    s.lr = j.at("lr").get<float>();
    s.min_lr_ratio = j.at("min_lr_ratio").get<float>();
    s.micro_batch = j.at("micro_batch").get<int>();
    s.accumulation = j.at("accumulation").get<int>();
    s.seq = j.at("seq").get<int>();
    s.seed = j.at("seed").get<uint64_t>();
    s.data = j.at("data").get<std::string>();
  } catch (const json::exception& e) {
    return Status::corrupt(
        fmt::format("{}: a field is missing or has the wrong type ({})", path, e.what()));
  }
  if (s.step < 0 || s.data_position < 0 || s.micro_batch <= 0 || s.accumulation <= 0 ||
      s.seq <= 0) {
    return Status::corrupt(
        fmt::format("{}: step, data_position or the plan is out of range", path));
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
    f << state_json(c.state).dump(2) << "\n";
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
  HR_RETURN_IF_ERROR(model::load_weights(c.dir + "/model.safetensors", table, params));
  std::memcpy(adam_m, m->data, bytes);
  std::memcpy(adam_v, v->data, bytes);
  return Status::ok();
}

}  // namespace headroom::train
