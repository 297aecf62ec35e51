#include "data/byte_tokenizer.h"

namespace headroom::data {

void ByteTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  out->reserve(out->size() + text.size());
  for (char ch : text) out->push_back(static_cast<unsigned char>(ch));
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < 256) {
      s.push_back(static_cast<char>(id));
    } else if (id != kEos) {
      s += "\xEF\xBF\xBD";  // U+FFFD, as the other tokenizers decode ids outside the vocabulary
    } else {
      s.push_back('\n');  // the end of a document reads as a line break
    }
  }
  return s;
}

}  // namespace headroom::data
