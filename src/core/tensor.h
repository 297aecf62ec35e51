// Shapes and non-owning tensor views. Memory is owned by resources and arenas (memory/); a view
// only names a region with a dtype and a shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"

namespace headroom {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  size_t rank() const { return dims_.size(); }
  int64_t operator[](size_t i) const { return dims_[i]; }
  const std::vector<int64_t>& dims() const { return dims_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims_) n *= d;
    return n;
  }
  bool operator==(const Shape& o) const { return dims_ == o.dims_; }
  // "[2, 16, 64]"
  std::string to_string() const;

 private:
  std::vector<int64_t> dims_;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  float* f32() const {
    HR_CHECK(dtype == DType::kF32);
    return static_cast<float*>(data);
  }
  uint16_t* u16() const {
    HR_CHECK(dtype_size(dtype) == 2);
    return static_cast<uint16_t*>(data);
  }
  int32_t* i32() const {
    HR_CHECK(dtype == DType::kI32);
    return static_cast<int32_t*>(data);
  }
};

}  // namespace headroom
