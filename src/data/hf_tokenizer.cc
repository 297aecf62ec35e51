// Hugging Face tokenizer.json: parsing and checking every field used, the normalizer /
// pre-tokenizer / BPE / decoder pipeline, added tokens. See hf_tokenizer.h for what is supported.
#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/utypes.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "core/check.h"
#include "data/tokenizer_util.h"

namespace headroom::data {
namespace {

using nlohmann::json;
using namespace tok_util;

// GPT-2's pre-tokenisation pattern, which ByteLevel with use_regex applies.
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr int kMaxNesting = 8;  // Sequence inside Sequence ...
constexpr int64_t kMaxId = int64_t{1} << 28;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// A compiled PCRE2 pattern (UTF + UCP; invalid UTF-8 in the subject is never matched), or a
// literal string.
class Pattern {
 public:
  Pattern() = default;
  Pattern(const Pattern&) = delete;
  Pattern& operator=(const Pattern&) = delete;
  ~Pattern() {
    if (re_) pcre2_code_free(re_);
  }

  Status compile_regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    re_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                        PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
    if (!re_) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof(buf));
      return Status::unsupported(where + ": regex '" + printable(pattern) +
                                 "' does not compile with PCRE2 at offset " + std::to_string(off) +
                                 ": " + reinterpret_cast<char*>(buf));
    }
    (void)pcre2_jit_compile(re_, PCRE2_JIT_COMPLETE);  // an optimisation only
    return Status::ok();
  }
  void set_literal(std::string s) { literal_ = std::move(s); }

  // Calls on_match(begin, end) for each non-empty, non-overlapping match in `s`, left to right.
  template <typename F>
  void for_each_match(std::string_view s, F&& on_match) const {
    if (!re_) {
      if (literal_.empty()) return;
      size_t pos = 0;
      while ((pos = s.find(literal_, pos)) != std::string_view::npos) {
        on_match(pos, pos + literal_.size());
        pos += literal_.size();
      }
      return;
    }
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(re_, nullptr), &pcre2_match_data_free);
    HR_CHECK(md != nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t pos = 0;
    while (pos < s.size()) {
      int rc = pcre2_match(re_, subject, s.size(), pos, 0, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return;  // the rest is one gap
      if (rc < 0) {  // a resource limit (not expected): this character joins the gap
        int len = utf8_char_len(s, pos);
        pos += static_cast<size_t>(std::max(len, 1));
        continue;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      size_t b = ov[0], e = ov[1];
      if (e <= b) {  // an empty match splits nothing: look again one character on
        int len = b < s.size() ? utf8_char_len(s, b) : 1;
        pos = b + static_cast<size_t>(std::max(len, 1));
        continue;
      }
      on_match(b, e);
      pos = e;
    }
  }

 private:
  pcre2_code* re_ = nullptr;
  std::string literal_;
};

// A piece of text on its way through the pipeline. `at_start`: it begins at the start of the
// input (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  bool at_start = false;
};

enum class NormKind { kPrepend, kReplace, kUnicode };
struct NormStep {
  NormKind kind;
  std::string text;                           // Prepend: the prefix; Replace: the replacement
  std::unique_ptr<Pattern> pattern;           // Replace
  const icu::Normalizer2* unicode = nullptr;  // NFC, NFD, NFKC, NFKD (ICU's, never freed)
};

// Applies a Unicode normalization form to the well-formed UTF-8 runs of `s`; bytes that are not
// UTF-8 stay where they are. ASCII is invariant under every form, so it is not copied.
void unicode_normalize(const icu::Normalizer2& form, std::string* s) {
  if (std::all_of(s->begin(), s->end(), [](char c) { return (c & 0x80) == 0; })) return;
  constexpr size_t kMaxRun = size_t{1} << 28;  // ICU takes int32 lengths
  std::string out;
  out.reserve(s->size());
  icu::StringByteSink<std::string> sink(&out);
  size_t i = 0;
  while (i < s->size()) {
    size_t j = i;
    int len;
    while (j < s->size() && j - i < kMaxRun && (len = utf8_char_len(*s, j)) > 0) j += len;
    if (j > i) {
      UErrorCode err = U_ZERO_ERROR;
      form.normalizeUTF8(0, icu::StringPiece(s->data() + i, static_cast<int32_t>(j - i)), sink,
                         nullptr, err);
      if (U_FAILURE(err)) out.append(*s, i, j - i);  // cannot happen for valid UTF-8
    }
    while (j < s->size() && utf8_char_len(*s, j) == 0) out.push_back((*s)[j++]);
    i = j;
  }
  *s = std::move(out);
}

enum class Behavior {
  kIsolated,
  kRemoved,
  kMatchesOnly,  // Removed, inverted: the matches are kept
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};
enum class PreKind { kSplit, kByteLevel, kMetaspace, kDigits };
enum class Prepend { kAlways, kFirst, kNever };
struct PreStep {
  PreKind kind;
  std::unique_ptr<Pattern> pattern;  // Split, ByteLevel with use_regex, Digits
  Behavior behavior = Behavior::kIsolated;
  bool add_prefix_space = false;  // ByteLevel
  std::string replacement;        // Metaspace
  Prepend prepend = Prepend::kAlways;
  bool split = false;  // Metaspace
};

