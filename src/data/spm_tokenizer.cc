// SentencePiece tokenizer.model: a bounds-checked protobuf wire-format reader for ModelProto and
// SentencePiece's BPE encoding (merge the highest-scoring pair first). See spm_tokenizer.h.
#include "data/spm_tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <unordered_map>

#include "data/tokenizer_util.h"

namespace headroom::data {
namespace {

using namespace tok_util;

constexpr const char* kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space
constexpr int kModelTypeBpe = 2;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using PieceIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Protobuf wire format over one message's bytes. Offsets in messages are from the file's start.
class Wire {
 public:
  Wire(std::string_view bytes, size_t base, const std::string& path, std::string msg)
      : data_(bytes), base_(base), path_(path), msg_(std::move(msg)) {}

  bool done() const { return pos_ >= data_.size(); }
  size_t offset() const { return base_ + pos_; }

  Status varint(uint64_t* out, const std::string& field) {
    uint64_t v = 0;
    const size_t start = pos_;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) {
        return Status::corrupt(where(field, start) +
                               ": truncated varint (the file ends inside it)");
      }
      auto b = static_cast<unsigned char>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *out = v;
        return Status::ok();
      }
    }
    return Status::corrupt(where(field, start) + ": varint longer than 10 bytes");
  }

  // Reads a field's tag; field 0 and wire types 3, 4 (groups), 6, 7 are refused.
  Status tag(uint32_t* field, int* wire_type) {
    const size_t start = pos_;
    uint64_t t = 0;
    HR_RETURN_IF_ERROR(varint(&t, "tag"));
    *field = static_cast<uint32_t>(t >> 3);
    *wire_type = static_cast<int>(t & 7);
    if (t >> 3 == 0 || t >> 3 > 0x1FFFFFFF) {
      return Status::corrupt(where("tag", start) + ": field number " + std::to_string(t >> 3) +
                             " is invalid; not a SentencePiece model");
    }
    if (*wire_type != 0 && *wire_type != 1 && *wire_type != 2 && *wire_type != 5) {
      return Status::corrupt(where("field " + std::to_string(*field), start) + ": wire type " +
                             std::to_string(*wire_type) +
                             " is not used by SentencePiece models; the file is damaged");
    }
    return Status::ok();
  }

  Status bytes(std::string_view* out, size_t* at, const std::string& field) {
    const size_t start = pos_;
    uint64_t len = 0;
    HR_RETURN_IF_ERROR(varint(&len, field));
    if (len > data_.size() - pos_) {
      return Status::corrupt(where(field, start) + ": length " + std::to_string(len) +
                             " runs past the end of its message (" +
                             std::to_string(data_.size() - pos_) +
                             " bytes left); the file is truncated or damaged");
    }
    *at = base_ + pos_;
    *out = data_.substr(pos_, static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return Status::ok();
  }

  Status fixed32(uint32_t* out, const std::string& field) {
    if (data_.size() - pos_ < 4) {
      return Status::corrupt(where(field, pos_) + ": truncated 4-byte value");
    }
    uint32_t v = 0;
    for (int k = 3; k >= 0; --k) v = (v << 8) | static_cast<unsigned char>(data_[pos_ + k]);
    pos_ += 4;
    *out = v;
    return Status::ok();
  }

  Status skip(int wire_type, const std::string& field) {
    uint64_t v = 0;
    std::string_view s;
    size_t at = 0;
    switch (wire_type) {
      case 0:
        return varint(&v, field);
      case 1:
        if (data_.size() - pos_ < 8) return Status::corrupt(where(field, pos_) + ": truncated");
        pos_ += 8;
        return Status::ok();
      case 2:
        return bytes(&s, &at, field);
      default: {
        uint32_t x = 0;
        return fixed32(&x, field);
      }
    }
  }

  Status expect(int wire_type, int want, const std::string& field) const {
    if (wire_type == want) return Status::ok();
    return Status::corrupt(where(field, pos_) + ": wire type " + std::to_string(wire_type) +
                           ", expected " + std::to_string(want) + "; the file is damaged");
  }

  std::string where(const std::string& field, size_t at) const {
    return path_ + ": " + msg_ + (field.empty() ? "" : "." + field) + " at byte " +
           std::to_string(base_ + at);
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
  size_t base_;
  const std::string& path_;
  std::string msg_;
};

}  // namespace

