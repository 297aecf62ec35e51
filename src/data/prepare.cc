// Input discovery, text checks, document splitting and parallel tokenisation for `prepare`.
#include "data/prepare.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <system_error>
#include <thread>

#include "core/log.h"
#include "data/token_file.h"
#include "data/tokenizer.h"

namespace headroom::data {
namespace fs = std::filesystem;
namespace {

constexpr double kMaxInvalidUtf8Fraction = 0.10;

bool is_json_lines(const std::string& path) {
  const std::string_view p(path);
  return p.ends_with(".jsonl") || p.ends_with(".ndjson");
}

bool skipped_name(const std::string& name) {
  auto ends_with = [&](std::string_view s) { return std::string_view(name).ends_with(s); };
  return name.empty() || name[0] == '.' || ends_with(".dat") || ends_with(".u8");
}

// Expands files and directories into a list of files, in the documented order.
Status collect_inputs(const std::vector<std::string>& inputs, const std::string& out,
                      std::vector<std::string>* files) {
  std::error_code ec;
  const fs::path out_abs = fs::weakly_canonical(out, ec);
  for (const std::string& input : inputs) {
    fs::file_status st = fs::status(input, ec);
    if (ec || !fs::exists(st)) {
      return Status::not_found("input '" + input + "' does not exist; check the path");
    }
    if (fs::is_regular_file(st)) {
      files->push_back(input);
      continue;
    }
    if (!fs::is_directory(st)) {
      return Status::invalid_argument("input '" + input +
                                      "' is neither a regular file nor a directory");
    }
    std::vector<std::string> found;
    fs::recursive_directory_iterator it(input, ec), end;
    if (ec) return Status::io_error("input '" + input + "': cannot list: " + ec.message());
    for (; it != end; it.increment(ec)) {
      if (ec) return Status::io_error("input '" + input + "': cannot list: " + ec.message());
      const std::string name = it->path().filename().string();
      if (skipped_name(name)) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file(ec)) continue;
      // Re-running prepare with the output inside an input directory must not read the output.
      if (fs::weakly_canonical(it->path(), ec) == out_abs) continue;
      found.push_back(it->path().string());
    }
    if (found.empty()) {
      return Status::invalid_argument("input directory '" + input +
                                      "' has no text files (hidden files and names ending in "
                                      ".dat or .u8 are skipped)");
    }
    std::sort(found.begin(), found.end());
    files->insert(files->end(), found.begin(), found.end());
  }
  return Status::ok();
}

Status check_output(const std::string& out) {
  std::error_code ec;
  if (fs::is_directory(out, ec)) {
    return Status::invalid_argument(
        "output '" + out + "' is a directory; give a file name such as " + out + "/tokens.bin");
  }
  fs::path dir = fs::path(out).parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec)) {
    return Status::invalid_argument("output '" + out + "': directory '" + dir.string() +
                                    "' does not exist; create it first");
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return Status::invalid_argument("output '" + out + "': directory '" + dir.string() +
                                    "' is not writable; choose another --out");
  }
  return Status::ok();
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("input '" + path + "': cannot open for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status::io_error("input '" + path + "': read failed");
  return ss.str();
}

// Number of bytes that are not part of a well-formed UTF-8 sequence (RFC 3629: no overlongs,
// surrogates or code points above U+10FFFF).
size_t count_invalid_utf8(std::string_view s) {
  size_t bad = 0, i = 0;
  const size_t n = s.size();
  while (i < n) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    uint32_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    bool ok = len > 0 && i + len <= n;
    for (int k = 1; ok && k < len; ++k) {
      auto cc = static_cast<unsigned char>(s[i + k]);
      ok = k == 1 ? (cc >= lo && cc <= hi) : (cc >= 0x80 && cc <= 0xBF);
    }
    if (ok) {
      i += len;
    } else {
      ++bad;
      ++i;
    }
  }
  return bad;
}

bool all_whitespace(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
  });
}

// Splits `text` into documents at lines equal to `separator`; drops whitespace-only documents.
void split_documents(std::string_view text, const std::string& separator,
                     std::vector<std::string_view>* docs) {
  auto add = [&](std::string_view d) {
    if (!all_whitespace(d)) docs->push_back(d);
  };
  if (separator.empty()) {
    add(text);
    return;
  }
  size_t doc_begin = 0, line_begin = 0;
  while (line_begin < text.size()) {
    size_t nl = text.find('\n', line_begin);
    size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    std::string_view line = text.substr(line_begin, line_end - line_begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line == separator) {
      add(text.substr(doc_begin, line_begin - doc_begin));
      doc_begin = next;
    }
    line_begin = next;
  }
  add(text.substr(doc_begin));
}