enum class DecKind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace };
struct DecStep {
  DecKind kind;
  std::string from, to;  // Replace; Metaspace: from = replacement
  std::string strip;     // Strip: the character
  int64_t start = 0, stop = 0;
  Prepend prepend = Prepend::kAlways;  // Metaspace
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool lstrip = false, rstrip = false;
};

// Reads fields of one JSON object with messages that name the file and the field path.
class Fields {
 public:
  Fields(const std::string& file, std::string where, const json& obj)
      : file_(file), where_(std::move(where)), obj_(obj) {}
  std::string at(const std::string& key) const { return file_ + ": " + where_ + "." + key; }
  const std::string& where() const { return where_; }
  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }

  Status string(const char* key, std::string* out, bool required) const {
    if (!has(key)) {
      return required ? Status::corrupt(at(key) + " is missing; expected a string") : Status::ok();
    }
    if (!obj_[key].is_string()) {
      return Status::corrupt(at(key) + " is " + obj_[key].dump().substr(0, 80) +
                             ", expected a string");
    }
    *out = obj_[key].get<std::string>();
    return Status::ok();
  }
  Status boolean(const char* key, bool* out) const {
    if (!has(key)) return Status::ok();
    if (!obj_[key].is_boolean()) {
      return Status::corrupt(at(key) + " is " + obj_[key].dump().substr(0, 80) +
                             ", expected true or false");
    }
    *out = obj_[key].get<bool>();
    return Status::ok();
  }
  Status integer(const char* key, int64_t lo, int64_t hi, int64_t* out, bool required) const {
    if (!has(key)) {
      return required ? Status::corrupt(at(key) + " is missing; expected an integer")
                      : Status::ok();
    }
    const json& v = obj_[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) ||
        v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
      return Status::corrupt(at(key) + " is " + v.dump().substr(0, 80) +
                             ", expected an integer in [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + "]");
    }
    *out = v.get<int64_t>();
    return Status::ok();
  }
  Status type(std::string* out) const { return string("type", out, /*required=*/true); }
  const json& operator[](const char* key) const { return obj_[key]; }

 private:
  const std::string& file_;
  std::string where_;
  const json& obj_;
};

Status expect_object(const std::string& file, const std::string& where, const json& v) {
  if (!v.is_object()) {
    return Status::corrupt(file + ": " + where + " is " + v.dump().substr(0, 80) +
                           ", expected an object");
  }
  return Status::ok();
}

// A {"String": s} or {"Regex": r} pattern.
Status read_pattern(const std::string& file, const Fields& f, const char* key,
                    std::unique_ptr<Pattern>* out) {
  if (!f.has(key)) return Status::corrupt(f.at(key) + " is missing; expected a pattern");
  const json& p = f[key];
  HR_RETURN_IF_ERROR(expect_object(file, f.where() + "." + key, p));
  Fields pf(file, f.where() + "." + key, p);
  auto pat = std::make_unique<Pattern>();
  std::string s;
  if (pf.has("Regex")) {
    HR_RETURN_IF_ERROR(pf.string("Regex", &s, true));
    HR_RETURN_IF_ERROR(pat->compile_regex(s, pf.at("Regex")));
  } else if (pf.has("String")) {
    HR_RETURN_IF_ERROR(pf.string("String", &s, true));
    pat->set_literal(s);
  } else {
    return Status::corrupt(f.at(key) + " is " + p.dump().substr(0, 80) +
                           ", expected {\"String\": ...} or {\"Regex\": ...}");
  }
  *out = std::move(pat);
  return Status::ok();
}

Status read_prepend_scheme(const Fields& f, Prepend* out) {
  std::string scheme;
  HR_RETURN_IF_ERROR(f.string("prepend_scheme", &scheme, false));
  if (!scheme.empty()) {
    if (scheme == "always") {
      *out = Prepend::kAlways;
    } else if (scheme == "first") {
      *out = Prepend::kFirst;
    } else if (scheme == "never") {
      *out = Prepend::kNever;
    } else {
      return Status::corrupt(f.at("prepend_scheme") + " is '" + printable(scheme) +
                             "', expected always, first or never");
    }
    return Status::ok();
  }
  bool add = true;  // the older spelling
  HR_RETURN_IF_ERROR(f.boolean("add_prefix_space", &add));
  *out = add ? Prepend::kAlways : Prepend::kNever;
  return Status::ok();
}

