// Hugging Face style save/load of GPT-2 weights.
#include "model/weights.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

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

Status save_pretrained(const std::string& dir, const Gpt2Config& config, const ParamTable& table,
                       const float* params) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Status::io_error(
        fmt::format("cannot create output directory '{}': {}", dir, ec.message()));
  }
  std::vector<SafetensorsTensor> tensors;
  tensors.reserve(table.params.size());
  for (const ParamDesc& p : table.params) {
    tensors.push_back(
        {p.name, DType::kF32, p.shape, params + p.offset, size_t(p.shape.numel()) * sizeof(float)});
  }
  HR_RETURN_IF_ERROR(write_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}}));
  return write_text_atomically(dir + "/config.json", config.to_json());
}

Status load_weights(const std::string& path, const ParamTable& table, float* params) {
  HR_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(path));
  for (const ParamDesc& p : table.params) {
    const SafetensorsTensor* t = file.find(p.name);
    if (!t) t = file.find("transformer." + p.name);
    if (!t) {
      return Status::invalid_argument(fmt::format(
          "{}: tensor '{}' is missing (is this a GPT-2 checkpoint with the same config?)", path,
          p.name));
    }
    if (!(t->shape == p.shape)) {
      return Status::invalid_argument(
          fmt::format("{}: tensor '{}' has shape {}, the config needs {}", path, p.name,
                      t->shape.to_string(), p.shape.to_string()));
    }
    float* dst = params + p.offset;
    const int64_t n = p.shape.numel();
    const auto* src = static_cast<const unsigned char*>(t->data);
    switch (t->dtype) {
      case DType::kF32:
        std::memcpy(dst, src, size_t(n) * 4);
        break;
      case DType::kBF16:
      case DType::kF16:
        for (int64_t i = 0; i < n; i++) {
          uint16_t h;
          std::memcpy(&h, src + 2 * i, 2);
          dst[i] = t->dtype == DType::kBF16 ? bf16_bits_to_f32(h) : f16_bits_to_f32(h);
        }
        break;
      default:
        return Status::unsupported(
            fmt::format("{}: tensor '{}' has dtype {}; weights must be F32, "
                        "BF16 or F16",
                        path, p.name, dtype_safetensors_name(t->dtype)));
    }
  }
  return Status::ok();
}

}  // namespace headroom::model