struct SpmTokenizer::Impl {
  std::string name, path;
  std::vector<Piece> pieces;
  PieceIndex mergeable;  // NORMAL, USER_DEFINED and UNUSED pieces: what merges may produce
  std::vector<std::pair<std::string, int32_t>> user_defined;  // longest first
  std::vector<std::pair<std::string, int32_t>> control;       // longest first
  std::array<int32_t, 256> byte_piece{};
  bool byte_fallback = false;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
  int32_t unk = -1, bos = -1, eos = -1;
  std::string unk_surface = " \xE2\x81\x87 ";  // " ⁇ "

  void encode_text(std::string_view text, std::vector<int32_t>* out) const;
  void emit(
      std::string_view piece, std::vector<int32_t>* out, bool* prev_unk,
      const std::unordered_map<std::string, std::pair<std::string, std::string>>& split) const;
};

namespace {

Status parse_piece(std::string_view msg, size_t base, const std::string& path, size_t index,
                   SpmTokenizer::Piece* out) {
  Wire w(msg, base, path, "pieces[" + std::to_string(index) + "]");
  bool have_piece = false;
  while (!w.done()) {
    uint32_t field = 0;
    int wt = 0;
    HR_RETURN_IF_ERROR(w.tag(&field, &wt));
    if (field == 1) {
      HR_RETURN_IF_ERROR(w.expect(wt, 2, "piece"));
      std::string_view s;
      size_t at = 0;
      HR_RETURN_IF_ERROR(w.bytes(&s, &at, "piece"));
      out->piece.assign(s);
      have_piece = true;
    } else if (field == 2) {
      HR_RETURN_IF_ERROR(w.expect(wt, 5, "score"));
      uint32_t bits = 0;
      HR_RETURN_IF_ERROR(w.fixed32(&bits, "score"));
      float f = 0;
      std::memcpy(&f, &bits, 4);
      if (!std::isfinite(f)) {
        return Status::corrupt(w.where("score", 0) + ": score is " + std::to_string(f) +
                               ", expected a finite number");
      }
      out->score = f;
    } else if (field == 3) {
      HR_RETURN_IF_ERROR(w.expect(wt, 0, "type"));
      uint64_t t = 0;
      HR_RETURN_IF_ERROR(w.varint(&t, "type"));
      if (t < 1 || t > 6) {
        return Status::corrupt(w.where("type", 0) + ": type is " + std::to_string(t) +
                               ", expected 1 (NORMAL) to 6 (BYTE)");
      }
      out->type = static_cast<int>(t);
    } else {
      HR_RETURN_IF_ERROR(w.skip(wt, "field " + std::to_string(field)));
    }
  }
  if (!have_piece || out->piece.empty()) {
    return Status::corrupt(w.where("piece", 0) + ": the piece string is missing or empty");
  }
  return Status::ok();
}

// Reads an int32 field written as a varint (negative values take ten bytes).
int32_t as_int32(uint64_t v) { return static_cast<int32_t>(static_cast<int64_t>(v)); }

}  // namespace

