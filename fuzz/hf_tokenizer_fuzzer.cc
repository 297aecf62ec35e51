// Fuzzes the tokenizer.json reader: any bytes give a tokenizer that encodes (ids inside its
// vocabulary) and decodes a fixed text and the input itself, or an error naming the file; never a
// crash, a hang or a read out of bounds.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/hf_tokenizer.h"
#include "fuzz_util.h"

using namespace headroom;

namespace {

void exercise(const data::Tokenizer& tok, std::string_view input, const std::string& path) {
  const std::string texts[] = {"Hello world, 123 <s> <|endoftext|> \xE2\x96\x81 caf\xC3\xA9\n\t",
                               std::string(input.substr(0, 256))};
  for (const std::string& t : texts) {
    std::vector<int32_t> ids = tok.encode(t);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) fuzz::fail("an id outside the vocabulary", path);
    }
    (void)tok.decode(ids);
  }
  const std::vector<int32_t> odd = {-1, 0, tok.vocab_size(), tok.vocab_size() - 1, 1 << 30};
  (void)tok.decode(odd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  const std::string& path = file.write(data, size);
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  for (bool special : {false, true}) {
    data::TokenizerOptions o;
    o.parse_special_tokens = special;
    Result<data::HfTokenizer> t = data::HfTokenizer::load(path, "", "fuzz", o);
    if (!t.is_ok()) {
      fuzz::expect_names(t.status(), path);
      return 0;
    }
    if (t->vocab_size() <= 0) fuzz::fail("an accepted tokenizer with no vocabulary", path);
    exercise(*t, input, path);
  }
  return 0;
}