Status read_normalizer(const std::string& file, const std::string& where, const json& v, int depth,
                       std::vector<NormStep>* out) {
  if (v.is_null()) return Status::ok();
  if (depth > kMaxNesting) return Status::unsupported(file + ": " + where + " nests too deeply");
  HR_RETURN_IF_ERROR(expect_object(file, where, v));
  Fields f(file, where, v);
  std::string type;
  HR_RETURN_IF_ERROR(f.type(&type));
  if (type == "Sequence") {
    if (!f.has("normalizers") || !f["normalizers"].is_array()) {
      return Status::corrupt(f.at("normalizers") + " is missing or not an array");
    }
    for (size_t i = 0; i < f["normalizers"].size(); ++i) {
      HR_RETURN_IF_ERROR(read_normalizer(file, where + ".normalizers[" + std::to_string(i) + "]",
                                         f["normalizers"][i], depth + 1, out));
    }
  } else if (type == "Prepend") {
    NormStep s{NormKind::kPrepend, "", nullptr};
    HR_RETURN_IF_ERROR(f.string("prepend", &s.text, true));
    out->push_back(std::move(s));
  } else if (type == "Replace") {
    NormStep s{NormKind::kReplace, "", nullptr};
    HR_RETURN_IF_ERROR(read_pattern(file, f, "pattern", &s.pattern));
    HR_RETURN_IF_ERROR(f.string("content", &s.text, true));
    out->push_back(std::move(s));
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode err = U_ZERO_ERROR;
    NormStep s{NormKind::kUnicode, "", nullptr};
    s.unicode = type == "NFC"    ? icu::Normalizer2::getNFCInstance(err)
                : type == "NFD"  ? icu::Normalizer2::getNFDInstance(err)
                : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(err)
                                 : icu::Normalizer2::getNFKDInstance(err);
    if (U_FAILURE(err) || s.unicode == nullptr) {
      return Status::internal(f.at("type") + ": ICU cannot provide " + type + " (" +
                              u_errorName(err) + ")");
    }
    out->push_back(std::move(s));
  } else {
    return Status::unsupported(f.at("type") + " is '" + printable(type) +
                               "'; supported normalizers: NFC, NFD, NFKC, NFKD, Prepend, Replace, "
                               "Sequence");
  }
  return Status::ok();
}

Status read_pre_tokenizer(const std::string& file, const std::string& where, const json& v,
                          int depth, std::vector<PreStep>* out) {
  if (v.is_null()) return Status::ok();
  if (depth > kMaxNesting) return Status::unsupported(file + ": " + where + " nests too deeply");
  HR_RETURN_IF_ERROR(expect_object(file, where, v));
  Fields f(file, where, v);
  std::string type;
  HR_RETURN_IF_ERROR(f.type(&type));
  if (type == "Sequence") {
    if (!f.has("pretokenizers") || !f["pretokenizers"].is_array()) {
      return Status::corrupt(f.at("pretokenizers") + " is missing or not an array");
    }
    for (size_t i = 0; i < f["pretokenizers"].size(); ++i) {
      HR_RETURN_IF_ERROR(read_pre_tokenizer(file,
                                            where + ".pretokenizers[" + std::to_string(i) + "]",
                                            f["pretokenizers"][i], depth + 1, out));
    }
    return Status::ok();
  }
  PreStep s;
  if (type == "ByteLevel") {
    s.kind = PreKind::kByteLevel;
    HR_RETURN_IF_ERROR(f.boolean("add_prefix_space", &s.add_prefix_space));
    bool use_regex = true;
    HR_RETURN_IF_ERROR(f.boolean("use_regex", &use_regex));
    if (use_regex) {
      s.pattern = std::make_unique<Pattern>();
      HR_RETURN_IF_ERROR(s.pattern->compile_regex(kByteLevelPattern, f.at("use_regex")));
    }
  } else if (type == "Split") {
    s.kind = PreKind::kSplit;
    HR_RETURN_IF_ERROR(read_pattern(file, f, "pattern", &s.pattern));
    std::string behavior;
    HR_RETURN_IF_ERROR(f.string("behavior", &behavior, true));
    bool invert = false;
    HR_RETURN_IF_ERROR(f.boolean("invert", &invert));
    if (behavior == "Isolated") {
      s.behavior = Behavior::kIsolated;  // the same with invert: both sides are pieces
    } else if (behavior == "Removed") {
      // Inverted, the matches are kept and what lies between them is removed.
      s.behavior = invert ? Behavior::kMatchesOnly : Behavior::kRemoved;
    } else if (behavior == "MergedWithPrevious" && !invert) {
      s.behavior = Behavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext" && !invert) {
      s.behavior = Behavior::kMergedWithNext;
    } else if (behavior == "Contiguous" && !invert) {
      s.behavior = Behavior::kContiguous;
    } else {
      return Status::unsupported(f.at("behavior") + " is '" + printable(behavior) + "'" +
                                 (invert ? " with invert" : "") +
                                 "; supported: Isolated, Removed, MergedWithPrevious, "
                                 "MergedWithNext, Contiguous (the last three not inverted)");
    }
  } else if (type == "Metaspace") {
    s.kind = PreKind::kMetaspace;
    s.replacement = "\xE2\x96\x81";  // U+2581
    HR_RETURN_IF_ERROR(f.string("replacement", &s.replacement, false));
    if (s.replacement.empty()) return Status::corrupt(f.at("replacement") + " is empty");
    HR_RETURN_IF_ERROR(read_prepend_scheme(f, &s.prepend));
    s.split = true;
    HR_RETURN_IF_ERROR(f.boolean("split", &s.split));
  } else if (type == "Digits") {
    s.kind = PreKind::kDigits;
    bool individual = false;
    HR_RETURN_IF_ERROR(f.boolean("individual_digits", &individual));
    s.pattern = std::make_unique<Pattern>();
    HR_RETURN_IF_ERROR(s.pattern->compile_regex(individual ? "[0-9]" : "[0-9]+", f.at("type")));
    s.behavior = Behavior::kIsolated;
  } else {
    return Status::unsupported(f.at("type") + " is '" + printable(type) +
                               "'; supported pre-tokenizers: ByteLevel, Split, Metaspace, Digits, "
                               "Sequence");
  }
  out->push_back(std::move(s));
  return Status::ok();
}