Result<SpmTokenizer> SpmTokenizer::load(const std::string& model_path,
                                        const std::string& config_path, const std::string& name,
                                        const TokenizerOptions& options) {
  HR_ASSIGN_OR_RETURN(std::string bytes, read_whole_file(model_path));
  HR_ASSIGN_OR_RETURN(SpmTokenizer t, parse(bytes, model_path, name, options));
  std::optional<std::string> bos, eos;
  HR_RETURN_IF_ERROR(read_config_special_tokens(config_path, &bos, &eos));
  if (!bos.has_value() && !eos.has_value()) return t;
  auto impl = std::make_shared<Impl>(*t.impl_);
  for (auto [named, dst, key] :
       {std::tuple{&bos, &impl->bos, "bos_token"}, std::tuple{&eos, &impl->eos, "eos_token"}}) {
    if (!named->has_value()) continue;
    if ((*named)->empty()) {  // null: the model has none
      *dst = -1;
      continue;
    }
    const std::string& want = **named;  // (clang 14 cannot capture a structured binding)
    auto it = std::find_if(impl->pieces.begin(), impl->pieces.end(),
                           [&want](const Piece& p) { return p.piece == want; });
    if (it == impl->pieces.end()) {
      return Status::corrupt(config_path + ": " + key + " is '" + printable(want) +
                             "', which is not a piece of " + model_path);
    }
    *dst = static_cast<int32_t>(it - impl->pieces.begin());
  }
  return SpmTokenizer(std::move(impl));
}

