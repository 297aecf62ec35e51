// The tokenizer interface, load_tokenizer() that picks a reader by the files in a directory, and
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

// Text to token ids and back. Implementations: Gpt2Tokenizer (encoder.json + vocab.bpe),
// HfTokenizer (Hugging Face tokenizer.json, hf_tokenizer.h) and SpmTokenizer (SentencePiece
// tokenizer.model, spm_tokenizer.h). encode() adds no special tokens (no bos): callers insert
// bos_token() / eos_token() where they want them.
//
// Thread safety: const methods may be called from several threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  std::vector<int32_t> encode(std::string_view text) const {
    std::vector<int32_t> out;
    encode_append(text, &out);
    return out;
  }
  // Appends the ids of `text` to `out`. Never fails: bytes that are not valid UTF-8 are encoded
  // byte-wise where the vocabulary can (byte-level BPE, byte fallback), else as unk.
  virtual void encode_append(std::string_view text, std::vector<int32_t>* out) const = 0;
  // The bytes the ids stand for (not necessarily valid UTF-8). Ids outside [0, vocab_size())
  // decode to U+FFFD.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;

  virtual int32_t vocab_size() const = 0;  // one more than the largest id
  virtual int32_t bos_token() const = 0;   // -1 if the vocabulary has none
  virtual int32_t eos_token() const = 0;   // the end-of-document token; -1 if none
  // Short and stable, for logs and token files: "gpt2", or the name of the tokenizer's directory.
  virtual const std::string& name() const = 0;
  // One line on what was loaded, e.g. "tokenizer.json: byte-level BPE, 128256 tokens".
  virtual std::string description() const = 0;
};

struct TokenizerOptions {
  // Recognise the text of added / special tokens ("<|begin_of_text|>", "<s>", ...) in the input
  // and emit their ids. Off by default: a document that mentions "<s>" is then tokenized as text.
  // Applies to tokenizer.json (its added_tokens) and tokenizer.model (its control and
  // user-defined pieces); the GPT-2 tokenizer ignores it.
  bool parse_special_tokens = false;
};

// Loads the tokenizer in `dir`, by the first of these that is present:
//   tokenizer.json              Hugging Face tokenizers (BPE: byte-level or SentencePiece-style)
//   tokenizer.model             SentencePiece model (BPE)
//   encoder.json + vocab.bpe    GPT-2 (OpenAI layout), or vocab.json + merges.txt (Hugging Face)
// tokenizer_config.json, when present beside the first two, names bos/eos. Errors: NotFound
// naming `dir` and the files looked for; Corrupt / Unsupported naming the file, field and value.
Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& dir,
                                                  const TokenizerOptions& options = {});

// The directory that holds GPT-2's vocabulary: $HEADROOM_VOCAB_DIR if set and non-empty, else the
// data directory's gpt2/ (core/data_dir.h: $HEADROOM_DATA_DIR, the installed share/headroom, the
// source tree's third_party/gpt2 that scripts/get-gpt2-vocab fills). Errors: NotFound listing
// every place looked at and how to get the vocabulary.
Result<std::string> find_vocab_dir();

// find_vocab_dir()'s directory, or "" where there is none.
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
class Gpt2Tokenizer final : public Tokenizer {
 public:
  // Reads vocab.json + merges.txt (Hugging Face layout) or encoder.json + vocab.bpe (OpenAI
  // layout) from `dir`. Errors name the missing or malformed file and say how to get one.
  static Result<Gpt2Tokenizer> load(const std::string& dir);

  using Tokenizer::encode;
  // Appends the ids of `utf8` to `out` (saves a copy when packing many documents).
  void encode_append(std::string_view utf8, std::vector<int32_t>* out) const override;

  // Concatenates the bytes of each id. Ids outside [0, vocab_size()) decode to U+FFFD, so a model
  // with a padded vocabulary cannot crash the decoder. The result is the original bytes, which
  // may be a partial UTF-8 sequence if `ids` ends inside a character.
  std::string decode(std::span<const int32_t> ids) const override;

  int32_t eot_token() const;            // id of "<|endoftext|>" (50256 for GPT-2)
  int32_t vocab_size() const override;  // number of entries in the vocabulary (50257 for GPT-2)
  // GPT-2 uses <|endoftext|> for both.
  int32_t bos_token() const override { return eot_token(); }
  int32_t eos_token() const override { return eot_token(); }
  const std::string& name() const override;  // "gpt2"
  std::string description() const override;

 private:
  struct Impl;  // tables, compiled pattern and word cache; defined in tokenizer.cc
  explicit Gpt2Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace headroom::data
