// GPT-2 byte-level BPE: vocabulary loading, PCRE2 pre-tokenisation, merges by rank with a cache.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/check.h"
#include "core/data_dir.h"
#include "core/log.h"
#include "core/utf8.h"
#include "data/tokenizer_util.h"

namespace headroom::data {
namespace {

using namespace tok_util;

// GPT-2's pre-tokenisation pattern, verbatim from OpenAI's encoder.py.
constexpr const char* kPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

constexpr const char* kEndOfText = "<|endoftext|>";

// Pre-tokens longer than this are not cached: they are rare and would bloat the cache.
constexpr size_t kMaxCachedWordBytes = 48;
constexpr size_t kCacheShards = 16;
constexpr size_t kMaxEntriesPerShard = 1 << 15;

// Decodes one code point of a vocabulary string (which the JSON parser produced, so it is valid
// UTF-8). Returns false on a malformed sequence.
bool next_code_point(std::string_view s, size_t* i, uint32_t* cp) {
  auto c = static_cast<unsigned char>(s[*i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || *i + len > s.size()) return false;
  uint32_t v = len == 1 ? c : c & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    auto cc = static_cast<unsigned char>(s[*i + k]);
    if ((cc & 0xC0) != 0x80) return false;
    v = (v << 6) | (cc & 0x3F);
  }
  *cp = v;
  *i += len;
  return true;
}

// Lets the word cache be searched with a string_view, without building a std::string per lookup.
struct WordHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};

// A candidate merge of the symbol at `pos` with its right neighbour. Ordered by rank, then by
// position, which reproduces GPT-2's "merge every occurrence of the best pair, left to right".
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t left;
  int32_t right;
  int32_t merged;
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

struct Gpt2Tokenizer::Impl {
  std::vector<std::string> id_bytes;  // id -> the raw bytes it stands for
  std::array<int32_t, 256> byte_id{};
  std::unordered_map<uint64_t, Merge> merges;
  int32_t eot = -1;
  pcre2_code* re = nullptr;

  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, WordHash, std::equal_to<>> words;
  };
  mutable std::array<Shard, kCacheShards> cache;

  ~Impl() {
    if (re) pcre2_code_free(re);
  }

  void bpe(std::string_view word, std::vector<int32_t>* out) const;
  void encode_word(std::string_view word, std::vector<int32_t>* out) const;
};

// Merges by rank with a heap of candidate pairs over a linked list of symbols: O(n log n), so a
// pathological pre-token (megabytes of letters without a space) stays cheap.
void Gpt2Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>* out) const {
  const int n = static_cast<int>(word.size());
  if (n == 1) {
    out->push_back(byte_id[static_cast<unsigned char>(word[0])]);
    return;
  }
  thread_local std::vector<int32_t> id, prev, next;
  thread_local std::vector<Candidate> heap;  // a min-heap through std::greater
  id.resize(n);
  prev.resize(n);
  next.resize(n);
  for (int i = 0; i < n; ++i) {
    id[i] = byte_id[static_cast<unsigned char>(word[i])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  heap.clear();
  auto consider = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    auto it = merges.find(pair_key(id[pos], id[next[pos]]));
    if (it == merges.end()) return;
    heap.push_back({it->second.rank, pos, id[pos], id[next[pos]], it->second.merged});
    std::push_heap(heap.begin(), heap.end(), std::greater<Candidate>());
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Candidate>());
    Candidate c = heap.back();
    heap.pop_back();
    // Stale if either symbol was merged away or changed since the candidate was pushed. A merged
    // symbol is marked by id -1.
    int r = next[c.pos];
    if (id[c.pos] != c.left || r < 0 || id[r] != c.right) continue;
    id[c.pos] = c.merged;
    id[r] = -1;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  }
  for (int i = 0; i >= 0; i = next[i]) out->push_back(id[i]);
}