Status read_decoder(const std::string& file, const std::string& where, const json& v, int depth,
                    std::vector<DecStep>* out) {
  if (v.is_null()) return Status::ok();
  if (depth > kMaxNesting) return Status::unsupported(file + ": " + where + " nests too deeply");
  HR_RETURN_IF_ERROR(expect_object(file, where, v));
  Fields f(file, where, v);
  std::string type;
  HR_RETURN_IF_ERROR(f.type(&type));
  if (type == "Sequence") {
    if (!f.has("decoders") || !f["decoders"].is_array()) {
      return Status::corrupt(f.at("decoders") + " is missing or not an array");
    }
    for (size_t i = 0; i < f["decoders"].size(); ++i) {
      HR_RETURN_IF_ERROR(read_decoder(file, where + ".decoders[" + std::to_string(i) + "]",
                                      f["decoders"][i], depth + 1, out));
    }
    return Status::ok();
  }
  DecStep s;
  if (type == "ByteLevel") {
    s.kind = DecKind::kByteLevel;
  } else if (type == "ByteFallback") {
    s.kind = DecKind::kByteFallback;
  } else if (type == "Fuse") {
    s.kind = DecKind::kFuse;
  } else if (type == "Replace") {
    s.kind = DecKind::kReplace;
    if (!f.has("pattern") || !f["pattern"].is_object() || !f["pattern"].contains("String")) {
      return Status::unsupported(f.at("pattern") + ": only {\"String\": ...} is supported");
    }
    Fields pf(file, where + ".pattern", f["pattern"]);
    HR_RETURN_IF_ERROR(pf.string("String", &s.from, true));
    HR_RETURN_IF_ERROR(f.string("content", &s.to, true));
    if (s.from.empty()) return Status::corrupt(pf.at("String") + " is empty");
  } else if (type == "Strip") {
    s.kind = DecKind::kStrip;
    HR_RETURN_IF_ERROR(f.string("content", &s.strip, true));
    if (s.strip.empty()) return Status::corrupt(f.at("content") + " is empty");
    HR_RETURN_IF_ERROR(f.integer("start", 0, 1 << 20, &s.start, false));
    HR_RETURN_IF_ERROR(f.integer("stop", 0, 1 << 20, &s.stop, false));
  } else if (type == "Metaspace") {
    s.kind = DecKind::kMetaspace;
    s.from = "\xE2\x96\x81";
    HR_RETURN_IF_ERROR(f.string("replacement", &s.from, false));
    if (s.from.empty()) return Status::corrupt(f.at("replacement") + " is empty");
    HR_RETURN_IF_ERROR(read_prepend_scheme(f, &s.prepend));
  } else {
    return Status::unsupported(f.at("type") + " is '" + printable(type) +
                               "'; supported decoders: ByteLevel, Replace, ByteFallback, Fuse, "
                               "Strip, Metaspace, Sequence");
  }
  out->push_back(std::move(s));
  return Status::ok();
}

