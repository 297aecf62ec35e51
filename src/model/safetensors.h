// Reading and writing safetensors files, the weight format of the Hugging Face ecosystem: model
// weights, checkpoints and the golden fixtures produced by tools/reference/ all use it.
//
// Layout: an 8-byte little-endian uint64 N, N bytes of JSON header, then the data section.
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) and may hold "__metadata__": {string: string}.
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "core/tensor.h"

namespace headroom::model {

// One tensor of a safetensors file. For a file opened with SafetensorsFile::open, `data` points
// into the read-only mapping and lives as long as the SafetensorsFile. For write_safetensors,
// `data` is the caller's memory and must hold `bytes` bytes (it may be null when bytes == 0).
// The data is little-endian; `data` is aligned to dtype_size(dtype) when the writer padded the
// header and ordered the tensors so (write_safetensors and the reference writer pad the header to
// 8 bytes; the reference also orders tensors by alignment). Callers needing alignment must check
// it or copy.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;  // rank 0 is a scalar (one element)
  const void* data = nullptr;
  size_t bytes = 0;  // == shape.numel() * dtype_size(dtype)
};

// A safetensors file mapped read-only. Movable, not copyable; unmaps in the destructor.
// Thread-compatible: const methods may be called concurrently.
class SafetensorsFile {
 public:
  // Maps `path` and validates the whole header before returning: header length, JSON syntax,
  // duplicate names, dtypes, shapes, offsets (within the data section, matching
  // numel * dtype size, no overlaps, no gaps, covering the data section exactly, as the reference
  // implementation requires). Errors: NotFound if the file does not exist, IoError if it cannot
  // be read or mapped, Corrupt (naming the file, the tensor and the problem) if it is malformed
  // or has an unknown dtype, Unsupported if a tensor has a valid safetensors dtype that headroom
  // does not compute in (F64, U8, BOOL, ...).
  static Result<SafetensorsFile> open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // The tensor called `name`, or null. O(log n).
  const SafetensorsTensor* find(std::string_view name) const;
  // All tensors, sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // The "__metadata__" entries (empty if the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Size of the whole file in bytes.
  size_t file_bytes() const { return map_bytes_; }

 private:
  SafetensorsFile() = default;
  void reset();

  std::string path_;
  void* map_ = nullptr;  // from mmap, or null for an empty mapping
  size_t map_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (laid out contiguously in the order given) and `metadata` to `path`
// atomically: writes `path + ".tmp.<pid>"`, fsyncs it, renames it over `path`, fsyncs the
// directory. On failure the temporary file is removed and `path` is untouched. The header JSON
// is padded with spaces so that the data section starts at an 8-byte offset, as the reference
// implementation does. Errors: InvalidArgument (empty, duplicate or reserved name, bytes not
// matching the shape, negative dimension, null data), IoError (open, write, fsync, rename).
Status write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                         const std::map<std::string, std::string>& metadata = {});

}  // namespace headroom::model
