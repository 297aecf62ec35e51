// Reports a broken invariant and aborts.
#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace headroom::detail {
void check_failed(const char* file, int line, const char* cond, const char* msg) {
  std::fprintf(stderr, "headroom: internal check failed at %s:%d: %s %s\n", file, line, cond, msg);
  std::fflush(stderr);
  std::abort();
}
}  // namespace headroom::detail
