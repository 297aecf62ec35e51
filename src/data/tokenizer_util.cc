// Merge-by-rank BPE shared by the byte-level and SentencePiece-style tokenizer.json readers.
#include "data/tokenizer_util.h"

#include <functional>
#include <nlohmann/json.hpp>

namespace headroom::data::tok_util {
namespace {

// A candidate merge of the symbol at `pos` with its right neighbour, ordered by rank, then
// position: "merge the best pair, leftmost first".
struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t left;
  int32_t right;
  int32_t merged;
  bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

Status read_config_special_tokens(const std::string& path, std::optional<std::string>* bos,
                                  std::optional<std::string>* eos) {
  if (path.empty() || !file_exists(path)) return Status::ok();
  HR_ASSIGN_OR_RETURN(std::string text, read_whole_file(path));
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(path + ": not valid JSON (" + e.what() + ")");
  }
  if (!c.is_object()) return Status::corrupt(path + ": expected a JSON object at the top level");
  for (auto [key, dst] : {std::pair{"bos_token", bos}, std::pair{"eos_token", eos}}) {
    if (!c.contains(key)) continue;
    const nlohmann::json& v = c[key];
    if (v.is_null()) {
      *dst = "";
      continue;
    }
    if (v.is_string()) {
      *dst = v.get<std::string>();
    } else if (v.is_object() && v.contains("content") && v["content"].is_string()) {
      *dst = v["content"].get<std::string>();
    } else {
      return Status::corrupt(path + ": " + key + " is " + v.dump().substr(0, 80) +
                             ", expected a string or {\"content\": ...}");
    }
  }
  return Status::ok();
}

void bpe_merge_by_rank(const MergeTable& merges, std::vector<int32_t>* ids) {
  const int n = static_cast<int>(ids->size());
  if (n < 2 || merges.empty()) return;
  thread_local std::vector<int32_t> id, prev, next;
  thread_local std::vector<Candidate> heap;  // a min-heap through std::greater
  id.assign(ids->begin(), ids->end());
  prev.resize(n);
  next.resize(n);
  for (int i = 0; i < n; ++i) {
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
    // Stale if either symbol was merged away or changed since the candidate was pushed; a symbol
    // merged into its left neighbour is marked by id -1.
    int r = next[c.pos];
    if (id[c.pos] != c.left || r < 0 || id[r] != c.right) continue;
    id[c.pos] = c.merged;
    id[r] = -1;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  }
  ids->clear();
  for (int i = 0; i >= 0; i = next[i]) ids->push_back(id[i]);
}

}  // namespace headroom::data::tok_util
