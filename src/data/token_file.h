// The packed token file that `headroom prepare` writes and training reads: a 64-byte header and
// the token ids, memory-mapped so that a corpus larger than RAM costs only page cache.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/status.h"

namespace headroom::data {

// Layout (all integers little-endian):
//   offset  size  field
//        0     8  magic "HRTOKENS"
//        8     4  version (1)
//       12     4  token_bytes: 2 if vocab_size <= 65536, else 4
//       16     8  token_count
//       24     4  vocab_size
//       28     4  eot_token
//       32     8  document_count
//       40    24  zero
//       64     -  token_count tokens of token_bytes each
// Documents are separated by eot tokens: each document is followed by exactly one eot.
inline constexpr char kTokenFileMagic[8] = {'H', 'R', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 64;

// Writes `tokens` to `path` atomically: the data goes to "<path>.tmp.<pid>", is fsync'ed and
// renamed over `path`; on any failure the temporary file is removed and `path` is untouched.
// Errors: InvalidArgument if vocab_size <= 0, eot is outside [0, vocab_size), or a token is (the
// message names its index and value); IoError if the file cannot be written.
[[nodiscard]] Status write_token_file(const std::string& path, std::span<const int32_t> tokens,
                                      int32_t vocab_size, int32_t eot, uint64_t document_count);

// A read-only, memory-mapped token file. open() validates the header, the exact file size and
// every token (< vocab_size) once, so accessors need not check values again.
// Movable, not copyable; unmaps in the destructor. Const methods are thread-safe.
class TokenFile {
 public:
  static Result<TokenFile> open(const std::string& path);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  int64_t size() const { return token_count_; }  // number of tokens
  // REQUIRES: 0 <= i < size().
  int32_t at(int64_t i) const;
  // Copies tokens [start, start + n) to out[0, n). REQUIRES: 0 <= start, n >= 0,
  // start + n <= size().
  void copy(int64_t start, int64_t n, int32_t* out) const;

  int32_t vocab_size() const { return vocab_size_; }
  int32_t eot() const { return eot_; }
  uint64_t document_count() const { return document_count_; }
  int token_bytes() const { return token_bytes_; }
  const std::string& path() const { return path_; }

 private:
  TokenFile() = default;
  void reset();

  std::string path_;
  void* map_ = nullptr;  // the whole file, or null when unmapped
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;  // map_ + kTokenFileHeaderBytes
  int64_t token_count_ = 0;
  int token_bytes_ = 2;
  int32_t vocab_size_ = 0;
  int32_t eot_ = 0;
  uint64_t document_count_ = 0;
};

}  // namespace headroom::data