void Gpt2Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>* out) const {
  if (word.size() == 1 || word.size() > kMaxCachedWordBytes) {
    bpe(word, out);
    return;
  }
  // The shard comes from the high bits: the map inside uses the low bits of the same hash.
  Shard& shard = cache[(WordHash()(word) >> 32) % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.words.find(word);
    if (it != shard.words.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t before = out->size();
  bpe(word, out);
  std::vector<int32_t> ids(out->begin() + static_cast<std::ptrdiff_t>(before), out->end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.words.size() >= kMaxEntriesPerShard) shard.words.clear();  // bounded memory
  shard.words.emplace(std::string(word), std::move(ids));
}

Result<std::string> find_vocab_dir() {
  const char* env = std::getenv("HEADROOM_VOCAB_DIR");
  if (env && *env) return std::string(env);
  HR_ASSIGN_OR_RETURN(DataCandidate found, find_data(DataItem::kGpt2Vocab));
  return found.path;
}

std::string default_vocab_dir() {
  Result<std::string> dir = find_vocab_dir();
  return dir.is_ok() ? *dir : std::string();
}

Result<Gpt2Tokenizer> Gpt2Tokenizer::load(const std::string& dir) {
  std::string vocab_path, merges_path;
  if (file_exists(dir + "/vocab.json") && file_exists(dir + "/merges.txt")) {
    vocab_path = dir + "/vocab.json";
    merges_path = dir + "/merges.txt";
  } else if (file_exists(dir + "/encoder.json") && file_exists(dir + "/vocab.bpe")) {
    vocab_path = dir + "/encoder.json";
    merges_path = dir + "/vocab.bpe";
  } else {
    return Status::not_found(
        "GPT-2 vocabulary not found in '" + dir +
        "': expected vocab.json + merges.txt or encoder.json + vocab.bpe; run "
        "scripts/get-gpt2-vocab, or point HEADROOM_VOCAB_DIR at a directory that has them");
  }

  auto impl = std::make_shared<Impl>();
  const std::array<uint32_t, 256> byte_to_cp = bytes_to_unicode();
  std::unordered_map<uint32_t, unsigned char> cp_to_byte;
  for (int b = 0; b < 256; ++b) cp_to_byte[byte_to_cp[b]] = static_cast<unsigned char>(b);

  // The vocabulary: token string (in GPT-2's byte alphabet) -> id.
  HR_ASSIGN_OR_RETURN(std::string vocab_text, read_whole_file(vocab_path));
  std::unordered_map<std::string, int32_t> encoder;
  try {
    nlohmann::json j = nlohmann::json::parse(vocab_text);
    if (!j.is_object()) {
      return Status::corrupt(vocab_path + ": expected a JSON object of token -> id; re-run " +
                             "scripts/get-gpt2-vocab");
    }
    encoder.reserve(j.size());
    int64_t max_id = -1;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
          it.value().get<int64_t>() > (1 << 30)) {
        return Status::corrupt(vocab_path + ": token '" + it.key() + "' has id " +
                               dump_json(it.value()) + ", expected a non-negative integer");
      }
      auto id = static_cast<int32_t>(it.value().get<int64_t>());
      encoder.emplace(it.key(), id);
      max_id = std::max<int64_t>(max_id, id);
    }
    if (max_id < 0) return Status::corrupt(vocab_path + ": the vocabulary is empty");
    impl->id_bytes.assign(static_cast<size_t>(max_id + 1), std::string());
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(vocab_path + ": not valid JSON (" + e.what() +
                           "); re-run scripts/get-gpt2-vocab");
  }
  std::vector<bool> seen(impl->id_bytes.size(), false);
  for (const auto& [token, id] : encoder) {
    if (seen[id]) {
      return Status::corrupt(vocab_path + ": id " + std::to_string(id) +
                             " is used by more than one token (one is '" + token + "')");
    }
    seen[id] = true;
    std::string bytes;
    size_t i = 0;
    uint32_t cp = 0;
    while (i < token.size()) {
      if (!next_code_point(token, &i, &cp) || !cp_to_byte.count(cp)) {
        return Status::corrupt(vocab_path + ": token '" + token + "' (id " + std::to_string(id) +
                               ") has a character outside GPT-2's byte alphabet");
      }
      bytes.push_back(static_cast<char>(cp_to_byte[cp]));
    }
    impl->id_bytes[id] = std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(byte_to_cp[b], &s);
    auto it = encoder.find(s);
    if (it == encoder.end()) {
      return Status::corrupt(vocab_path + ": no token for byte " + std::to_string(b) +
                             "; a byte-level BPE vocabulary needs all 256");
    }
    impl->byte_id[b] = it->second;
  }
  auto eot_it = encoder.find(kEndOfText);
  if (eot_it == encoder.end()) {
    return Status::corrupt(vocab_path + ": no '<|endoftext|>' token; not a GPT-2 vocabulary");
  }
  impl->eot = eot_it->second;

  // The merges, one "left right" pair a line, best first.
  HR_ASSIGN_OR_RETURN(std::string merges_text, read_whole_file(merges_path));
  impl->merges.reserve(60000);
  int32_t rank = 0;
  size_t line_no = 0;
  size_t start = 0;
  while (start < merges_text.size()) {
    size_t end = merges_text.find('\n', start);
    if (end == std::string::npos) end = merges_text.size();
    std::string_view line(merges_text.data() + start, end - start);
    start = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.starts_with("#version")) continue;
    size_t space = line.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string_view::npos) {
      return Status::corrupt(merges_path + ":" + std::to_string(line_no) +
                             ": expected two tokens " + "separated by one space, got '" +
                             std::string(line) + "'");
    }
    std::string left(line.substr(0, space)), right(line.substr(space + 1));
    auto l = encoder.find(left), r = encoder.find(right), m = encoder.find(left + right);
    if (l == encoder.end() || r == encoder.end() || m == encoder.end()) {
      return Status::corrupt(merges_path + ":" + std::to_string(line_no) + ": merge '" +
                             std::string(line) + "' uses a token missing from " + vocab_path +
                             "; the two files do not belong together");
    }
    // A pair listed twice keeps its last rank, as OpenAI's dict(zip(merges, range(...))) does.
    impl->merges.insert_or_assign(pair_key(l->second, r->second), Merge{rank, m->second});
    ++rank;
  }

  // Compile the pattern once. UCP makes \s, \p{L}, \p{N} Unicode-aware; MATCH_INVALID_UTF lets
  // the matcher run over invalid UTF-8, which it never matches (see encode_append).
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  impl->re =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(kPattern), PCRE2_ZERO_TERMINATED,
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset, nullptr);
  if (!impl->re) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    return Status::internal(std::string("PCRE2 cannot compile GPT-2's pattern at offset ") +
                            std::to_string(err_offset) + ": " + reinterpret_cast<char*>(buf));
  }
  // JIT is an optimisation only; the interpreter gives the same matches.
  if (pcre2_jit_compile(impl->re, PCRE2_JIT_COMPLETE) != 0) {
    log_debug("PCRE2 JIT unavailable; the tokenizer uses the (slower) interpreter");
  }
  return Gpt2Tokenizer(std::move(impl));
}

