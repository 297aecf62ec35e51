// A one-line progress bar for long work. On a terminal it redraws in place; when stderr is a
// file or pipe it prints a plain line at most every few seconds (and the last one), so logs stay
// readable.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace headroom::report {

class ProgressBar {
 public:
  // `stream` is usually stderr. `width` is the bar's width in cells.
  explicit ProgressBar(std::FILE* stream = stderr, int width = 24);

  // Shows `done` of `total` with a trailing text (loss, speed, memory...).
  void update(long done, long total, const std::string& text);
  // Ends the line (call once when the work is over or before printing other lines).
  void finish();
  // Prints a full line above the bar (e.g. a validation result) without breaking it.
  void println(const std::string& line);

  bool interactive() const { return tty_; }

 private:
  std::FILE* stream_;
  int width_;
  bool tty_;
  bool open_line_ = false;
  std::chrono::steady_clock::time_point last_;
  bool printed_once_ = false;
};

}  // namespace headroom::report
