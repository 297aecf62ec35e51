// A reader and encoder for Hugging Face `tokenizer.json` files with a BPE model, so that text
// can be prepared with the vocabulary of Llama 3, Llama 2, Mistral, Qwen, GPT-2 and the like.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "data/tokenizer.h"

namespace headroom::data {

// What is supported (anything else in the file is refused at load with Unsupported, naming the
// field and its value, never ignored):
//   model        BPE: vocab, merges as "a b" strings or ["a", "b"] pairs, unk_token, fuse_unk,
//                byte_fallback (<0xNN> tokens), ignore_merges. Not: dropout > 0,
//                continuing_subword_prefix, end_of_word_suffix; not WordPiece, Unigram, WordLevel.
//   normalizer   null, NFC, NFD, NFKC, NFKD (ICU), Prepend, Replace (String or Regex pattern),
//                Sequence of these.
//   pre_tokenizer null, ByteLevel (add_prefix_space, use_regex: GPT-2's pattern), Split (Regex or
//                String pattern; behaviours Isolated, Removed, MergedWithPrevious, MergedWithNext,
//                Contiguous; not inverted), Metaspace (replacement, prepend_scheme or
//                add_prefix_space, split), Digits, Sequence of these. ByteLevel, if present, must
//                be the last step (it maps bytes to GPT-2's alphabet for the model).
//   decoder      null, ByteLevel, Replace (String), ByteFallback, Fuse, Strip, Metaspace, Sequence.
//   added_tokens their ids and text; recognised in the input only with
//                TokenizerOptions::parse_special_tokens (leftmost, then longest; lstrip and rstrip
//                honoured), and decoded to their text.
//   post_processor is ignored: encode() adds no bos/eos.
// Regular expressions (written for Oniguruma) are compiled with PCRE2 (UTF, UCP); the patterns of
// the files above mean the same in both.
//
// Deliberate differences from the Rust `tokenizers` library: input that is not valid UTF-8 is
// accepted (such bytes are never matched by a pattern and are encoded through the byte alphabet or
// byte fallback, else unk), and decode() returns the raw bytes, so decode(encode(x)) == x for a
// byte-level or byte-fallback vocabulary, where the library would insert U+FFFD.
//
// Thread safety: const methods may be called from several threads at once; copies share the
// immutable tables.
class HfTokenizer final : public Tokenizer {
 public:
  // Reads `json_path` (a tokenizer.json) and, if `config_path` is not empty and the file exists,
  // tokenizer_config.json for bos_token / eos_token. Without those, bos and eos are found by
  // well-known names, the first present: <|begin_of_text|>, <s>, <bos>, <|startoftext|>,
  // <|endoftext|> / <|end_of_text|>, </s>, <eos>, <|endoftext|>, <|im_end|>. `name` is what
  // name() returns.
  // Errors: NotFound (file missing), Corrupt (not JSON, a field of the wrong type, a merge that
  // names a token missing from the vocabulary, ...), Unsupported (a model or component not listed
  // above); each names the file and the field.
  static Result<HfTokenizer> load(const std::string& json_path, const std::string& config_path,
                                  const std::string& name, const TokenizerOptions& options = {});

  using Tokenizer::encode;
  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(std::span<const int32_t> ids) const override;

  int32_t vocab_size() const override;
  int32_t bos_token() const override;
  int32_t eos_token() const override;
  const std::string& name() const override;
  std::string description() const override;

  // The id of `token` (a vocabulary entry in the file's spelling, or an added token's text);
  // -1 if there is none.
  int32_t token_id(std::string_view token) const;
  bool byte_level() const;  // true for GPT-2 style vocabularies, false for SentencePiece style

  struct Impl;  // defined in hf_tokenizer.cc

 private:
  explicit HfTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace headroom::data