// What a JSON value is, for messages ("a number", "null", ...).
std::string json_kind(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      return "null";
    case nlohmann::json::value_t::boolean:
      return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
    case nlohmann::json::value_t::number_float:
      return "a number";
    case nlohmann::json::value_t::object:
      return "an object";
    case nlohmann::json::value_t::array:
      return "an array";
    case nlohmann::json::value_t::string:
      return "a string";
    default:
      return "not a string";
  }
}

// JSON Lines: each non-blank line an object whose `field` is a string, one document each
// (stored in `storage`, which never moves its elements). Whitespace-only documents are dropped.
Status split_json_lines(const std::string& path, std::string_view text, const std::string& field,
                        std::deque<std::string>* storage, std::vector<std::string_view>* docs) {
  size_t line_begin = 0;
  int64_t line_no = 0;
  while (line_begin < text.size()) {
    size_t nl = text.find('\n', line_begin);
    size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(line_begin, line_end - line_begin);
    line_begin = nl == std::string_view::npos ? text.size() : nl + 1;
    ++line_no;
    if (all_whitespace(line)) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // e.what(): "[json.exception.parse_error.101] parse error at line 1, column 7: ...".
      std::string what = e.what();
      if (size_t k = what.find("] "); k != std::string::npos) what = what.substr(k + 2);
      return Status::invalid_argument(where + ": not valid JSON (" + what +
                                      "); JSON Lines holds one JSON object per line");
    }
    if (!j.is_object()) {
      return Status::invalid_argument(where + ": expected a JSON object with a \"" + field +
                                      "\" string, found " + json_kind(j));
    }
    auto it = j.find(field);
    if (it == j.end()) {
      std::string names;
      for (auto m = j.begin(); m != j.end(); ++m) {
        if (names.size() > 200) {
          names += ", ...";
          break;
        }
        names += (names.empty() ? "" : ", ") + std::string("\"") + m.key() + "\"";
      }
      return Status::invalid_argument(where + ": no field \"" + field + "\" (the object has " +
                                      (names.empty() ? std::string("no fields") : names) +
                                      "); name the text's field with --field");
    }
    if (!it->is_string()) {
      return Status::invalid_argument(where + ": field \"" + field + "\" is " + json_kind(*it) +
                                      ", not a string; --field must name the text");
    }
    std::string doc = it->get<std::string>();
    if (all_whitespace(doc)) continue;
    storage->push_back(std::move(doc));
    docs->push_back(storage->back());
  }
  return Status::ok();
}

}  // namespace

