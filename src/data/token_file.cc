// Token file writer (atomic: temp file, fsync, rename) and memory-mapped reader with validation.
#include "data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <vector>

#include "core/check.h"

namespace headroom::data {
namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

void put_u32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

Status write_all(int fd, const unsigned char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::io_error(path + ": write failed: " + errno_text(errno) +
                              "; check free disk space and permissions");
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return Status::ok();
}

// Writes the header and tokens to an open file descriptor.
Status write_contents(int fd, const std::string& tmp, std::span<const int32_t> tokens,
                      int token_bytes, int32_t vocab_size, int32_t eot, uint64_t document_count) {
  unsigned char header[kTokenFileHeaderBytes] = {};
  std::memcpy(header, kTokenFileMagic, 8);
  put_u32(header + 8, kTokenFileVersion);
  put_u32(header + 12, static_cast<uint32_t>(token_bytes));
  put_u64(header + 16, tokens.size());
  put_u32(header + 24, static_cast<uint32_t>(vocab_size));
  put_u32(header + 28, static_cast<uint32_t>(eot));
  put_u64(header + 32, document_count);
  HR_RETURN_IF_ERROR(write_all(fd, header, sizeof(header), tmp));

  constexpr size_t kChunk = 1 << 16;  // tokens per write
  std::vector<unsigned char> buf(kChunk * token_bytes);
  for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
    size_t n = std::min(kChunk, tokens.size() - begin);
    unsigned char* p = buf.data();
    for (size_t i = 0; i < n; ++i) {
      auto v = static_cast<uint32_t>(tokens[begin + i]);
      for (int b = 0; b < token_bytes; ++b) *p++ = static_cast<unsigned char>(v >> (8 * b));
    }
    HR_RETURN_IF_ERROR(write_all(fd, buf.data(), n * token_bytes, tmp));
  }
  if (::fsync(fd) != 0) return Status::io_error(tmp + ": fsync failed: " + errno_text(errno));
  return Status::ok();
}

}  // namespace

Status write_token_file(const std::string& path, std::span<const int32_t> tokens,
                        int32_t vocab_size, int32_t eot, uint64_t document_count) {
  if (vocab_size <= 0) {
    return Status::invalid_argument(path + ": vocab_size is " + std::to_string(vocab_size) +
                                    ", must be positive");
  }
  if (eot < 0 || eot >= vocab_size) {
    return Status::invalid_argument(path + ": eot token " + std::to_string(eot) +
                                    " is outside the vocabulary [0, " + std::to_string(vocab_size) +
                                    ")");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size) {
      return Status::invalid_argument(path + ": token " + std::to_string(i) + " is " +
                                      std::to_string(tokens[i]) + ", outside the vocabulary [0, " +
                                      std::to_string(vocab_size) + ")");
    }
  }
  const int token_bytes = vocab_size <= 65536 ? 2 : 4;

  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::io_error(path + ": cannot create '" + tmp + "': " + errno_text(errno) +
                            "; check that the directory exists and is writable");
  }
  Status st = write_contents(fd, tmp, tokens, token_bytes, vocab_size, eot, document_count);
  if (::close(fd) != 0 && st.is_ok()) {
    st = Status::io_error(tmp + ": close failed: " + errno_text(errno));
  }
  if (st.is_ok() && std::rename(tmp.c_str(), path.c_str()) != 0) {
    st = Status::io_error(path + ": cannot rename '" + tmp + "' over it: " + errno_text(errno));
  }
  if (!st.is_ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  // Make the rename itself durable; failure here loses nothing already renamed, so best effort.
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::ok();
}

