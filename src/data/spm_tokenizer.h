// A reader and encoder for SentencePiece `tokenizer.model` files (BPE models, as Llama 2's), so
// that text can be prepared with a SentencePiece vocabulary without linking SentencePiece.
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

// The file is a protobuf ModelProto, parsed here by hand (the wire format: varints,
// length-delimited fields, fixed32), with every length checked against what is left:
//   1 pieces (repeated): 1 piece (string), 2 score (float), 3 type (NORMAL 1, UNKNOWN 2, CONTROL 3,
//     USER_DEFINED 4, UNUSED 5, BYTE 6)
//   2 trainer_spec: 3 model_type (must be BPE = 2), 24 treat_whitespace_as_suffix (must be
//     false), 35 byte_fallback, 40 unk_id, 41 bos_id, 42 eos_id, 44 unk_surface
//   3 normalizer_spec: 2 precompiled_charsmap (must be empty: identity normalization only),
//     3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces
// Other fields are skipped.
//
// Encoding follows SentencePiece's BPE: normalize (collapse extra spaces if asked, add the dummy
// "▁" prefix, spaces to "▁"), split into characters (user-defined pieces are matched first and
// never merged), then repeatedly merge the adjacent pair whose concatenation is the piece with
// the highest score (leftmost among equals); a symbol that is not a piece becomes its bytes
// (<0xNN>) with byte_fallback, else unk (consecutive unks fused). Decoding turns "▁" into spaces,
// byte pieces into their bytes, drops control pieces, writes unk as unk_surface (" ⁇ ") and
// removes the dummy prefix's space.
//
// Differences from SentencePiece: bytes that are not valid UTF-8 are kept (and byte-fallen-back)
// where SentencePiece's normalizer would substitute U+FFFD; and decode() returns raw bytes.
// With TokenizerOptions::parse_special_tokens, the text of control pieces ("<s>", "</s>") is
// recognised and each stretch of text between them is encoded as a separate input.
//
// Thread safety: const methods may be called from several threads at once.
class SpmTokenizer final : public Tokenizer {
 public:
  enum PieceType : int {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };
  struct Piece {
    std::string piece;
    float score = 0;
    int type = kNormal;
  };

  // Reads `model_path` and, if `config_path` is not empty and exists, tokenizer_config.json for
  // bos_token / eos_token (else trainer_spec's bos_id / eos_id).
  // Errors: NotFound, Corrupt (truncated or malformed protobuf: the message names the file, the
  // field and the byte offset), Unsupported (not BPE, a normalization rule table, ...).
  static Result<SpmTokenizer> load(const std::string& model_path, const std::string& config_path,
                                   const std::string& name, const TokenizerOptions& options = {});
  // The same from the file's bytes; `path` is used in messages only.
  static Result<SpmTokenizer> parse(std::string_view bytes, const std::string& path,
                                    const std::string& name, const TokenizerOptions& options = {});

  using Tokenizer::encode;
  void encode_append(std::string_view text, std::vector<int32_t>* out) const override;
  std::string decode(std::span<const int32_t> ids) const override;

  int32_t vocab_size() const override;
  int32_t bos_token() const override;
  int32_t eos_token() const override;
  const std::string& name() const override;
  std::string description() const override;

  const std::vector<Piece>& pieces() const;
  int32_t unk_token() const;

  struct Impl;  // defined in spm_tokenizer.cc

 private:
  explicit SpmTokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace headroom::data
