// safetensors: mmap-based strict reader and atomic writer. The reader validates everything a
// later kernel would otherwise trust blindly (offsets, sizes), so that a corrupt or truncated
// checkpoint is a clear error at load time instead of a crash or garbage mid-run.
#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "core/utf8.h"

namespace headroom::model {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swapping");

using json = nlohmann::json;

// A header this large is not a real model's header (GPT-2 XL's is ~30 KB); refusing it bounds the
// memory a corrupt length field can make us spend on JSON parsing. Matches the reference limit.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr std::string_view kMetadataKey = "__metadata__";

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// dtypes that the safetensors format defines but headroom does not compute in: a file holding
// them is valid, just not usable here.
bool is_other_safetensors_dtype(std::string_view name) {
  static constexpr std::string_view kNames[] = {"BOOL",    "U8",  "I8",      "F8_E5M2", "F8_E4M3",
                                                "F8_E8M0", "I16", "U32",     "F64",     "U64",
                                                "C64",     "F4",  "F6_E2M3", "F6_E3M2"};
  return std::find(std::begin(kNames), std::end(kNames), name) != std::end(kNames);
}

// a * b, or false on uint64 overflow.
bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// A header value for an error message: a flat array of scalars as written, anything else
// described, at most ~80 characters. Not json::dump of the whole value: that recurses once per
// nesting level, and a header may nest deeply enough to exhaust the stack.
std::string shape_json_text(const json& value) {
  auto scalar = [](const json& v) -> std::string {
    if (v.is_array()) return "[...]";
    if (v.is_object()) return "{...}";
    try {
      std::string text = dump_json(v);
      if (text.size() <= 24) return text;
      size_t n = 21;  // cut at a UTF-8 character boundary: the message may be written as JSON
      while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) n--;
      return text.substr(0, n) + "...";
    } catch (const json::exception&) {
      return "?";
    }
  };
  if (!value.is_array()) return scalar(value);
  std::string text = "[";
  for (const json& v : value) {
    if (text.size() > 1) text += ", ";
    if (text.size() > 80) return text + "...]";
    text += scalar(v);
  }
  return text + "]";
}

struct ParsedEntry {
  SafetensorsTensor tensor;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Validates one header entry (everything but its relation to other entries).
Status parse_entry(const std::string& file, const std::string& name, const json& entry,
                   uint64_t data_bytes, ParsedEntry* out) {
  auto bad = [&](const std::string& what) {
    return Status::corrupt(file + ": tensor '" + name + "': " + what);
  };
  if (!entry.is_object())
    return bad("header entry is " + std::string(entry.type_name()) +
               ", expected an object with dtype, shape, data_offsets");
  auto dtype_it = entry.find("dtype");
  auto shape_it = entry.find("shape");
  auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end()) return bad("missing field 'dtype'");
  if (shape_it == entry.end()) return bad("missing field 'shape'");
  if (offsets_it == entry.end()) return bad("missing field 'data_offsets'");

  if (!dtype_it->is_string()) return bad("field 'dtype' is not a string");
  const std::string dtype_name = dtype_it->get<std::string>();
  Result<DType> dtype = dtype_from_safetensors_name(dtype_name);
  if (!dtype.is_ok()) {
    if (is_other_safetensors_dtype(dtype_name)) {
      return Status::unsupported(file + ": tensor '" + name + "': dtype " + dtype_name +
                                 " is valid safetensors but headroom reads only F32, BF16, F16, "
                                 "I32, U16 and I64; convert the file");
    }
    return bad("unknown dtype '" + dtype_name + "'");
  }

  if (!shape_it->is_array()) return bad("field 'shape' is not an array");
  std::vector<int64_t> dims;
  uint64_t numel = 1;
  for (const json& d : *shape_it) {
    if (!d.is_number_integer()) {
      return bad("shape " + shape_json_text(*shape_it) + " has a non-integer dimension");
    }
    if (!d.is_number_unsigned()) {
      return bad("shape " + shape_json_text(*shape_it) + " has a negative dimension");
    }
    const uint64_t dim = d.get<uint64_t>();
    // Every partial product within int64, as Shape::numel computes it in int64.
    if (dim > uint64_t(INT64_MAX) || !checked_mul(numel, dim, &numel) ||
        numel > uint64_t(INT64_MAX)) {
      return bad("shape " + shape_json_text(*shape_it) + " is too large");
    }
    dims.push_back(int64_t(dim));
  }
  uint64_t expected_bytes = 0;
  if (!checked_mul(numel, dtype_size(*dtype), &expected_bytes)) {
    return bad("shape " + shape_json_text(*shape_it) + " is too large");
  }

  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    return bad("field 'data_offsets' is " + shape_json_text(*offsets_it) +
               ", expected [begin, end] with non-negative integers");
  }
  const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
  const uint64_t end = (*offsets_it)[1].get<uint64_t>();
  const std::string offsets_text = "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
  if (begin > end) return bad("data_offsets " + offsets_text + " has begin after end");
  if (end > data_bytes) {
    return bad("data_offsets " + offsets_text + " extend beyond the data section (" +
               std::to_string(data_bytes) + " bytes); the file may be truncated");
  }
  if (end - begin != expected_bytes) {
    return bad("shape " + shape_json_text(*shape_it) + " with dtype " + dtype_name + " needs " +
               std::to_string(expected_bytes) + " bytes but data_offsets " + offsets_text +
               " span " + std::to_string(end - begin));
  }

  out->tensor.name = name;
  out->tensor.dtype = *dtype;
  out->tensor.shape = Shape(std::move(dims));
  out->tensor.bytes = size_t(expected_bytes);
  out->begin = begin;
  out->end = end;
  return Status::ok();
}

