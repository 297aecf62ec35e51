// Fuzzes the token file reader: any bytes give a file whose every token can be read and lies in
// the vocabulary, or an error naming the file; never a crash or a read outside the file.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "fuzz_util.h"

using namespace headroom;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  const std::string& path = file.write(data, size);
  Result<data::TokenFile> f = data::TokenFile::open(path);
  if (!f.is_ok()) {
    fuzz::expect_names(f.status(), path);
    return 0;
  }
  if (f->token_bytes() != 2 && f->token_bytes() != 4) fuzz::fail("token_bytes", path);
  if (uint64_t(f->size()) * uint64_t(f->token_bytes()) + 64 != size) {
    fuzz::fail("token count does not match the file size", path);
  }
  if (f->vocab_size() <= 0 || f->eot() < 0 || f->eot() >= f->vocab_size()) {
    fuzz::fail("vocabulary or eot out of range", path);
  }
  // Read every token, in chunks as the batcher does, and one at a time.
  std::vector<int32_t> chunk(97);
  for (int64_t start = 0; start < f->size(); start += int64_t(chunk.size())) {
    const int64_t n = std::min<int64_t>(int64_t(chunk.size()), f->size() - start);
    f->copy(start, n, chunk.data());
    for (int64_t i = 0; i < n; i++) {
      if (chunk[i] < 0 || chunk[i] >= f->vocab_size() || chunk[i] != f->at(start + i)) {
        fuzz::fail("a token is out of the vocabulary or copy and at disagree", path);
      }
    }
  }
  data::TokenFile moved = std::move(*f);
  if (moved.size() > 0) (void)moved.at(moved.size() - 1);
  return 0;
}