Result<SpmTokenizer> SpmTokenizer::parse(std::string_view bytes, const std::string& path,
                                         const std::string& name, const TokenizerOptions& options) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  impl->path = path;
  int64_t model_type = 1;  // UNIGRAM, protobuf's default
  bool have_trainer = false, suffix = false;
  int64_t unk_id = 0, bos_id = 1, eos_id = 2;
  size_t charsmap_bytes = 0;
  std::string normalizer_name;

  Wire top(bytes, 0, path, "ModelProto");
  while (!top.done()) {
    uint32_t field = 0;
    int wt = 0;
    HR_RETURN_IF_ERROR(top.tag(&field, &wt));
    if (field == 1) {
      HR_RETURN_IF_ERROR(top.expect(wt, 2, "pieces"));
      std::string_view msg;
      size_t at = 0;
      HR_RETURN_IF_ERROR(
          top.bytes(&msg, &at, "pieces[" + std::to_string(impl->pieces.size()) + "]"));
      if (impl->pieces.size() >= (size_t{1} << 24)) {
        return Status::corrupt(top.where("pieces", 0) + ": more than 2^24 pieces");
      }
      Piece p;
      HR_RETURN_IF_ERROR(parse_piece(msg, at, path, impl->pieces.size(), &p));
      impl->pieces.push_back(std::move(p));
    } else if (field == 2 || field == 3) {
      HR_RETURN_IF_ERROR(top.expect(wt, 2, field == 2 ? "trainer_spec" : "normalizer_spec"));
      std::string_view msg;
      size_t at = 0;
      HR_RETURN_IF_ERROR(top.bytes(&msg, &at, field == 2 ? "trainer_spec" : "normalizer_spec"));
      Wire w(msg, at, path, field == 2 ? "trainer_spec" : "normalizer_spec");
      if (field == 2) have_trainer = true;
      while (!w.done()) {
        uint32_t f = 0;
        int t = 0;
        HR_RETURN_IF_ERROR(w.tag(&f, &t));
        uint64_t v = 0;
        std::string_view s;
        size_t sat = 0;
        auto read_varint = [&](const char* what) -> Status {
          HR_RETURN_IF_ERROR(w.expect(t, 0, what));
          return w.varint(&v, what);
        };
        auto read_bytes = [&](const char* what) -> Status {
          HR_RETURN_IF_ERROR(w.expect(t, 2, what));
          return w.bytes(&s, &sat, what);
        };
        if (field == 2 && f == 3) {
          HR_RETURN_IF_ERROR(read_varint("model_type"));
          model_type = static_cast<int64_t>(v);
        } else if (field == 2 && f == 24) {
          HR_RETURN_IF_ERROR(read_varint("treat_whitespace_as_suffix"));
          suffix = v != 0;
        } else if (field == 2 && f == 35) {
          HR_RETURN_IF_ERROR(read_varint("byte_fallback"));
          impl->byte_fallback = v != 0;
        } else if (field == 2 && f == 40) {
          HR_RETURN_IF_ERROR(read_varint("unk_id"));
          unk_id = as_int32(v);
        } else if (field == 2 && f == 41) {
          HR_RETURN_IF_ERROR(read_varint("bos_id"));
          bos_id = as_int32(v);
        } else if (field == 2 && f == 42) {
          HR_RETURN_IF_ERROR(read_varint("eos_id"));
          eos_id = as_int32(v);
        } else if (field == 2 && f == 44) {
          HR_RETURN_IF_ERROR(read_bytes("unk_surface"));
          impl->unk_surface.assign(s);
        } else if (field == 3 && f == 1) {
          HR_RETURN_IF_ERROR(read_bytes("name"));
          normalizer_name.assign(s);
        } else if (field == 3 && f == 2) {
          HR_RETURN_IF_ERROR(read_bytes("precompiled_charsmap"));
          charsmap_bytes = s.size();
        } else if (field == 3 && f == 3) {
          HR_RETURN_IF_ERROR(read_varint("add_dummy_prefix"));
          impl->add_dummy_prefix = v != 0;
        } else if (field == 3 && f == 4) {
          HR_RETURN_IF_ERROR(read_varint("remove_extra_whitespaces"));
          impl->remove_extra_whitespaces = v != 0;
        } else if (field == 3 && f == 5) {
          HR_RETURN_IF_ERROR(read_varint("escape_whitespaces"));
          impl->escape_whitespaces = v != 0;
        } else {
          HR_RETURN_IF_ERROR(w.skip(t, "field " + std::to_string(f)));
        }
      }
    } else {
      HR_RETURN_IF_ERROR(top.skip(wt, "field " + std::to_string(field)));
    }
  }

  if (impl->pieces.empty()) {
    return Status::corrupt(path +
                           ": no pieces (ModelProto field 1); not a SentencePiece model, "
                           "or an empty one");
  }
  if (!have_trainer || model_type != kModelTypeBpe) {
    static const char* kTypes[] = {"?", "UNIGRAM", "BPE", "WORD", "CHAR"};
    const std::string tn = model_type >= 1 && model_type <= 4 ? kTypes[model_type] : "?";
    return Status::unsupported(path + ": trainer_spec.model_type is " + tn + " (" +
                               std::to_string(model_type) + ")" +
                               (have_trainer ? "" : " (no trainer_spec: protobuf's default)") +
                               "; headroom reads BPE SentencePiece models only");
  }
  if (suffix) {
    return Status::unsupported(path +
                               ": trainer_spec.treat_whitespace_as_suffix is true; "
                               "not supported");
  }
  if (charsmap_bytes > 0) {
    return Status::unsupported(path + ": normalizer_spec '" + printable(normalizer_name) +
                               "' has a precompiled_charsmap of " + std::to_string(charsmap_bytes) +
                               " bytes; headroom supports identity normalization only");
  }

  const auto n = static_cast<int64_t>(impl->pieces.size());
  impl->byte_piece.fill(-1);
  PieceIndex all;
  all.reserve(impl->pieces.size());
  for (int64_t i = 0; i < n; ++i) {
    const Piece& p = impl->pieces[i];
    if (!all.emplace(p.piece, static_cast<int32_t>(i)).second) {
      return Status::corrupt(path + ": pieces[" + std::to_string(i) + "] '" + printable(p.piece) +
                             "' is also pieces[" + std::to_string(all[p.piece]) +
                             "]; each piece must be unique");
    }
    switch (p.type) {
      case kNormal:
      case kUnused:
        impl->mergeable.emplace(p.piece, static_cast<int32_t>(i));
        break;
      case kUserDefined:
        impl->mergeable.emplace(p.piece, static_cast<int32_t>(i));
        impl->user_defined.emplace_back(p.piece, static_cast<int32_t>(i));
        break;
      case kControl:
        impl->control.emplace_back(p.piece, static_cast<int32_t>(i));
        break;
      case kByte: {
        int v = -1;
        if (p.piece.size() == 6 && p.piece.starts_with("<0x") && p.piece[5] == '>') {
          v = 0;
          for (int k = 3; k < 5; ++k) {
            char c = p.piece[k];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
            v = d < 0 || v < 0 ? -1 : v * 16 + d;
          }
        }
        if (v < 0) {
          return Status::corrupt(path + ": pieces[" + std::to_string(i) + "] '" +
                                 printable(p.piece) + "' has type BYTE but is not <0xNN>");
        }
        impl->byte_piece[v] = static_cast<int32_t>(i);
        break;
      }
      default:
        break;
    }
  }
  if (unk_id < 0 || unk_id >= n || impl->pieces[unk_id].type != kUnknown) {
    return Status::corrupt(path + ": trainer_spec.unk_id is " + std::to_string(unk_id) +
                           ", which is not a piece of type UNKNOWN (" + std::to_string(n) +
                           " pieces)");
  }
  impl->unk = static_cast<int32_t>(unk_id);
  impl->bos = bos_id >= 0 && bos_id < n ? static_cast<int32_t>(bos_id) : -1;
  impl->eos = eos_id >= 0 && eos_id < n ? static_cast<int32_t>(eos_id) : -1;
  auto longest_first = [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); };
  std::stable_sort(impl->user_defined.begin(), impl->user_defined.end(), longest_first);
  std::stable_sort(impl->control.begin(), impl->control.end(), longest_first);
  if (!options.parse_special_tokens) impl->control.clear();
  return SpmTokenizer(std::move(impl));
}

