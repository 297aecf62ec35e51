#include "data/byte_tokenizer.h"

#include <fstream>
#include <nlohmann/json.hpp>

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

Status write_byte_tokenizer_config(const std::string& dir) {
  const std::string path = dir + "/tokenizer_config.json";
  const nlohmann::json j = {{"tokenizer_class", "ByteTokenizer"},
                            {"headroom_tokenizer", kByteTokenizerName},
                            {"eos_token_id", ByteTokenizer::kEos},
                            {"vocab_size", ByteTokenizer::kVocab}};
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return Status::io_error("cannot write " + path + " (disk full or not writable?)");
  return Status::ok();
}

bool is_byte_tokenizer_config(const std::string& dir) {
  std::ifstream in(dir + "/tokenizer_config.json");
  if (!in) return false;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  auto it = j.find("headroom_tokenizer");
  return it != j.end() && it->is_string() && it->get<std::string>() == kByteTokenizerName;
}

}  // namespace headroom::data
