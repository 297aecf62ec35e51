// GPT-2's byte-level BPE tokenizer, id-for-id compatible with OpenAI's encoder (and the npm
// package gpt-3-encoder), so that text prepared here trains the same vocabulary as GPT-2.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace headroom::data {

// The directory that holds GPT-2's vocabulary: $HEADROOM_VOCAB_DIR if set and non-empty, else
// <HEADROOM_SOURCE_DIR>/third_party/gpt2 (filled by scripts/get-gpt2-vocab).
std::string default_vocab_dir();

// Byte-level BPE as in GPT-2: the text is split into pre-tokens by GPT-2's regular expression
// (PCRE2, UTF + UCP), each pre-token's bytes are mapped to GPT-2's printable byte alphabet and
// merged by rank. encode() does not treat the text "<|endoftext|>" specially; callers separate
// documents by inserting eot_token().
//
// Invalid UTF-8 never fails or crashes: bytes that do not form valid UTF-8 are not matched by the
// pattern (PCRE2_MATCH_INVALID_UTF), and each maximal run of such unmatched bytes becomes a
// pre-token of its own, encoded byte-wise. So decode(encode(x)) == x for any byte string x.
//
// Parity: identical ids to gpt-3-encoder on tests/data/fixtures and on all of Debian's fortunes.
// The only known differences come from what counts as \s: PCRE2 (UCP) treats U+0085 and U+180E
// as white space and U+FEFF not, JavaScript the reverse; text containing those may split
// differently. (OpenAI's Python `regex` agrees with PCRE2 on U+0085 and U+FEFF.)
//
// Thread safety: const methods may be called from several threads at once (the word cache is
// internally locked). Copies share the same immutable tables and cache.
class Gpt2Tokenizer {
 public:
  // Reads vocab.json + merges.txt (Hugging Face layout) or encoder.json + vocab.bpe (OpenAI
  // layout) from `dir`. Errors name the missing or malformed file and say how to get one.
  static Result<Gpt2Tokenizer> load(const std::string& dir);

  std::vector<int32_t> encode(std::string_view utf8) const;
  // Appends the ids of `utf8` to `out` (saves a copy when packing many documents).
  void encode_append(std::string_view utf8, std::vector<int32_t>* out) const;

  // Concatenates the bytes of each id. Ids outside [0, vocab_size()) decode to U+FFFD, so a model
  // with a padded vocabulary cannot crash the decoder. The result is the original bytes, which
  // may be a partial UTF-8 sequence if `ids` ends inside a character.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t eot_token() const;   // id of "<|endoftext|>" (50256 for GPT-2)
  int32_t vocab_size() const;  // number of entries in the vocabulary (50257 for GPT-2)

 private:
  struct Impl;  // tables, compiled pattern and word cache; defined in tokenizer.cc
  explicit Gpt2Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace headroom::data
