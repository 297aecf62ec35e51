// Progress bar rendering.
#include "report/progress.h"

#include <unistd.h>

namespace headroom::report {

ProgressBar::ProgressBar(std::FILE* stream, int width)
    : stream_(stream), width_(width), tty_(isatty(fileno(stream)) != 0) {}

void ProgressBar::update(long done, long total, const std::string& text) {
  auto now = std::chrono::steady_clock::now();
  const bool end = done >= total;
  if (!tty_ && printed_once_ && !end && now - last_ < std::chrono::seconds(5)) {
    return;  // in a log file, one line every few seconds is plenty
  }
  last_ = now;
  printed_once_ = true;
  int filled = total > 0 ? int(double(done) / double(total) * width_) : width_;
  if (filled > width_) filled = width_;
  std::string bar(size_t(filled), '#');
  bar.resize(size_t(width_), '.');
  int digits = std::snprintf(nullptr, 0, "%ld", total);
  if (tty_) {
    std::fprintf(stream_, "\r\x1b[2K%*ld/%ld [%s] %s", digits, done, total, bar.c_str(),
                 text.c_str());
    open_line_ = true;
  } else {
    std::fprintf(stream_, "%*ld/%ld [%s] %s\n", digits, done, total, bar.c_str(), text.c_str());
  }
  std::fflush(stream_);
}

void ProgressBar::finish() {
  if (open_line_) std::fputc('\n', stream_);
  open_line_ = false;
  std::fflush(stream_);
}

void ProgressBar::println(const std::string& line) {
  if (open_line_) std::fputs("\r\x1b[2K", stream_);
  std::fprintf(stream_, "%s\n", line.c_str());
  open_line_ = false;
  std::fflush(stream_);
}

}  // namespace headroom::report
