// The fenced op table's failure report (its ops are inline in fenced_ops.h).
#include "backend/fenced/fenced_ops.h"

#include <fmt/format.h>

#include <string>

#include "core/check.h"

namespace headroom::backend {

void FencedOps::operand_not_on_device(const char* op, const void* p, size_t bytes) {
  const std::string msg = fmt::format(
      "fenced device: {} was given {} ({} bytes), which is not the device's memory (not inside "
      "one live block of its FencedResource): a GPU's op could not read it either; pass a "
      "buffer of the device's plan, or copy it over first (copy_to_device)",
      op, p, bytes);
  detail::check_failed(__FILE__, __LINE__, "operand on the device", msg.c_str());
}

}  // namespace headroom::backend