// Writes all of [p, p + n) to fd, retrying short writes and EINTR.
Status write_all(int fd, const void* p, size_t n, const std::string& file) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::io_error(file + ": write failed: " + errno_text(errno));
    }
    c += w;
    n -= size_t(w);
  }
  return Status::ok();
}

Status validate_for_write(std::span<const SafetensorsTensor> tensors) {
  std::set<std::string_view> names;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty()) return Status::invalid_argument("safetensors: a tensor has an empty name");
    if (t.name == kMetadataKey) {
      return Status::invalid_argument("safetensors: tensor name '__metadata__' is reserved");
    }
    if (!names.insert(t.name).second) {
      return Status::invalid_argument("safetensors: tensor name '" + t.name + "' appears twice");
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape.dims()) {
      if (d < 0 || !checked_mul(numel, uint64_t(d), &numel)) {
        return Status::invalid_argument("safetensors: tensor '" + t.name + "': shape " +
                                        t.shape.to_string() + " is invalid");
      }
    }
    uint64_t bytes = 0;
    if (!checked_mul(numel, dtype_size(t.dtype), &bytes) || bytes != t.bytes) {
      return Status::invalid_argument(
          "safetensors: tensor '" + t.name + "': shape " + t.shape.to_string() + " with dtype " +
          std::string(dtype_safetensors_name(t.dtype)) + " needs " + std::to_string(bytes) +
          " bytes but bytes = " + std::to_string(t.bytes));
    }
    if (t.bytes > 0 && t.data == nullptr) {
      return Status::invalid_argument("safetensors: tensor '" + t.name + "' has null data");
    }
  }
  return Status::ok();
}

}  // namespace

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    // The tensors point into the mapping, whose address does not change when it changes owner.
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
    other.tensors_.clear();
    other.metadata_.clear();
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { reset(); }