void Gpt2Tokenizer::encode_append(std::string_view text, std::vector<int32_t>* out) const {
  if (text.empty()) return;
  out->reserve(out->size() + text.size() / 4 + 16);
  // One match block per call, reused for every match in `text`.
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
      pcre2_match_data_create_from_pattern(impl_->re, nullptr), &pcre2_match_data_free);
  HR_CHECK(md != nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t n = text.size();
  size_t pos = 0;
  while (pos < n) {
    int rc = pcre2_match(impl_->re, subject, n, pos, 0, md.get(), nullptr);
    size_t start, end;
    if (rc == PCRE2_ERROR_NOMATCH) {
      start = end = n;
    } else if (rc < 0) {
      // A resource limit (not expected for this pattern): keep going one byte at a time, so the
      // output still decodes to the input.
      start = pos;
      end = pos + 1;
    } else {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      start = ov[0];
      end = ov[1];
      HR_CHECK(start >= pos && end > start && end <= n);  // the pattern never matches empty
    }
    // Bytes the pattern skipped are invalid UTF-8: encode them as one pre-token of raw bytes.
    if (start > pos) impl_->encode_word(text.substr(pos, start - pos), out);
    if (end > start) impl_->encode_word(text.substr(start, end - start), out);
    pos = end;
  }
}

std::string Gpt2Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  for (int32_t id : ids) {
    if (id >= 0 && static_cast<size_t>(id) < impl_->id_bytes.size()) {
      out += impl_->id_bytes[id];
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER
    }
  }
  return out;
}

int32_t Gpt2Tokenizer::eot_token() const { return impl_->eot; }

int32_t Gpt2Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_bytes.size()); }

const std::string& Gpt2Tokenizer::name() const {
  static const std::string kName = "gpt2";
  return kName;
}

std::string Gpt2Tokenizer::description() const {
  return "GPT-2 byte-level BPE, " + std::to_string(vocab_size()) + " tokens";
}

}  // namespace headroom::data
