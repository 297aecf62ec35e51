// Logging sink: stderr, one line per message, level prefix.
#include "core/log.h"

#include <atomic>
#include <cstdio>

namespace headroom {

namespace {
std::atomic<int> g_level{static_cast<int>(LogLevel::kInfo)};
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level)); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load()); }

void log_write(LogLevel level, std::string_view message) {
  const char* prefix =
      level == LogLevel::kWarn ? "warning: " : (level == LogLevel::kError ? "error: " : "");
  std::fprintf(stderr, "%s%.*s\n", prefix, static_cast<int>(message.size()), message.data());
}

}  // namespace headroom
