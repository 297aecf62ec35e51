// The fenced op table's failure report and deferred copies (its ops are inline in fenced_ops.h).
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

uint64_t FencedOps::defer(const PendingCopy& c) const {
  if (c.bytes == 0) return 0;
  std::lock_guard<std::mutex> lock(copy_mu_);
  const uint64_t ticket = next_ticket_++;
  pending_.emplace(ticket, c);
  return ticket;
}

void FencedOps::wait_copy(uint64_t ticket) const {
  if (ticket == 0) return;
  PendingCopy c;
  {
    std::lock_guard<std::mutex> lock(copy_mu_);
    auto it = pending_.find(ticket);
    HR_CHECK_MSG(it != pending_.end(), "wait_copy: an unknown or already waited ticket");
    c = it->second;
    pending_.erase(it);
  }
  // The device side was checked at the call; it must still be live now (a block freed before
  // its copy was waited is a bug on a GPU too).
  if (c.to_host) {
    check_range("copy_to_host_async (waited)", c.src, c.bytes);
    in_window("copy_to_host", [&] { inner_.copy_to_host(c.dst, c.src, c.bytes); });
  } else {
    check_range("copy_to_device_async (waited)", c.dst, c.bytes);
    in_window("copy_to_device", [&] { inner_.copy_to_device(c.dst, c.src, c.bytes); });
  }
}

}  // namespace headroom::backend