Result<PrepareStats> prepare_token_file(const PrepareOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  if (options.inputs.empty()) {
    return Status::invalid_argument("prepare: no inputs given; pass text files or directories");
  }
  if (options.out.empty()) {
    return Status::invalid_argument("prepare: no output file given; pass --out FILE");
  }
  HR_RETURN_IF_ERROR(check_output(options.out));
  std::vector<std::string> files;
  HR_RETURN_IF_ERROR(collect_inputs(options.inputs, options.out, &files));

  // Read and check every input before the (slower) tokenizer runs.
  uint64_t total_bytes = 0;
  for (const std::string& path : files) {
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    if (!ec) total_bytes += size;
  }
  auto progress = [&](const char* stage, uint64_t done, uint64_t total) {
    if (options.progress) options.progress(stage, done, total);
  };
  progress("read", 0, total_bytes);
  PrepareStats stats;
  std::vector<std::string> texts;
  std::vector<std::string_view> docs;
  texts.reserve(files.size());
  size_t invalid_total = 0;
  for (const std::string& path : files) {
    HR_ASSIGN_OR_RETURN(std::string text, read_file(path));
    if (text.find('\0') != std::string::npos) {
      return Status::invalid_argument("input '" + path + "' looks binary, not text: it has a NUL " +
                                      "byte at offset " + std::to_string(text.find('\0')) +
                                      "; pass text files only");
    }
    size_t invalid = count_invalid_utf8(text);
    if (static_cast<double>(invalid) > kMaxInvalidUtf8Fraction * static_cast<double>(text.size())) {
      return Status::invalid_argument(
          "input '" + path + "' looks binary, not text: " + std::to_string(invalid) + " of " +
          std::to_string(text.size()) + " bytes are not valid UTF-8; pass text files only");
    }
    invalid_total += invalid;
    stats.bytes += text.size();
    ++stats.files;
    texts.push_back(std::move(text));
    progress("read", std::min(stats.bytes, total_bytes), total_bytes);
  }
  progress("read", total_bytes, total_bytes);
  std::deque<std::string> json_docs;  // the JSON Lines documents, unescaped
  for (size_t f = 0; f < files.size(); ++f) {
    size_t before = docs.size();
    if (is_json_lines(files[f])) {
      HR_RETURN_IF_ERROR(split_json_lines(files[f], texts[f], options.field, &json_docs, &docs));
    } else {
      split_documents(texts[f], options.doc_separator, &docs);
    }
    if (docs.size() == before) {
      return Status::invalid_argument("input '" + files[f] + "' is empty" +
                                      (texts[f].empty() ? std::string(" (0 bytes)")
                                       : is_json_lines(files[f])
                                           ? " (no line with a non-blank \"" + options.field + "\")"
                                           : std::string(" (only whitespace or separator lines)")) +
                                      "; remove it from the inputs or add text");
    }
  }
  if (invalid_total > 0) {
    log_warn("prepare: {} bytes of the input are not valid UTF-8; they are kept as raw bytes",
             invalid_total);
  }

  std::unique_ptr<Tokenizer> owned;
  if (!options.tokenizer_dir.empty()) {
    if (!options.vocab_dir.empty()) {
      return Status::invalid_argument(
          "prepare: give a tokenizer directory or a GPT-2 vocabulary "
          "directory, not both (--tokenizer " +
          options.tokenizer_dir + ", --vocab " + options.vocab_dir + ")");
    }
    HR_ASSIGN_OR_RETURN(owned, load_tokenizer(options.tokenizer_dir));
  } else {
    std::string vocab_dir = options.vocab_dir;
    if (vocab_dir.empty()) {
      HR_ASSIGN_OR_RETURN(vocab_dir, find_vocab_dir());
    }
    HR_ASSIGN_OR_RETURN(Gpt2Tokenizer gpt2, Gpt2Tokenizer::load(vocab_dir));
    owned = std::make_unique<Gpt2Tokenizer>(std::move(gpt2));
  }
  const Tokenizer& tokenizer = *owned;
  const int32_t eot = tokenizer.eos_token();
  if (eot < 0 || eot >= tokenizer.vocab_size()) {
    return Status::invalid_argument(
        "prepare: tokenizer '" + tokenizer.name() + "' (" + tokenizer.description() +
        ") has no end-of-text token to separate documents; name one as eos_token in "
        "tokenizer_config.json beside it");
  }

  // Contiguous runs of documents per thread, balanced by bytes; joined in order afterwards, so
  // the output does not depend on the number of threads.
  const size_t hw = std::max(1u, std::thread::hardware_concurrency());
  uint64_t doc_bytes = 0;
  for (std::string_view d : docs) doc_bytes += d.size();
  const size_t nthreads = std::min<size_t>(hw, std::max<size_t>(1, doc_bytes / (256 << 10)));
  std::vector<size_t> cut{0};
  {
    const uint64_t per = doc_bytes / nthreads + 1;
    uint64_t acc = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      acc += docs[d].size();
      if (acc >= per * cut.size() && cut.size() < nthreads) cut.push_back(d + 1);
    }
    if (cut.back() != docs.size()) cut.push_back(docs.size());
  }
  std::vector<std::vector<int32_t>> parts(cut.size() - 1);
  std::atomic<uint64_t> tokenised{0};
  std::atomic<size_t> running{parts.size()};
  auto work = [&](size_t p) {
    for (size_t d = cut[p]; d < cut[p + 1]; ++d) {
      tokenizer.encode_append(docs[d], &parts[p]);
      parts[p].push_back(eot);
      tokenised.fetch_add(docs[d].size(), std::memory_order_relaxed);
    }
    running.fetch_sub(1, std::memory_order_release);
  };
  progress("tokenise", 0, doc_bytes);
  {
    std::vector<std::jthread> threads;
    for (size_t p = 0; p < parts.size(); ++p) threads.emplace_back(work, p);
    // This thread reports while the workers tokenise (the callback is not thread-safe).
    while (options.progress && running.load(std::memory_order_acquire) > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      progress("tokenise", tokenised.load(std::memory_order_relaxed), doc_bytes);
    }
  }
  progress("tokenise", doc_bytes, doc_bytes);
  std::vector<int32_t> tokens;
  size_t total = 0;
  for (const auto& p : parts) total += p.size();
  tokens.reserve(total);
  for (auto& p : parts) {
    tokens.insert(tokens.end(), p.begin(), p.end());
    std::vector<int32_t>().swap(p);
  }

  HR_RETURN_IF_ERROR(
      write_token_file(options.out, tokens, tokenizer.vocab_size(), eot, docs.size()));
  stats.tokenizer = tokenizer.name();
  stats.vocab_size = tokenizer.vocab_size();
  stats.eot = eot;
  stats.documents = docs.size();
  stats.tokens = tokens.size();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

std::vector<std::string> default_corpus_inputs() {
  std::vector<std::string> files;
  std::error_code ec;
  const fs::path dir = "/usr/share/games/fortunes";
  fs::directory_iterator it(dir, ec), end;
  if (ec) return files;
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.' || name.find('.') != std::string::npos) continue;
    if (it->is_regular_file(ec)) files.push_back(it->path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace headroom::data
