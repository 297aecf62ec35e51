// Status and Result<T>: recoverable failures (bad input, I/O, out of memory) are values that the
// caller must look at. Broken invariants use HR_CHECK (core/check.h) instead.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace headroom {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // a flag, config field or call argument is wrong
  kNotFound,         // a file, model or key does not exist
  kIoError,          // reading or writing failed
  kCorrupt,          // a file exists but its contents are malformed
  kOutOfMemory,      // an allocation does not fit the budget
  kUnsupported,      // valid request that this build or device cannot do
  kInternal,         // a bug: should not happen
};

std::string_view status_code_name(StatusCode code);

// Thread-compatible value type. The message names the file, the field, the value and what to do.
class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  static Status invalid_argument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status out_of_memory(std::string m) { return {StatusCode::kOutOfMemory, std::move(m)}; }
  static Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: message"
  std::string to_string() const;

  // Returns a copy with `context` prepended ("context: message"); OK stays OK.
  Status with_context(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    assert(!status_.is_ok() && "Result constructed from an OK status without a value");
    if (status_.is_ok()) status_ = Status::internal("Result built from OK status without value");
  }

  bool is_ok() const { return value_.has_value(); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const { return status_; }

  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace headroom

#define HR_CONCAT_INNER(a, b) a##b
#define HR_CONCAT(a, b) HR_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if it is not OK.
#define HR_RETURN_IF_ERROR(expr)                \
  do {                                          \
    ::headroom::Status hr_status_ = (expr);     \
    if (!hr_status_.is_ok()) return hr_status_; \
  } while (0)

// HR_ASSIGN_OR_RETURN(auto x, make_x()); declares x from a Result or returns its status.
#define HR_ASSIGN_OR_RETURN(lhs, expr) \
  HR_ASSIGN_OR_RETURN_IMPL(HR_CONCAT(hr_result_, __LINE__), lhs, expr)
#define HR_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.is_ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
