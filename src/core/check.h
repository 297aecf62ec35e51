// Always-on invariant checks. A failed check is a bug in headroom, never bad user input: it
// prints file, line and the condition and aborts. Bad input returns a Status instead.
#pragma once

namespace headroom::detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const char* msg);
}

#define HR_CHECK(cond)                                                            \
  do {                                                                            \
    if (!(cond)) ::headroom::detail::check_failed(__FILE__, __LINE__, #cond, ""); \
  } while (0)

#define HR_CHECK_MSG(cond, msg)                                                      \
  do {                                                                               \
    if (!(cond)) ::headroom::detail::check_failed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)