void replace_all(std::string* s, const std::string& from, const std::string& to) {
  if (from.empty() || s->find(from) == std::string::npos) return;
  std::string out;
  size_t pos = 0, hit;
  while ((hit = s->find(from, pos)) != std::string::npos) {
    out.append(*s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
  }
  out.append(*s, pos, std::string::npos);
  *s = std::move(out);
}

// "<0x4A>" -> 0x4A; -1 if `t` is not such a token.
int byte_token_value(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (int k = 3; k < 5; ++k) {
    char c = t[k];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

}  // namespace

struct HfTokenizer::Impl {
  std::string name;
  std::string path;
  std::vector<std::string> id_token;  // id -> token string as in the file ("" for holes)
  Vocab vocab;                        // the model's vocabulary
  Vocab added_index;                  // added token text -> id
  MergeTable merges;
  std::vector<NormStep> normalizer;
  std::vector<PreStep> pre;
  std::vector<DecStep> decoder;
  std::vector<AddedToken> added;        // longest first, for matching
  std::array<bool, 256> added_first{};  // bytes that start an added token
  bool byte_level = false;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  bool parse_special = false;
  int32_t unk = -1, bos = -1, eos = -1;
  std::array<int32_t, 256> byte_symbol{};   // byte-level: id of each byte's character
  std::array<int32_t, 256> byte_token{};    // byte fallback: id of <0xNN>
  std::array<std::string, 256> byte_chars;  // byte-level: each byte's character, UTF-8
  std::unordered_map<uint32_t, unsigned char> char_byte;  // byte-level decoding

  void normalize(std::string* s) const;
  void pre_tokenize(Piece piece, std::vector<Piece>* out) const;
  void model_encode(std::string_view piece, std::vector<int32_t>* out) const;
  void encode_segment(std::string_view text, bool at_start, std::vector<int32_t>* out) const;
};

void HfTokenizer::Impl::normalize(std::string* s) const {
  for (const NormStep& n : normalizer) {
    if (n.kind == NormKind::kPrepend) {
      if (!s->empty()) s->insert(0, n.text);
    } else if (n.kind == NormKind::kUnicode) {
      unicode_normalize(*n.unicode, s);
    } else {
      std::string out;
      size_t last = 0;
      n.pattern->for_each_match(*s, [&](size_t b, size_t e) {
        out.append(*s, last, b - last);
        out += n.text;
        last = e;
      });
      if (last == 0 && out.empty()) continue;
      out.append(*s, last, std::string::npos);
      *s = std::move(out);
    }
  }
}

// Runs the pre-tokenizer steps over one piece. Steps apply in order to every piece the previous
// step produced, as in the Rust library.
void HfTokenizer::Impl::pre_tokenize(Piece first, std::vector<Piece>* out) const {
  std::vector<Piece> cur, next;
  cur.push_back(std::move(first));
  for (const PreStep& st : pre) {
    next.clear();
    for (Piece& p : cur) {
      switch (st.kind) {
        case PreKind::kByteLevel: {
          if (st.add_prefix_space && !p.text.starts_with(' ')) p.text = " " + p.text;
          if (!st.pattern) {
            next.push_back(std::move(p));
            break;
          }
          [[fallthrough]];
        }
        case PreKind::kSplit:
        case PreKind::kDigits: {
          const std::string& t = p.text;
          // The text as alternating spans, each a match of the pattern or a gap between matches.
          std::vector<std::pair<size_t, size_t>> spans;
          std::vector<bool> match;
          size_t last = 0;
          st.pattern->for_each_match(t, [&](size_t b, size_t e) {
            if (b > last) {
              spans.emplace_back(last, b);
              match.push_back(false);
            }
            spans.emplace_back(b, e);
            match.push_back(true);
            last = e;
          });
          if (last < t.size()) {
            spans.emplace_back(last, t.size());
            match.push_back(false);
          }
          // "the-final--countdown" split at '-': Isolated the,-,final,-,-,countdown; Removed
          // the,final,countdown; MergedWithPrevious the-,final-,-,countdown; MergedWithNext
          // the,-final,-,-countdown; Contiguous the,-,final,--,countdown.
          std::vector<std::pair<size_t, size_t>> pieces;
          bool open = false;  // the last piece may still take the next span
          for (size_t k = 0; k < spans.size(); ++k) {
            auto [b, e] = spans[k];
            const bool m = match[k];
            bool extend = false;
            switch (st.behavior) {
              case Behavior::kIsolated:
                break;
              case Behavior::kRemoved:
                if (m) continue;
                break;
              case Behavior::kMatchesOnly:
                if (!m) continue;
                break;
              case Behavior::kMergedWithPrevious:
                extend = m && open;
                open = !m;
                break;
              case Behavior::kMergedWithNext:
                extend = !m && open;
                open = m;
                break;
              case Behavior::kContiguous:
                extend = m && k > 0 && match[k - 1];
                break;
            }
            if (extend && !pieces.empty()) {
              pieces.back().second = e;
            } else {
              pieces.emplace_back(b, e);
            }
          }
          for (size_t k = 0; k < pieces.size(); ++k) {
            auto [b, e] = pieces[k];
            next.push_back({t.substr(b, e - b), p.at_start && b == 0});
          }
          break;
        }
        case PreKind::kMetaspace: {
          replace_all(&p.text, " ", st.replacement);
          const bool prepend =
              st.prepend == Prepend::kAlways || (st.prepend == Prepend::kFirst && p.at_start);
          if (prepend && !p.text.starts_with(st.replacement)) p.text.insert(0, st.replacement);
          if (!st.split) {
            next.push_back(std::move(p));
            break;
          }
          // Each replacement character starts a new piece (MergedWithNext).
          size_t b = 0;
          const std::string& r = st.replacement;
          while (b < p.text.size()) {
            size_t e = p.text.find(r, b + (p.text.compare(b, r.size(), r) == 0 ? r.size() : 0));
            if (e == std::string::npos) e = p.text.size();
            next.push_back({p.text.substr(b, e - b), p.at_start && b == 0});
            b = e;
          }
          break;
        }
      }
    }
    cur.swap(next);
  }
  for (Piece& p : cur) {
    if (!p.text.empty()) out->push_back(std::move(p));
  }
}

void HfTokenizer::Impl::model_encode(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  thread_local std::vector<int32_t> ids;
  ids.clear();
  if (byte_level) {
    if (ignore_merges) {
      std::string mapped;
      for (char c : piece) mapped += byte_chars[static_cast<unsigned char>(c)];
      auto it = vocab.find(mapped);
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    bool prev_unk = false;
    for (char c : piece) {
      int32_t id = byte_symbol[static_cast<unsigned char>(c)];
      if (id >= 0) {
        ids.push_back(id);
        prev_unk = false;
      } else if (unk >= 0 && !(fuse_unk && prev_unk)) {
        ids.push_back(unk);
        prev_unk = true;
      }
    }
  } else {
    if (ignore_merges) {
      auto it = vocab.find(piece);
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    thread_local std::vector<std::string_view> chars;
    chars.clear();
    split_chars(piece, &chars);
    bool prev_unk = false;
    for (std::string_view ch : chars) {
      auto it = vocab.find(ch);
      if (it != vocab.end()) {
        ids.push_back(it->second);
        prev_unk = false;
        continue;
      }
      if (byte_fallback) {
        bool all = true;
        for (char c : ch) all = all && byte_token[static_cast<unsigned char>(c)] >= 0;
        if (all) {
          for (char c : ch) ids.push_back(byte_token[static_cast<unsigned char>(c)]);
          prev_unk = false;
          continue;
        }
      }
      if (unk >= 0 && !(fuse_unk && prev_unk)) ids.push_back(unk);
      prev_unk = unk >= 0;
    }
  }
  bpe_merge_by_rank(merges, &ids);
  out->insert(out->end(), ids.begin(), ids.end());
}

void HfTokenizer::Impl::encode_segment(std::string_view text, bool at_start,
                                       std::vector<int32_t>* out) const {
  if (text.empty()) return;
  Piece p{std::string(text), at_start};
  normalize(&p.text);
  std::vector<Piece> pieces;
  if (pre.empty()) {
    if (!p.text.empty()) pieces.push_back(std::move(p));
  } else {
    pre_tokenize(std::move(p), &pieces);
  }
  for (const Piece& q : pieces) model_encode(q.text, out);
}

Result<HfTokenizer> HfTokenizer::load(const std::string& path, const std::string& config_path,
                                      const std::string& name, const TokenizerOptions& options) {
  HR_ASSIGN_OR_RETURN(std::string text, read_whole_file(path));
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    return Status::corrupt(path + ": not valid JSON (" + e.what() +
                           "); is the file complete? re-run scripts/get-tokenizers");
  }
  HR_RETURN_IF_ERROR(expect_object(path, "the top level", j));
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  impl->path = path;
  impl->parse_special = options.parse_special_tokens;
  Fields top(path, "tokenizer", j);

  // The model.
  if (!top.has("model")) return Status::corrupt(path + ": model is missing");
  HR_RETURN_IF_ERROR(expect_object(path, "model", j["model"]));
  Fields model(path, "model", j["model"]);
  std::string type = "BPE";
  HR_RETURN_IF_ERROR(model.string("type", &type, false));
  if (type != "BPE") {
    return Status::unsupported(model.at("type") + " is '" + printable(type) +
                               "'; headroom reads BPE models only (not WordPiece, Unigram or "
                               "WordLevel)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    std::string v;
    HR_RETURN_IF_ERROR(model.string(key, &v, false));
    if (!v.empty()) {
      return Status::unsupported(model.at(key) + " is '" + printable(v) + "'; not supported");
    }
  }
  if (model.has("dropout")) {
    const json& d = model["dropout"];
    if (!d.is_number()) return Status::corrupt(model.at("dropout") + " is not a number or null");
    if (d.get<double>() != 0.0) {
      return Status::unsupported(model.at("dropout") + " is " + d.dump() +
                                 "; BPE dropout (a training-time regulariser) is not supported");
    }
  }
  HR_RETURN_IF_ERROR(model.boolean("byte_fallback", &impl->byte_fallback));
  HR_RETURN_IF_ERROR(model.boolean("fuse_unk", &impl->fuse_unk));
  HR_RETURN_IF_ERROR(model.boolean("ignore_merges", &impl->ignore_merges));

  if (!model.has("vocab") || !model["vocab"].is_object()) {
    return Status::corrupt(model.at("vocab") + " is missing or not an object of token -> id");
  }
  int64_t max_id = -1;
  const json& jv = model["vocab"];
  impl->vocab.reserve(jv.size());
  for (auto it = jv.begin(); it != jv.end(); ++it) {
    const json& v = it.value();
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= kMaxId ||
        (v.is_number_unsigned() && v.get<uint64_t>() >= uint64_t(kMaxId))) {
      return Status::corrupt(model.at("vocab") + ": token '" + printable(it.key()) + "' has id " +
                             v.dump().substr(0, 40) + ", expected an integer in [0, 2^28)");
    }
    const auto id = static_cast<int32_t>(v.get<int64_t>());
    impl->vocab.emplace(it.key(), id);
    max_id = std::max<int64_t>(max_id, id);
  }
  if (impl->vocab.empty()) return Status::corrupt(model.at("vocab") + " is empty");

  // Added tokens.
  if (top.has("added_tokens")) {
    if (!j["added_tokens"].is_array()) {
      return Status::corrupt(path + ": added_tokens is not an array");
    }
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) {
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      HR_RETURN_IF_ERROR(expect_object(path, where, j["added_tokens"][i]));
      Fields f(path, where, j["added_tokens"][i]);
      AddedToken t;
      int64_t id = 0;
      HR_RETURN_IF_ERROR(f.integer("id", 0, kMaxId - 1, &id, true));
      t.id = static_cast<int32_t>(id);
      HR_RETURN_IF_ERROR(f.string("content", &t.content, true));
      if (t.content.empty()) return Status::corrupt(f.at("content") + " is empty");
      HR_RETURN_IF_ERROR(f.boolean("lstrip", &t.lstrip));
      HR_RETURN_IF_ERROR(f.boolean("rstrip", &t.rstrip));
      max_id = std::max<int64_t>(max_id, id);
      impl->added_index.insert_or_assign(t.content, t.id);
      impl->added.push_back(std::move(t));
    }
  }
  std::stable_sort(
      impl->added.begin(), impl->added.end(),
      [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  // Ids are dense in every real file; a few holes are fine, but an id far beyond the number of
  // tokens would make the id table absurdly large.
  const int64_t count = static_cast<int64_t>(impl->vocab.size() + impl->added.size());
  if (max_id >= count + 65536) {
    return Status::corrupt(path + ": the largest id is " + std::to_string(max_id) + " for " +
                           std::to_string(count) +
                           " tokens (model.vocab and added_tokens); ids must be nearly dense");
  }
  impl->id_token.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : impl->vocab) impl->id_token[id] = tok;
  for (const AddedToken& t : impl->added) {
    impl->id_token[t.id] = t.content;
    impl->added_first[static_cast<unsigned char>(t.content[0])] = true;
  }

  // unk, byte fallback and the byte alphabet.
  std::string unk;
  HR_RETURN_IF_ERROR(model.string("unk_token", &unk, false));
  if (!unk.empty()) {
    auto it = impl->vocab.find(unk);
    if (it == impl->vocab.end()) {
      return Status::corrupt(model.at("unk_token") + " is '" + printable(unk) +
                             "', which is not in model.vocab");
    }
    impl->unk = it->second;
  }
  impl->byte_token.fill(-1);
  impl->byte_symbol.fill(-1);
  if (impl->byte_fallback) {
    for (int b = 0; b < 256; ++b) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
      auto it = impl->vocab.find(std::string_view(buf));
      if (it != impl->vocab.end()) impl->byte_token[b] = it->second;
    }
  }

  // The pipeline.
  HR_RETURN_IF_ERROR(read_normalizer(
      path, "normalizer", top.has("normalizer") ? j["normalizer"] : json(), 0, &impl->normalizer));
  HR_RETURN_IF_ERROR(read_pre_tokenizer(path, "pre_tokenizer",
                                        top.has("pre_tokenizer") ? j["pre_tokenizer"] : json(), 0,
                                        &impl->pre));
  HR_RETURN_IF_ERROR(
      read_decoder(path, "decoder", top.has("decoder") ? j["decoder"] : json(), 0, &impl->decoder));
  for (size_t i = 0; i < impl->pre.size(); ++i) {
    if (impl->pre[i].kind == PreKind::kByteLevel) {
      if (i + 1 != impl->pre.size()) {
        return Status::unsupported(
            path + ": pre_tokenizer: ByteLevel is step " + std::to_string(i + 1) + " of " +
            std::to_string(impl->pre.size()) + "; headroom supports it only as the last step");
      }
      impl->byte_level = true;
    }
  }
  const std::array<uint32_t, 256> b2u = bytes_to_unicode();
  for (int b = 0; b < 256; ++b) {
    append_utf8(b2u[b], &impl->byte_chars[b]);
    impl->char_byte[b2u[b]] = static_cast<unsigned char>(b);
    if (!impl->byte_level) continue;
    auto it = impl->vocab.find(impl->byte_chars[b]);
    if (it != impl->vocab.end()) impl->byte_symbol[b] = it->second;
  }

  // Merges, best first: "a b" strings or ["a", "b"] pairs.
  if (!model.has("merges") || !model["merges"].is_array()) {
    return Status::corrupt(model.at("merges") + " is missing or not an array");
  }
  const json& jm = model["merges"];
  impl->merges.reserve(jm.size());
  for (size_t i = 0; i < jm.size(); ++i) {
    const json& m = jm[i];
    std::string a, b;
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() ||
          s.find(' ', sp + 1) != std::string::npos) {
        return Status::corrupt(model.at("merges") + "[" + std::to_string(i) + "] is '" +
                               printable(s) + "', expected two tokens separated by one space");
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return Status::corrupt(model.at("merges") + "[" + std::to_string(i) + "] is " +
                             m.dump().substr(0, 80) + ", expected \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = impl->vocab.find(a), ib = impl->vocab.find(b), im = impl->vocab.find(a + b);
    const std::string* missing = ia == impl->vocab.end()   ? &a
                                 : ib == impl->vocab.end() ? &b
                                                           : nullptr;
    if (missing || im == impl->vocab.end()) {
      const std::string what = missing ? *missing : a + b;
      return Status::corrupt(model.at("merges") + "[" + std::to_string(i) + "] ('" + printable(a) +
                             "' + '" + printable(b) + "') " + (missing ? "names" : "makes") +
                             " token '" + printable(what) + "', which is not in model.vocab");
    }
    // A pair listed twice keeps its last rank, as the Rust library's map does.
    impl->merges.insert_or_assign(pair_key(ia->second, ib->second),
                                  Merge{static_cast<int32_t>(i), im->second});
  }

  // bos / eos: tokenizer_config.json, else well-known names.
  auto find_id = [&](const std::string& t) -> int32_t {
    auto a = impl->added_index.find(t);
    if (a != impl->added_index.end()) return a->second;
    auto v = impl->vocab.find(t);
    return v == impl->vocab.end() ? -1 : v->second;
  };
  std::optional<std::string> bos_name, eos_name;
  HR_RETURN_IF_ERROR(read_config_special_tokens(config_path, &bos_name, &eos_name));
  for (const std::optional<std::string>* n : {&bos_name, &eos_name}) {
    if (n->has_value() && !(*n)->empty() && find_id(**n) < 0) {
      return Status::corrupt(config_path + ": " + (n == &bos_name ? "bos_token" : "eos_token") +
                             " is '" + printable(**n) +
                             "', which is neither an added token nor in the vocabulary of " + path);
    }
  }
  auto pick = [&](const std::optional<std::string>& named,
                  std::initializer_list<const char*> known) {
    if (named.has_value()) return named->empty() ? int32_t{-1} : find_id(*named);
    for (const char* k : known) {
      if (int32_t id = find_id(k); id >= 0) return id;
    }
    return int32_t{-1};
  };
  impl->bos =
      pick(bos_name, {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"});
  impl->eos = pick(eos_name, {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>"});
  return HfTokenizer(std::move(impl));
}

void HfTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  const Impl& m = *impl_;
  if (text.empty()) return;
  if (!m.parse_special || m.added.empty()) {
    m.encode_segment(text, /*at_start=*/true, out);
    return;
  }
  // Leftmost match, longest first among those starting there.
  size_t seg = 0, pos = 0;
  while (pos < text.size()) {
    const AddedToken* hit = nullptr;
    if (!m.added_first[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    for (const AddedToken& t : m.added) {
      if (text.compare(pos, t.content.size(), t.content) == 0) {
        hit = &t;
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t seg_end = pos, next = pos + hit->content.size();
    if (hit->lstrip) {
      while (seg_end > seg && is_space(text[seg_end - 1])) --seg_end;
    }
    if (hit->rstrip) {
      while (next < text.size() && is_space(text[next])) ++next;
    }
    m.encode_segment(text.substr(seg, seg_end - seg), seg == 0, out);
    out->push_back(hit->id);
    seg = pos = next;
  }
  m.encode_segment(text.substr(seg), seg == 0, out);
}

std::string HfTokenizer::decode(std::span<const int32_t> ids) const {
  const Impl& m = *impl_;
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= m.id_token.size() || m.id_token[id].empty()) {
      toks.push_back(kReplacement);
    } else {
      toks.push_back(m.id_token[id]);
    }
  }
  for (const DecStep& d : m.decoder) {
    switch (d.kind) {
      case DecKind::kByteLevel: {
        // A token all of whose characters are in GPT-2's alphabet becomes their bytes; any
        // other (an added token such as "<|eot_id|>" or "\n") stays as it is, as in the Rust
        // library. The result is one token.
        std::string out;
        std::vector<std::string_view> chars;
        for (const std::string& t : toks) {
          chars.clear();
          split_chars(t, &chars);
          const size_t before = out.size();
          bool all = true;
          for (std::string_view ch : chars) {
            int64_t cp = code_point(ch);
            auto it = cp >= 0 ? m.char_byte.find(static_cast<uint32_t>(cp)) : m.char_byte.end();
            if (it == m.char_byte.end()) {
              all = false;
              break;
            }
            out.push_back(static_cast<char>(it->second));
          }
          if (!all) {
            out.resize(before);
            out += t;
          }
        }
        toks.assign(1, std::move(out));
        break;
      }
      case DecKind::kReplace:
        for (std::string& t : toks) replace_all(&t, d.from, d.to);
        break;
      case DecKind::kByteFallback:
        for (std::string& t : toks) {
          int v = byte_token_value(t);
          if (v >= 0) t.assign(1, static_cast<char>(v));
        }
        break;
      case DecKind::kFuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecKind::kStrip:
        for (std::string& t : toks) {
          for (int64_t k = 0; k < d.start && t.starts_with(d.strip); ++k)
            t.erase(0, d.strip.size());
          for (int64_t k = 0; k < d.stop && t.ends_with(d.strip); ++k) {
            t.erase(t.size() - d.strip.size());
          }
        }
        break;
      case DecKind::kMetaspace:
        for (size_t k = 0; k < toks.size(); ++k) {
          replace_all(&toks[k], d.from, " ");
          if (k == 0 && d.prepend != Prepend::kNever && toks[k].starts_with(' ')) {
            toks[k].erase(0, 1);
          }
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

int32_t HfTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_token.size()); }
int32_t HfTokenizer::bos_token() const { return impl_->bos; }
int32_t HfTokenizer::eos_token() const { return impl_->eos; }
const std::string& HfTokenizer::name() const { return impl_->name; }
bool HfTokenizer::byte_level() const { return impl_->byte_level; }

std::string HfTokenizer::description() const {
  return impl_->path + ": " + (impl_->byte_level ? "byte-level BPE" : "SentencePiece-style BPE") +
         (impl_->byte_fallback ? " with byte fallback" : "") + ", " + std::to_string(vocab_size()) +
         " tokens, " + std::to_string(impl_->merges.size()) + " merges";
}

int32_t HfTokenizer::token_id(std::string_view token) const {
  auto a = impl_->added_index.find(token);
  if (a != impl_->added_index.end()) return a->second;
  auto v = impl_->vocab.find(token);
  return v == impl_->vocab.end() ? -1 : v->second;
}

}  // namespace headroom::data
