// Arena: one allocation, many planned buffers.
#include "memory/arena.h"

#include <utility>

namespace headroom::memory {

Layout sequential_layout(const std::vector<BufferDesc>& buffers, uint64_t alignment) {
  Layout l;
  l.offsets.reserve(buffers.size());
  uint64_t off = 0;
  for (const BufferDesc& b : buffers) {
    l.offsets.push_back(off);
    off += (b.bytes() + alignment - 1) / alignment * alignment;
  }
  l.size = off;
  return l;
}

Result<Arena> Arena::create(MemoryResource* resource, std::vector<BufferDesc> buffers,
                            Layout layout, Category category) {
  HR_CHECK(layout.offsets.size() == buffers.size());
  for (size_t i = 0; i < buffers.size(); i++) {
    HR_CHECK(layout.offsets[i] + buffers[i].bytes() <= layout.size);
    HR_CHECK(layout.offsets[i] % kBufferAlignment == 0);
  }
  Arena a;
  HR_ASSIGN_OR_RETURN(a.base_, resource->allocate(layout.size, 4096, category));
  a.resource_ = resource;
  a.category_ = category;
  a.buffers_ = std::move(buffers);
  a.layout_ = std::move(layout);
  return a;
}

Arena::~Arena() { release(); }

void Arena::release() {
  if (base_) resource_->deallocate(base_, layout_.size, 4096, category_);
  base_ = nullptr;
}

Arena::Arena(Arena&& o) noexcept { *this = std::move(o); }

Arena& Arena::operator=(Arena&& o) noexcept {
  if (this != &o) {
    release();
    resource_ = o.resource_;
    base_ = std::exchange(o.base_, nullptr);
    category_ = o.category_;
    buffers_ = std::move(o.buffers_);
    layout_ = std::move(o.layout_);
  }
  return *this;
}

}  // namespace headroom::memory
