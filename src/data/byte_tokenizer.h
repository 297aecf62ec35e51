// The byte tokenizer: each byte of the text is its own token (ids 0-255), and id 256 ends a
// document. No vocabulary file: `--tokenizer bytes`. With a vocabulary of 257 the LM head is a
// rounding error of the step, so a small model spends its FLOPs on the text; the first run's
// model (preset bytes-tiny, docs/notes/first-run.md) uses it.
#pragma once

#include <string>

#include "data/tokenizer.h"

namespace headroom::data {

// The name `--tokenizer` takes for it (where no directory of that name exists).
inline constexpr const char* kByteTokenizerName = "bytes";

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kEos = 256;
  static constexpr int32_t kVocab = 257;

  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return kVocab; }
  int32_t bos_token() const override { return -1; }
  int32_t eos_token() const override { return kEos; }
  const std::string& name() const override { return name_; }
  std::string description() const override { return "bytes: one token a byte, 257 tokens"; }

 private:
  std::string name_ = kByteTokenizerName;
};

// A model trained with it carries tokenizer_config.json saying so ({"tokenizer_class":
// "ByteTokenizer", "headroom_tokenizer": "bytes", ...}), so that generate finds it as it finds a
// tokenizer.json. write_... returns an IoError naming the file; is_... is false for any other
// directory, a missing file or one that does not parse.
Status write_byte_tokenizer_config(const std::string& dir);
bool is_byte_tokenizer_config(const std::string& dir);

}  // namespace headroom::data
