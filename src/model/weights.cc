// Hugging Face style save/load of the transformer's weights (single file or sharded).
#include "model/weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "core/utf8.h"
#include "model/safetensors.h"

namespace headroom::model {

namespace {
Status write_text_atomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f)
      return Status::io_error(fmt::format("cannot write '{}': {}", tmp, std::strerror(errno)));
    f << text;
    f.flush();
    if (!f) {
      std::filesystem::remove(tmp);
      return Status::io_error(fmt::format("writing '{}' failed (disk full?)", tmp));
    }
  }
  int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    return Status::io_error(fmt::format("cannot rename '{}' to '{}': {}", tmp, path, ec.message()));
  }
  return Status::ok();
}
}  // namespace

namespace {

// Copies tensor `t` (F32, BF16 or F16) of `path` into dst as fp32, checking its shape.
Status copy_tensor(const std::string& path, const ParamDesc& p, const SafetensorsTensor& t,
                   float* dst) {
  if (!(t.shape == p.shape)) {
    return Status::invalid_argument(fmt::format("{}: tensor '{}' has shape {}, the config needs {}",
                                                path, p.name, t.shape.to_string(),
                                                p.shape.to_string()));
  }
  const int64_t n = p.shape.numel();
  const auto* src = static_cast<const unsigned char*>(t.data);
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(dst, src, size_t(n) * 4);
      break;
    case DType::kBF16:
    case DType::kF16:
      for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        dst[i] = t.dtype == DType::kBF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
      }
      break;
    default:
      return Status::unsupported(
          fmt::format("{}: tensor '{}' has dtype {}; weights must be F32, BF16 or F16", path,
                      p.name, dtype_safetensors_name(t.dtype)));
  }
  return Status::ok();
}

// The tensor of parameter p in `file`: its Hugging Face name, or with GPT-2's "transformer."
// prefix.
const SafetensorsTensor* find_param(const SafetensorsFile& file, const ParamDesc& p) {
  const SafetensorsTensor* t = file.find(p.name);
  if (!t) t = file.find("transformer." + p.name);
  return t;
}

}  // namespace

Status save_pretrained(const std::string& dir, const Gpt2Config& config, const ParamTable& table,
                       const float* params, uint64_t max_shard_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Status::io_error(
        fmt::format("cannot create output directory '{}': {}", dir, ec.message()));
  }
  // Shards: tensors in table order, a new shard when the next tensor would pass the limit (a
  // tensor larger than the limit gets a shard of its own), as Hugging Face's save_pretrained.
  std::vector<std::vector<SafetensorsTensor>> shards(1);
  uint64_t shard_bytes = 0, total = 0;
  for (const ParamDesc& p : table.params) {
    const size_t bytes = size_t(p.shape.numel()) * sizeof(float);
    if (max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back({p.name, DType::kF32, p.shape, params + p.offset, bytes});
    shard_bytes += bytes;
    total += bytes;
  }
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (shards.size() == 1) {
    HR_RETURN_IF_ERROR(
        write_safetensors(dir + "/model.safetensors", shards[0], {{"format", "pt"}}));
    std::filesystem::remove(index_path, ec);  // a stale index would name other files
  } else {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    nlohmann::ordered_json map = nlohmann::ordered_json::object();
    const size_t n = shards.size();
    for (size_t i = 0; i < n; i++) {
      const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
      HR_RETURN_IF_ERROR(write_safetensors(dir + "/" + name, shards[i], {{"format", "pt"}}));
      for (const SafetensorsTensor& t : shards[i]) map[t.name] = name;
    }
    index["weight_map"] = std::move(map);
    HR_RETURN_IF_ERROR(write_text_atomically(index_path, dump_json(index, 2) + "\n"));
    std::filesystem::remove(dir + "/model.safetensors", ec);
  }
  return write_text_atomically(dir + "/config.json", config.to_json());
}

Status load_weights(const std::string& path, const ParamTable& table, float* params) {
  HR_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  for (const ParamDesc& p : table.params) {
    const SafetensorsTensor* t = find_param(file, p);
    if (!t) {
      return Status::invalid_argument(fmt::format(
          "{}: tensor '{}' is missing (is this a checkpoint of the same model and config?)", path,
          p.name));
    }
    HR_RETURN_IF_ERROR(copy_tensor(path, p, *t, params + p.offset));
  }
  return Status::ok();
}

Status load_pretrained(const std::string& dir, const ParamTable& table, float* params) {
  namespace fs = std::filesystem;
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::error_code ec;
  if (!fs::exists(index_path, ec)) return load_weights(dir + "/model.safetensors", table, params);
  std::ifstream f(index_path);
  if (!f) return Status::not_found(fmt::format("cannot open '{}'", index_path));
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    return Status::invalid_argument(fmt::format("{}: not valid JSON: {}", index_path, e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return Status::invalid_argument(
        fmt::format("{}: field 'weight_map' is missing or not an object", index_path));
  }
  const nlohmann::json& map = index["weight_map"];
  // Group the parameters by shard so that each file is opened (mapped) once.
  std::map<std::string, std::vector<const ParamDesc*>> by_shard;
  for (const ParamDesc& p : table.params) {
    const char* names[] = {p.name.c_str(), nullptr};
    std::string prefixed = "transformer." + p.name;
    names[1] = prefixed.c_str();
    const nlohmann::json* file = nullptr;
    for (const char* n : names) {
      if (map.contains(n)) {
        file = &map[n];
        break;
      }
    }
    if (!file) {
      return Status::invalid_argument(fmt::format(
          "{}: weight_map has no entry for tensor '{}' (is this a checkpoint of the same model "
          "and config?)",
          index_path, p.name));
    }
    if (!file->is_string() || file->get<std::string>().empty() ||
        file->get<std::string>().find('/') != std::string::npos ||
        file->get<std::string>().find("..") != std::string::npos) {
      return Status::invalid_argument(
          fmt::format("{}: weight_map['{}'] must be the name of a file in the same directory",
                      index_path, p.name));
    }
    by_shard[file->get<std::string>()].push_back(&p);
  }
  for (const auto& [name, ps] : by_shard) {
    const std::string path = dir + "/" + name;
    HR_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
    for (const ParamDesc* p : ps) {
      const SafetensorsTensor* t = find_param(file, *p);
      if (!t) {
        return Status::invalid_argument(
            fmt::format("{}: tensor '{}' is missing, though {} names this file for it", path,
                        p->name, index_path));
      }
      HR_RETURN_IF_ERROR(copy_tensor(path, *p, *t, params + p->offset));
    }
  }
  return Status::ok();
}

}  // namespace headroom::model