Result<TokenFile> TokenFile::open(const std::string& path) {
  const std::string redo = "; re-create it with `headroom prepare`";
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) {
      return Status::not_found(path + ": no such token file; create one with `headroom prepare`");
    }
    return Status::io_error(path + ": cannot open: " + errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return Status::io_error(path + ": cannot stat: " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::invalid_argument(path + ": not a regular file; expected a token file");
  }
  const auto file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < static_cast<uint64_t>(kTokenFileHeaderBytes)) {
    ::close(fd);
    return Status::corrupt(path + ": " + std::to_string(file_bytes) +
                           " bytes, smaller than the 64-byte header of a token file" + redo);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) return Status::io_error(path + ": mmap failed: " + errno_text(map_err));

  TokenFile f;
  f.path_ = path;
  f.map_ = map;
  f.map_bytes_ = file_bytes;
  const auto* h = static_cast<const unsigned char*>(map);
  if (std::memcmp(h, kTokenFileMagic, 8) != 0) {
    std::string got;
    for (int i = 0; i < 8; ++i)
      got += (h[i] >= 0x20 && h[i] < 0x7F) ? static_cast<char>(h[i]) : '?';
    return Status::corrupt(path + ": bad magic '" + got +
                           "' at offset 0, expected 'HRTOKENS'; not a headroom token file" + redo);
  }
  const uint32_t version = get_u32(h + 8);
  if (version != kTokenFileVersion) {
    return Status::unsupported(path + ": version " + std::to_string(version) +
                               " at offset 8; this build reads version " +
                               std::to_string(kTokenFileVersion) + redo);
  }
  const uint32_t token_bytes = get_u32(h + 12);
  const uint64_t token_count = get_u64(h + 16);
  const uint32_t vocab_size = get_u32(h + 24);
  const uint32_t eot = get_u32(h + 28);
  if (token_bytes != 2 && token_bytes != 4) {
    return Status::corrupt(path + ": token_bytes is " + std::to_string(token_bytes) +
                           " at offset 12, expected 2 or 4" + redo);
  }
  if (vocab_size == 0 || vocab_size > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()) ||
      (token_bytes == 2 && vocab_size > 65536)) {
    return Status::corrupt(path + ": vocab_size is " + std::to_string(vocab_size) +
                           " at offset 24, impossible with token_bytes " +
                           std::to_string(token_bytes) + redo);
  }
  if (eot >= vocab_size) {
    return Status::corrupt(path + ": eot_token is " + std::to_string(eot) +
                           " at offset 28, not below vocab_size " + std::to_string(vocab_size) +
                           redo);
  }
  for (int i = 40; i < kTokenFileHeaderBytes; ++i) {
    if (h[i] != 0) {
      return Status::corrupt(path + ": header byte at offset " + std::to_string(i) +
                             " is not zero; the header is damaged" + redo);
    }
  }
  const uint64_t max_count = (std::numeric_limits<int64_t>::max() - 64) / token_bytes;
  const uint64_t expected = token_count <= max_count
                                ? kTokenFileHeaderBytes + token_count * token_bytes
                                : std::numeric_limits<uint64_t>::max();
  if (file_bytes != expected) {
    std::string what = file_bytes < expected ? "truncated" : "longer than its header says";
    return Status::corrupt(path + ": file is " + what + ": expected " + std::to_string(expected) +
                           " bytes (64-byte header + " + std::to_string(token_count) +
                           " tokens x " + std::to_string(token_bytes) + " bytes), actual " +
                           std::to_string(file_bytes) + " bytes" + redo);
  }
  f.tokens_ = h + kTokenFileHeaderBytes;
  f.token_count_ = static_cast<int64_t>(token_count);
  f.token_bytes_ = static_cast<int>(token_bytes);
  f.vocab_size_ = static_cast<int32_t>(vocab_size);
  f.eot_ = static_cast<int32_t>(eot);
  f.document_count_ = get_u64(h + 32);

  // One scan so that every later read can trust the values.
  for (int64_t i = 0; i < f.token_count_; ++i) {
    const unsigned char* p = f.tokens_ + i * token_bytes;
    uint32_t v = token_bytes == 2 ? static_cast<uint32_t>(p[0] | (p[1] << 8)) : get_u32(p);
    if (v >= vocab_size) {
      return Status::corrupt(path + ": token " + std::to_string(i) + " (byte offset " +
                             std::to_string(kTokenFileHeaderBytes + i * token_bytes) + ") is " +
                             std::to_string(v) + ", not below vocab_size " +
                             std::to_string(vocab_size) + redo);
    }
  }
  return f;
}

TokenFile::TokenFile(TokenFile&& other) noexcept { *this = std::move(other); }

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    map_ = other.map_;
    map_bytes_ = other.map_bytes_;
    tokens_ = other.tokens_;
    token_count_ = other.token_count_;
    token_bytes_ = other.token_bytes_;
    vocab_size_ = other.vocab_size_;
    eot_ = other.eot_;
    document_count_ = other.document_count_;
    other.map_ = nullptr;
    other.map_bytes_ = 0;
    other.tokens_ = nullptr;
    other.token_count_ = 0;
  }
  return *this;
}

TokenFile::~TokenFile() { reset(); }

void TokenFile::reset() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
  token_count_ = 0;
}

int32_t TokenFile::at(int64_t i) const {
  HR_CHECK(i >= 0 && i < token_count_);
  const unsigned char* p = tokens_ + i * token_bytes_;
  return token_bytes_ == 2 ? static_cast<int32_t>(p[0] | (p[1] << 8))
                           : static_cast<int32_t>(get_u32(p));
}

void TokenFile::copy(int64_t start, int64_t n, int32_t* out) const {
  HR_CHECK(start >= 0 && n >= 0 && start <= token_count_ && n <= token_count_ - start);
  const unsigned char* p = tokens_ + start * token_bytes_;
  if (token_bytes_ == 2) {
    if constexpr (std::endian::native == std::endian::little) {
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = v;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = p[2 * i] | (p[2 * i + 1] << 8);
    }
  } else {
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(get_u32(p + 4 * i));
    }
  }
}

}  // namespace headroom::data
