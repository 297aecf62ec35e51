// Buffers described once (llm.c's "memory as a table") and the arena that serves them at their
// offsets from one block. See DESIGN.md principle 1: the code that uses a buffer describes it
// here, the layout gives it an offset, and the executor takes its pointer from the arena.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "memory/resource.h"

namespace headroom::memory {

struct BufferDesc {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  Category category = Category::kOther;

  uint64_t bytes() const { return uint64_t(shape.numel()) * dtype_size(dtype); }
};

// Offsets of a set of buffers inside one block, and the block's size.
struct Layout {
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
};

constexpr uint64_t kBufferAlignment = 64;  // a cache line; also what AVX-512 loads want

// Every buffer gets its own range, one after another (no reuse between buffers).
Layout sequential_layout(const std::vector<BufferDesc>& buffers,
                         uint64_t alignment = kBufferAlignment);

// One block from a resource, carved into buffers at a layout's offsets. Movable, not copyable;
// returns its block to the resource on destruction. Not thread-safe to move while in use.
class Arena {
 public:
  Arena() = default;
  // Allocates layout.size bytes from `resource` (which must outlive the arena), tagged `category`.
  static Result<Arena> create(MemoryResource* resource, std::vector<BufferDesc> buffers,
                              Layout layout, Category category);
  ~Arena();
  Arena(Arena&& o) noexcept;
  Arena& operator=(Arena&& o) noexcept;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  void* data(size_t id) const { return static_cast<char*>(base_) + layout_.offsets[id]; }
  float* f32(size_t id) const { return static_cast<float*>(data(id)); }
  TensorView view(size_t id) const { return {data(id), buffers_[id].dtype, buffers_[id].shape}; }
  const std::vector<BufferDesc>& buffers() const { return buffers_; }
  const Layout& layout() const { return layout_; }
  uint64_t size() const { return layout_.size; }
  void* base() const { return base_; }

 private:
  void release();

  MemoryResource* resource_ = nullptr;
  void* base_ = nullptr;
  Category category_ = Category::kOther;
  std::vector<BufferDesc> buffers_;
  Layout layout_;
};

}  // namespace headroom::memory