void SafetensorsFile::reset() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tensors_.clear();
  metadata_.clear();
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const SafetensorsTensor& t, std::string_view n) { return std::string_view(t.name) < n; });
  if (it == tensors_.end() || it->name != name) return nullptr;
  return &*it;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  SafetensorsFile file;
  file.path_ = path;

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::not_found(path + ": safetensors file does not exist");
    return Status::io_error(path + ": cannot open: " + errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::io_error(path + ": cannot stat: " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::io_error(path + ": not a regular file");
  }
  const uint64_t size = uint64_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Status::corrupt(path + ": file is " + std::to_string(size) +
                           " bytes, shorter than the 8-byte header length; not a safetensors file");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) return Status::io_error(path + ": mmap failed: " + errno_text(map_err));
  file.map_ = map;
  file.map_bytes_ = size;
  const auto* base = static_cast<const unsigned char*>(map);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; i--) header_bytes = (header_bytes << 8) | base[i];
  if (header_bytes > kMaxHeaderBytes) {
    return Status::corrupt(path + ": header length " + std::to_string(header_bytes) +
                           " is absurd (limit " + std::to_string(kMaxHeaderBytes) +
                           "); not a safetensors file");
  }
  if (header_bytes > size - 8) {
    return Status::corrupt(path + ": header length " + std::to_string(header_bytes) +
                           " extends beyond the end of the file (" + std::to_string(size) +
                           " bytes); the file is truncated");
  }
  const char* header = reinterpret_cast<const char*>(base + 8);
  const unsigned char* data = base + 8 + header_bytes;
  const uint64_t data_bytes = size - 8 - header_bytes;

  // nlohmann keeps the last of duplicate keys silently; two tensors with one name is corruption.
  std::set<std::string> seen;
  std::string duplicate;
  json root;
  try {
    root = json::parse(header, header + header_bytes,
                       [&](int depth, json::parse_event_t event, json& parsed) {
                         if (depth == 1 && event == json::parse_event_t::key) {
                           std::string key = parsed.get<std::string>();
                           if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
                         }
                         return true;
                       });
  } catch (const json::exception& e) {
    return Status::corrupt(path + ": header is not valid JSON: " + e.what());
  }
  if (!root.is_object()) {
    return Status::corrupt(path + ": header is a JSON " + std::string(root.type_name()) +
                           ", expected an object");
  }
  if (!duplicate.empty()) {
    return Status::corrupt(path + ": tensor '" + duplicate + "' appears twice in the header");
  }

  std::vector<ParsedEntry> entries;
  entries.reserve(root.size());
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == kMetadataKey) {
      if (!it->is_object()) {
        return Status::corrupt(path + ": '__metadata__' is " + std::string(it->type_name()) +
                               ", expected an object of strings");
      }
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Status::corrupt(path + ": '__metadata__' entry '" + m.key() + "' is " +
                                 std::string(m->type_name()) + ", expected a string");
        }
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    ParsedEntry entry;
    HR_RETURN_IF_ERROR(parse_entry(path, it.key(), *it, data_bytes, &entry));
    entry.tensor.data = data + entry.begin;
    entries.push_back(std::move(entry));
  }

  // The reference implementation requires the tensors to tile the data section exactly; a gap
  // or an overlap means the header and the data disagree.
  std::vector<const ParsedEntry*> by_offset;
  for (const ParsedEntry& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const ParsedEntry* a, const ParsedEntry* b) {
    return std::tie(a->begin, a->end) < std::tie(b->begin, b->end);
  });
  uint64_t covered = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry* e : by_offset) {
    if (e->begin < covered) {
      return Status::corrupt(path + ": tensor '" + e->tensor.name + "': data_offsets [" +
                             std::to_string(e->begin) + ", " + std::to_string(e->end) +
                             "] overlap tensor '" + previous->tensor.name + "' (ends at " +
                             std::to_string(covered) + ")");
    }
    if (e->begin > covered) {
      return Status::corrupt(path + ": tensor '" + e->tensor.name + "': data_offsets begin at " +
                             std::to_string(e->begin) + " leaving a gap after byte " +
                             std::to_string(covered) + " of the data section");
    }
    covered = e->end;
    previous = e;
  }
  if (covered != data_bytes) {
    return Status::corrupt(path + ": the data section has " + std::to_string(data_bytes) +
                           " bytes but the tensors cover only " + std::to_string(covered));
  }

  file.tensors_.reserve(entries.size());
  for (ParsedEntry& e : entries) file.tensors_.push_back(std::move(e.tensor));
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) { return a.name < b.name; });
  return file;
}

Status write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                         const std::map<std::string, std::string>& metadata) {
  HR_RETURN_IF_ERROR(validate_for_write(tensors).with_context(path));

  // ordered_json keeps "__metadata__" first and the tensors in the order given, as the reference
  // writer does; readers do not depend on the order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    header[t.name] = {{"dtype", std::string(dtype_safetensors_name(t.dtype))},
                      {"shape", t.shape.dims()},
                      {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {  // e.g. a name that is not valid UTF-8
    return Status::invalid_argument(path + ": cannot encode safetensors header: " + e.what());
  }
  // Pad with spaces (valid trailing JSON whitespace) so the data section starts 8-byte aligned.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  unsigned char length[8];
  for (int i = 0; i < 8; i++) length[i] = static_cast<unsigned char>(header_text.size() >> (8 * i));

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::io_error(tmp + ": cannot create: " + errno_text(errno));
  auto fail = [&](Status s) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  Status s = write_all(fd, length, sizeof(length), tmp);
  if (s.is_ok()) s = write_all(fd, header_text.data(), header_text.size(), tmp);
  for (const SafetensorsTensor& t : tensors) {
    if (!s.is_ok()) break;
    s = write_all(fd, t.data, t.bytes, tmp);
  }
  if (!s.is_ok()) return fail(s);
  if (::fsync(fd) != 0) return fail(Status::io_error(tmp + ": fsync failed: " + errno_text(errno)));
  const int close_rc = ::close(fd);
  fd = -1;
  if (close_rc != 0) return fail(Status::io_error(tmp + ": close failed: " + errno_text(errno)));
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return fail(
        Status::io_error(path + ": cannot rename " + tmp + " over it: " + errno_text(errno)));
  }

  // Make the rename itself durable.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd < 0)
    return Status::io_error(dir + ": cannot open directory to fsync: " + errno_text(errno));
  const int dir_rc = ::fsync(dir_fd);
  const int dir_err = errno;
  ::close(dir_fd);
  // Some file systems do not support fsync on a directory (EINVAL); the data itself is synced.
  if (dir_rc != 0 && dir_err != EINVAL) {
    return Status::io_error(dir + ": fsync of directory failed: " + errno_text(dir_err));
  }
  return Status::ok();
}

}  // namespace headroom::model
