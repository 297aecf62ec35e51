// Helpers shared by the libFuzzer targets: giving a path-taking reader the fuzz input as a file,
// and failing loudly when a reader breaks one of its contracts (see docs/notes/fuzzing.md).
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

#include "core/status.h"

namespace headroom::fuzz {

// Stops the fuzzer with a report: a reader returned something its contract rules out (an error
// that does not name the file, an accepted file that is inconsistent). libFuzzer saves the input.
[[noreturn]] inline void fail(std::string_view what, std::string_view detail) {
  std::fprintf(stderr, "fuzz contract violated: %.*s\n  %.*s\n", int(what.size()), what.data(),
               int(detail.size()), detail.data());
  std::abort();
}

// DESIGN.md, "Fail clearly": every error names the file it is about.
inline void expect_names(const Status& s, std::string_view file) {
  if (s.is_ok()) return;
  if (s.message().find(file) == std::string::npos)
    fail("the error does not name the file", s.to_string());
}

// Writes all of [data, data + size) to fd at offset 0 and truncates the file to that size.
inline void write_whole(int fd, const uint8_t* data, size_t size) {
  if (::ftruncate(fd, 0) != 0) fail("ftruncate", "");
  size_t done = 0;
  while (done < size) {
    ssize_t w = ::pwrite(fd, data + done, size - done, off_t(done));
    if (w <= 0) fail("pwrite to the scratch file failed", "");
    done += size_t(w);
  }
}

// One anonymous in-memory file (memfd) per process, reachable by path as /proc/self/fd/N, so a
// reader that opens a path reads the fuzz input without touching the disk.
class MemFile {
 public:
  MemFile() {
    fd_ = ::memfd_create("headroom-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) fail("memfd_create failed", "");
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  // Replaces the contents; returns the path.
  const std::string& write(const uint8_t* data, size_t size) {
    write_whole(fd_, data, size);
    return path_;
  }

 private:
  int fd_ = -1;
  std::string path_;
};

// A directory for readers of several files, made once per process under $TMPDIR (else on the
// /dev/shm tmpfs, to keep the disk out of the loop) and removed at a normal exit. A crash skips
// that: fuzz/run.sh points TMPDIR at a directory it removes itself.
class ScratchDir {
 public:
  ScratchDir() {
    namespace fs = std::filesystem;
    std::error_code ec;
    const char* tmpdir = std::getenv("TMPDIR");
    std::string base = tmpdir && fs::is_directory(tmpdir, ec) ? std::string(tmpdir)
                       : fs::is_directory("/dev/shm", ec)     ? std::string("/dev/shm")
                                                              : fs::temp_directory_path().string();
    std::string pattern = base + "/headroom-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) fail("mkdtemp failed", pattern);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Writes `bytes` to `path` (replacing it).
inline void write_file(const std::string& path, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create a scratch file", path);
  write_whole(fd, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  ::close(fd);
}

}  // namespace headroom::fuzz
