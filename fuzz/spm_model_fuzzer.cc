// Fuzzes the SentencePiece tokenizer.model reader (a hand-written protobuf parser): any bytes give
// a model that encodes (ids inside its pieces) and decodes, or an error naming the file; never a
// crash or a read outside the input.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/spm_tokenizer.h"
#include "fuzz_util.h"

using namespace headroom;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = "fuzz/tokenizer.model";
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  for (bool special : {false, true}) {
    data::TokenizerOptions o;
    o.parse_special_tokens = special;
    Result<data::SpmTokenizer> t = data::SpmTokenizer::parse(bytes, path, "fuzz", o);
    if (!t.is_ok()) {
      fuzz::expect_names(t.status(), path);
      return 0;
    }
    if (t->unk_token() < 0 || t->unk_token() >= t->vocab_size())
      fuzz::fail("unk out of range", path);
    for (const std::string& text : {std::string("Hello  world, 123 <s></s> caf\xC3\xA9\n\xFF"),
                                    std::string(bytes.substr(0, 128))}) {
      std::vector<int32_t> ids = t->encode(text);
      for (int32_t id : ids) {
        if (id < 0 || id >= t->vocab_size()) fuzz::fail("an id outside the pieces", path);
      }
      (void)t->decode(ids);
    }
    const std::vector<int32_t> odd = {-1, 0, t->vocab_size(), t->vocab_size() - 1};
    (void)t->decode(odd);
  }
  return 0;
}