// Appends the ids of one final symbol: its piece (UNUSED pieces split back into what made them),
// else its bytes with byte fallback, else unk.
void SpmTokenizer::Impl::emit(
    std::string_view piece, std::vector<int32_t>* out, bool* prev_unk,
    const std::unordered_map<std::string, std::pair<std::string, std::string>>& split) const {
  auto it = mergeable.find(piece);
  if (it != mergeable.end()) {
    if (pieces[it->second].type == kUnused) {
      auto s = split.find(std::string(piece));
      if (s != split.end()) {
        emit(s->second.first, out, prev_unk, split);
        emit(s->second.second, out, prev_unk, split);
        return;
      }
    }
    out->push_back(it->second);
    *prev_unk = false;
    return;
  }
  if (byte_fallback) {
    bool all = true;
    for (char c : piece) all = all && byte_piece[static_cast<unsigned char>(c)] >= 0;
    if (all) {
      for (char c : piece) out->push_back(byte_piece[static_cast<unsigned char>(c)]);
      *prev_unk = false;
      return;
    }
  }
  if (!*prev_unk) out->push_back(unk);  // a run of unknown symbols is one unk
  *prev_unk = true;
}

void SpmTokenizer::Impl::encode_text(std::string_view text, std::vector<int32_t>* out) const {
  // Normalize.
  std::string norm;
  norm.reserve(text.size() + 8);
  std::string_view t = text;
  if (remove_extra_whitespaces) {
    while (!t.empty() && t.front() == ' ') t.remove_prefix(1);
    while (!t.empty() && t.back() == ' ') t.remove_suffix(1);
  }
  if (t.empty()) return;
  const std::string space = escape_whitespaces ? kSpace : " ";
  if (add_dummy_prefix) norm += space;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == ' ') {
      if (remove_extra_whitespaces && i > 0 && t[i - 1] == ' ') continue;
      norm += space;
    } else {
      norm.push_back(t[i]);
    }
  }

  // Initial symbols: user-defined pieces (frozen), else characters. Symbols are [begin, end)
  // ranges of `norm` in a linked list; a merged-away symbol has begin == end.
  struct Sym {
    uint32_t begin, end;
    int32_t prev, next;
    bool frozen;
  };
  std::vector<Sym> sym;
  for (size_t i = 0; i < norm.size();) {
    size_t len = 0;
    bool frozen = false;
    for (const auto& [p, id] : user_defined) {
      if (norm.compare(i, p.size(), p) == 0) {
        len = p.size();
        frozen = true;
        break;
      }
    }
    if (len == 0) {
      int l = utf8_char_len(norm, i);
      len = l > 0 ? static_cast<size_t>(l) : 1;
    }
    const auto k = static_cast<int32_t>(sym.size());
    sym.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(i + len), k - 1, k + 1, frozen});
    i += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  // Candidates: highest score first, then leftmost.
  struct Cand {
    float score;
    int32_t left, right;
    uint32_t size;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    return a.score != b.score ? a.score < b.score : a.left > b.left;
  };
  std::vector<Cand> heap;
  std::unordered_map<std::string, std::pair<std::string, std::string>> unused_split;
  auto view = [&](const Sym& s) { return std::string_view(norm).substr(s.begin, s.end - s.begin); };
  auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || sym[l].frozen || sym[r].frozen) return;
    std::string_view both = std::string_view(norm).substr(sym[l].begin, sym[r].end - sym[l].begin);
    auto it = mergeable.find(both);
    if (it == mergeable.end()) return;
    heap.push_back({pieces[it->second].score, l, r, static_cast<uint32_t>(both.size())});
    std::push_heap(heap.begin(), heap.end(), worse);
    if (pieces[it->second].type == kUnused) {
      unused_split.emplace(std::string(both),
                           std::pair{std::string(view(sym[l])), std::string(view(sym[r]))});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    Cand c = heap.back();
    heap.pop_back();
    Sym& l = sym[c.left];
    Sym& r = sym[c.right];
    // Stale if either side was merged away or grew since the candidate was pushed.
    if (l.begin == l.end || r.begin == r.end || l.next != c.right ||
        (l.end - l.begin) + (r.end - r.begin) != c.size) {
      continue;
    }
    l.end = r.end;
    r.begin = r.end;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = c.left;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }

  bool prev_unk = false;
  for (int32_t i = 0; i >= 0; i = sym[i].next) emit(view(sym[i]), out, &prev_unk, unused_split);
}

void SpmTokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  const Impl& m = *impl_;
  if (m.control.empty()) {
    m.encode_text(text, out);
    return;
  }
  size_t seg = 0, pos = 0;
  while (pos < text.size()) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (const auto& c : m.control) {
      if (text.compare(pos, c.first.size(), c.first) == 0) {
        hit = &c;
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    m.encode_text(text.substr(seg, pos - seg), out);
    out->push_back(hit->second);
    seg = pos = pos + hit->first.size();
  }
  m.encode_text(text.substr(seg), out);
}

std::string SpmTokenizer::decode(std::span<const int32_t> ids) const {
  const Impl& m = *impl_;
  std::string out;
  bool first = true;  // the first piece that writes text loses the dummy prefix's space
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(m.pieces.size())) {
      out += "\xEF\xBF\xBD";
      first = false;
      continue;
    }
    const Piece& p = m.pieces[id];
    switch (p.type) {
      case kControl:
        continue;
      case kUnknown:
        out += m.unk_surface;
        break;
      case kByte: {
        auto it = std::find(m.byte_piece.begin(), m.byte_piece.end(), id);
        out.push_back(static_cast<char>(it - m.byte_piece.begin()));
        break;
      }
      default: {
        std::string_view s = p.piece;
        if (first && m.add_dummy_prefix && s.starts_with(kSpace)) s.remove_prefix(3);
        size_t k = 0, hit;
        while ((hit = s.find(kSpace, k)) != std::string_view::npos) {
          out.append(s.substr(k, hit - k));
          out.push_back(' ');
          k = hit + 3;
        }
        out.append(s.substr(k));
        break;
      }
    }
    first = false;
  }
  return out;
}

int32_t SpmTokenizer::vocab_size() const { return static_cast<int32_t>(impl_->pieces.size()); }
int32_t SpmTokenizer::bos_token() const { return impl_->bos; }
int32_t SpmTokenizer::eos_token() const { return impl_->eos; }
int32_t SpmTokenizer::unk_token() const { return impl_->unk; }
const std::string& SpmTokenizer::name() const { return impl_->name; }
const std::vector<SpmTokenizer::Piece>& SpmTokenizer::pieces() const { return impl_->pieces; }

std::string SpmTokenizer::description() const {
  return impl_->path + ": SentencePiece BPE" + (impl_->byte_fallback ? " with byte fallback" : "") +
         ", " + std::to_string(vocab_size()) + " pieces";
}

}  // namespace headroom::data
