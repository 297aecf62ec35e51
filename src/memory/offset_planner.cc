// Offset planning: greedy best-fit placement under several orders, with a time-indexed structure
// so that finding the free gaps for a buffer does not scan every buffer placed before it.
// See docs/notes/offset-planner.md.
#include "memory/offset_planner.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <map>
#include <numeric>

#include "core/check.h"

namespace headroom::memory {
namespace {

uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}

// A half-open byte range [begin, end).
struct Range {
  uint64_t begin;
  uint64_t end;
};

// The input in the form the placement loop wants: lifetimes renumbered to 0..T-1 (only the order
// of ops matters for whether two lifetimes meet), footprints computed once, and the lower bound.
struct Problem {
  size_t n = 0;
  int32_t times = 0;  // T: distinct op indices that start or end a lifetime
  std::vector<int32_t> first, last;
  std::vector<uint64_t> bytes, alignment, footprint;
  std::vector<uint64_t> breadth;  // footprint bytes live at each renumbered time
  uint64_t lower_bound = 0;
};

Problem prepare(std::span<const LiveRange> buffers) {
  Problem p;
  p.n = buffers.size();
  std::vector<int32_t> points;
  points.reserve(2 * p.n);
  uint64_t total = 0;
  for (const LiveRange& b : buffers) {
    HR_CHECK_MSG(b.alignment != 0 && std::has_single_bit(b.alignment),
                 "LiveRange.alignment must be a power of two");
    HR_CHECK_MSG(b.first <= b.last, "LiveRange.first must be <= LiveRange.last");
    HR_CHECK_MSG(b.bytes <= (uint64_t(1) << 62), "LiveRange.bytes must be below 2^62");
    total += footprint(b);
    HR_CHECK_MSG(total < (uint64_t(1) << 63), "the buffers' footprints must sum below 2^63");
    points.push_back(b.first);
    points.push_back(b.last);
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  auto rank = [&](int32_t t) {
    return int32_t(std::lower_bound(points.begin(), points.end(), t) - points.begin());
  };
  p.times = int32_t(points.size());
  p.first.resize(p.n);
  p.last.resize(p.n);
  p.bytes.resize(p.n);
  p.alignment.resize(p.n);
  p.footprint.resize(p.n);
  std::vector<int64_t> delta(p.times + 1, 0);
  for (size_t i = 0; i < p.n; i++) {
    p.first[i] = rank(buffers[i].first);
    p.last[i] = rank(buffers[i].last);
    p.bytes[i] = buffers[i].bytes;
    p.alignment[i] = buffers[i].alignment;
    p.footprint[i] = footprint(buffers[i]);
    delta[p.first[i]] += int64_t(p.footprint[i]);
    delta[p.last[i] + 1] -= int64_t(p.footprint[i]);
  }
  // The live set only grows at a first use, so the peak over all ops is reached at one of these
  // renumbered times.
  p.breadth.resize(p.times);
  int64_t live = 0;
  for (int32_t t = 0; t < p.times; t++) {
    live += delta[t];
    p.breadth[t] = uint64_t(live);
    p.lower_bound = std::max(p.lower_bound, p.breadth[t]);
  }
  return p;
}

// Inserts r into a sorted list of disjoint ranges, merging what it overlaps or touches (buffers
// whose lifetimes do not meet may share bytes, so ranges in one list can overlap).
void add_range(std::vector<Range>& list, Range r) {
  auto it = std::lower_bound(list.begin(), list.end(), r.begin,
                             [](const Range& x, uint64_t b) { return x.end < b; });
  auto jt = it;
  while (jt != list.end() && jt->begin <= r.end) {
    r.begin = std::min(r.begin, jt->begin);
    r.end = std::max(r.end, jt->end);
    ++jt;
  }
  if (it == jt) {
    list.insert(it, r);
  } else {
    *it = r;
    list.erase(it + 1, jt);
  }
}

// Placed buffers indexed by time: a segment tree over the renumbered times. A buffer lives in
// `own` of the O(log T) nodes that tile its lifetime and in `below` of those nodes and their
// ancestors. The buffers whose lifetimes meet [f, l] are then exactly: `below` of the nodes that
// tile [f, l], plus `own` of the nodes that straddle its ends. Each list holds the union of its
// buffers' byte ranges, merged; in a good packing that union has few holes, so the lists stay
// short however many buffers are live (the plain alternative scans every conflicting buffer:
// thousands per placement for a transformer's saved activations).
class TimeIndex {
 public:
  explicit TimeIndex(int32_t times) : leaves_(std::max(times, 1)) {
    own_.resize(4 * size_t(leaves_));
    below_.resize(4 * size_t(leaves_));
  }

  void clear() {
    for (auto& v : own_) v.clear();
    for (auto& v : below_) v.clear();
  }

  void insert(int32_t f, int32_t l, Range r) { insert(1, 0, leaves_ - 1, f, l, r); }

  // Appends to `out` the byte ranges of every placed buffer whose lifetime meets [f, l], as runs
  // sorted by begin (each run one node's list; runs may overlap); `runs` gets each run's start.
  void collect(int32_t f, int32_t l, std::vector<Range>& out, std::vector<size_t>& runs) const {
    collect(1, 0, leaves_ - 1, f, l, out, runs);
  }

  // What collect() would return: the number of ranges and of runs.
  void measure(int32_t f, int32_t l, size_t& ranges, size_t& runs) const {
    measure(1, 0, leaves_ - 1, f, l, ranges, runs);
  }

 private:
  void measure(size_t node, int32_t lo, int32_t hi, int32_t f, int32_t l, size_t& ranges,
               size_t& runs) const {
    if (l < lo || hi < f) return;
    const bool inside = f <= lo && hi <= l;
    size_t k = (inside ? below_[node] : own_[node]).size();
    ranges += k;
    runs += k != 0;
    if (inside) return;
    int32_t mid = lo + (hi - lo) / 2;
    measure(2 * node, lo, mid, f, l, ranges, runs);
    measure(2 * node + 1, mid + 1, hi, f, l, ranges, runs);
  }

  void insert(size_t node, int32_t lo, int32_t hi, int32_t f, int32_t l, Range r) {
    if (l < lo || hi < f) return;
    add_range(below_[node], r);
    if (f <= lo && hi <= l) {
      add_range(own_[node], r);
      return;
    }
    int32_t mid = lo + (hi - lo) / 2;
    insert(2 * node, lo, mid, f, l, r);
    insert(2 * node + 1, mid + 1, hi, f, l, r);
  }

  void collect(size_t node, int32_t lo, int32_t hi, int32_t f, int32_t l, std::vector<Range>& out,
               std::vector<size_t>& runs) const {
    if (l < lo || hi < f) return;
    const std::vector<Range>& list = (f <= lo && hi <= l) ? below_[node] : own_[node];
    if (!list.empty()) {
      runs.push_back(out.size());
      out.insert(out.end(), list.begin(), list.end());
    }
    if (f <= lo && hi <= l) return;
    int32_t mid = lo + (hi - lo) / 2;
    collect(2 * node, lo, mid, f, l, out, runs);
    collect(2 * node + 1, mid + 1, hi, f, l, out, runs);
  }

  int32_t leaves_;
  std::vector<std::vector<Range>> own_, below_;
};

// Places buffers in `order` with best fit; returns the offsets and the arena size.
struct Placement {
  std::vector<uint64_t> offsets;
  uint64_t size = 0;
};

// The best-fit search over the conflicting byte ranges, fed in order of begin: the smallest gap
// between them that holds the footprint once aligned; above them all if none does.
struct BestFit {
  static constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  uint64_t need, alignment;
  uint64_t top = 0;  // end of the conflicting bytes seen so far
  uint64_t best_offset = 0, best_gap = kNone;

  void gap(uint64_t end) {  // a free gap [top, end)
    uint64_t at = align_up(top, alignment);
    if (at + need <= end && end - top < best_gap) {
      best_gap = end - top;
      best_offset = at;
    }
  }
  void operator()(const Range& r) {
    if (r.begin > top) gap(r.begin);
    top = std::max(top, r.end);
  }
  uint64_t offset() const { return best_gap != kNone ? best_offset : align_up(top, alignment); }
};

// Placed buffers by offset, in blocks of at most 2 * kBlock (columns, for the filter loop below)
// with each block's span of lifetimes: the fallback when free memory is so fragmented that the
// time index's lists are long (random lifetimes). O(placed) per query without sorting, about 1 ns
// per placed buffer; O(kBlock) per insert.
class OffsetList {
 public:
  void clear() {
    blocks_.clear();
    size_ = 0;
  }
  size_t size() const { return size_; }

  void insert(Range r, int32_t first, int32_t last) {
    size_++;
    if (blocks_.empty()) blocks_.emplace_back();
    auto bt = std::lower_bound(blocks_.begin(), blocks_.end() - 1, r.begin,
                               [](const Block& b, uint64_t v) { return b.begin.back() < v; });
    Block& b = *bt;
    size_t at = std::upper_bound(b.begin.begin(), b.begin.end(), r.begin) - b.begin.begin();
    b.begin.insert(b.begin.begin() + at, r.begin);
    b.end.insert(b.end.begin() + at, r.end);
    b.first.insert(b.first.begin() + at, first);
    b.last.insert(b.last.begin() + at, last);
    b.min_first = std::min(b.min_first, first);
    b.max_last = std::max(b.max_last, last);
    if (b.begin.size() >= 2 * kBlock) blocks_.insert(bt + 1, b.split());
  }

  // Appends to `out` the byte ranges of the entries whose lifetimes meet [f, l], by begin. Each
  // entry is written and the count advanced by whether it meets: no branch to mispredict on a
  // test that is random for fragmented schedules (five times faster than branching here).
  // Returns how many; `out` grows to hold every entry and is never shrunk, so that it is not
  // cleared again on every query.
  size_t collect(int32_t f, int32_t l, std::vector<Range>& out) const {
    if (out.size() < size_) out.resize(std::max(size_, 2 * out.size()));
    size_t k = 0;
    for (const Block& b : blocks_) {
      if (b.min_first > l || b.max_last < f) continue;
      for (size_t i = 0; i < b.begin.size(); i++) {
        out[k] = Range{b.begin[i], b.end[i]};
        k += static_cast<size_t>(b.first[i] <= l) & static_cast<size_t>(f <= b.last[i]);
      }
    }
    return k;
  }

 private:
  static constexpr size_t kBlock = 256;
  struct Block {
    std::vector<uint64_t> begin, end;
    std::vector<int32_t> first, last;
    int32_t min_first = std::numeric_limits<int32_t>::max();
    int32_t max_last = std::numeric_limits<int32_t>::min();

    // Moves the upper half into a new block.
    Block split() {
      Block upper;
      upper.begin.assign(begin.begin() + kBlock, begin.end());
      upper.end.assign(end.begin() + kBlock, end.end());
      upper.first.assign(first.begin() + kBlock, first.end());
      upper.last.assign(last.begin() + kBlock, last.end());
      begin.resize(kBlock);
      end.resize(kBlock);
      first.resize(kBlock);
      last.resize(kBlock);
      summarize();
      upper.summarize();
      return upper;
    }
    void summarize() {
      min_first = *std::min_element(first.begin(), first.end());
      max_last = *std::max_element(last.begin(), last.end());
    }
  };
  std::vector<Block> blocks_;
  size_t size_ = 0;
};

// Sorts `ranges` by begin, given that it is a concatenation of sorted runs starting at `runs`:
// merges neighbouring runs pairwise, O(m log k) for m ranges in k runs (a full sort of m ranges
// cost twice as much on schedules whose free memory has many holes).
void merge_runs(std::vector<Range>& ranges, std::vector<size_t>& runs,
                std::vector<Range>& scratch) {
  auto by_begin = [](const Range& a, const Range& b) { return a.begin < b.begin; };
  scratch.resize(ranges.size());
  while (runs.size() > 1) {
    size_t kept = 0;
    for (size_t r = 0; r < runs.size(); r += 2) {
      size_t begin = runs[r];
      size_t mid = r + 1 < runs.size() ? runs[r + 1] : ranges.size();
      size_t end = r + 2 < runs.size() ? runs[r + 2] : ranges.size();
      std::merge(ranges.begin() + begin, ranges.begin() + mid, ranges.begin() + mid,
                 ranges.begin() + end, scratch.begin() + begin, by_begin);
      runs[kept++] = begin;
    }
    runs.resize(kept);
    ranges.swap(scratch);
  }
}

// Both structures hold every placed buffer; each placement asks the one that is cheaper for it.
struct Placed {
  explicit Placed(int32_t times) : index(times) {}
  void clear() {
    index.clear();
    list.clear();
  }
  TimeIndex index;
  OffsetList list;
};

Placement place(const Problem& p, std::span<const uint32_t> order, Placed& placed) {
  Placement out;
  out.offsets.assign(p.n, 0);
  placed.clear();
  std::vector<Range> taken, scratch, listed;
  std::vector<size_t> runs;
  for (uint32_t i : order) {
    const uint64_t need = p.footprint[i];
    if (need == 0) continue;  // takes no bytes; stays at offset 0
    const int32_t f = p.first[i], l = p.last[i];
    BestFit fit{need, p.alignment[i]};
    // Merging m ranges in k runs costs about m * log2(k) steps of a few ns (unpredictable
    // branches); the walk costs about 1 ns per placed buffer. Pick the cheaper.
    size_t m = 0, k = 0;
    placed.index.measure(f, l, m, k);
    if (4 * m * std::bit_width(k) <= placed.list.size()) {
      taken.clear();
      runs.clear();
      placed.index.collect(f, l, taken, runs);
      merge_runs(taken, runs, scratch);
      for (const Range& r : taken) fit(r);
    } else {
      size_t hits = placed.list.collect(f, l, listed);
      for (size_t j = 0; j < hits; j++) fit(listed[j]);
    }
    const uint64_t offset = fit.offset();
    out.offsets[i] = offset;
    out.size = std::max(out.size, offset + need);
    placed.index.insert(f, l, Range{offset, offset + need});
    placed.list.insert(Range{offset, offset + need}, f, l);
  }
  return out;
}

// Orders -------------------------------------------------------------------------------------

uint64_t duration(const Problem& p, uint32_t i) { return uint64_t(p.last[i] - p.first[i]) + 1; }

// Sorts 0..n-1 by `less`, with the index as the last tie-break so that the plan is deterministic.
template <typename Less>
std::vector<uint32_t> sorted_order(size_t n, Less less) {
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    if (less(a, b)) return true;
    if (less(b, a)) return false;
    return a < b;
  });
  return order;
}

// TensorFlow Lite's "greedy by breadth": take ops from the one with the most live bytes down, and
// place each op's still unplaced buffers largest first. A buffer is thus placed with the first op
// (in that order) of its lifetime: the op of its lifetime with the smallest rank, found here with
// a sparse table of range minima instead of walking every op of every lifetime.
std::vector<uint32_t> breadth_order(const Problem& p) {
  const int32_t T = p.times;
  std::vector<int32_t> by_breadth(T);
  std::iota(by_breadth.begin(), by_breadth.end(), 0);
  std::stable_sort(by_breadth.begin(), by_breadth.end(),
                   [&](int32_t a, int32_t b) { return p.breadth[a] > p.breadth[b]; });
  std::vector<std::vector<int32_t>> table(1, std::vector<int32_t>(T));
  for (int32_t r = 0; r < T; r++) table[0][by_breadth[r]] = r;
  for (int32_t k = 1; (int32_t(1) << k) <= T; k++) {
    const std::vector<int32_t>& prev = table[k - 1];
    std::vector<int32_t> row(T - (int32_t(1) << k) + 1);
    for (size_t t = 0; t < row.size(); t++)
      row[t] = std::min(prev[t], prev[t + (size_t(1) << (k - 1))]);
    table.push_back(std::move(row));
  }
  std::vector<int32_t> rank(p.n);
  for (size_t i = 0; i < p.n; i++) {
    int32_t k = std::bit_width(uint32_t(p.last[i] - p.first[i] + 1)) - 1;
    rank[i] = std::min(table[k][p.first[i]], table[k][p.last[i] - (int32_t(1) << k) + 1]);
  }
  return sorted_order(p.n, [&](uint32_t a, uint32_t b) {
    if (rank[a] != rank[b]) return rank[a] < rank[b];
    if (p.footprint[a] != p.footprint[b]) return p.footprint[a] > p.footprint[b];
    return duration(p, a) > duration(p, b);
  });
}

struct Strategy {
  const char* name;
  std::vector<uint32_t> (*order)(const Problem&);
};

// Tried in this order; plan_offsets stops at the first that reaches the lower bound. Breadth
// first: it is the best alone on every family measured (docs/notes/offset-planner.md).
const Strategy kStrategies[] = {
    {"greedy_by_breadth", breadth_order},
    // Largest first, longer-lived first among equals (TFLite's greedy by size): big buffers are
    // hardest to fit later, and long-lived ones constrain the most others.
    {"greedy_by_size",
     [](const Problem& p) {
       return sorted_order(p.n, [&](uint32_t a, uint32_t b) {
         if (p.footprint[a] != p.footprint[b]) return p.footprint[a] > p.footprint[b];
         if (duration(p, a) != duration(p, b)) return duration(p, a) > duration(p, b);
         return p.first[a] < p.first[b];
       });
     }},
    // Bytes x ops: a big buffer that lives for one op is easier to tuck in than a smaller one
    // that lives through the whole backward.
    {"greedy_by_area",
     [](const Problem& p) {
       return sorted_order(p.n, [&](uint32_t a, uint32_t b) {
         unsigned __int128 x = (unsigned __int128)p.footprint[a] * duration(p, a);
         unsigned __int128 y = (unsigned __int128)p.footprint[b] * duration(p, b);
         if (x != y) return x > y;
         return p.footprint[a] > p.footprint[b];
       });
     }},
    // Longest-lived first: nested lifetimes (saved activations) stack like a stack frame.
    {"greedy_by_duration",
     [](const Problem& p) {
       return sorted_order(p.n, [&](uint32_t a, uint32_t b) {
         if (duration(p, a) != duration(p, b)) return duration(p, a) > duration(p, b);
         if (p.footprint[a] != p.footprint[b]) return p.footprint[a] > p.footprint[b];
         return p.first[a] < p.first[b];
       });
     }},
    // Schedule order, as a run-time allocator would see the buffers (a linear scan).
    {"greedy_by_first_use",
     [](const Problem& p) {
       return sorted_order(p.n, [&](uint32_t a, uint32_t b) {
         if (p.first[a] != p.first[b]) return p.first[a] < p.first[b];
         if (p.footprint[a] != p.footprint[b]) return p.footprint[a] > p.footprint[b];
         return p.last[a] > p.last[b];
       });
     }},
};

std::string describe(std::span<const LiveRange> buffers, const OffsetPlan& plan, size_t i) {
  const LiveRange& b = buffers[i];
  return "buffer " + std::to_string(i) + " (bytes [" + std::to_string(plan.offsets[i]) + ", " +
         std::to_string(plan.offsets[i] + b.bytes) + "), ops " + std::to_string(b.first) + ".." +
         std::to_string(b.last) + ")";
}

}  // namespace

uint64_t footprint(const LiveRange& buffer) { return align_up(buffer.bytes, buffer.alignment); }

uint64_t live_bytes_lower_bound(std::span<const LiveRange> buffers) {
  return prepare(buffers).lower_bound;
}

OffsetPlan plan_offsets_in_order(std::span<const LiveRange> buffers,
                                 std::span<const uint32_t> order, std::string strategy) {
  Problem p = prepare(buffers);
  HR_CHECK_MSG(order.size() == p.n, "order must hold every buffer once");
  std::vector<bool> seen(p.n, false);
  for (uint32_t i : order) {
    HR_CHECK_MSG(i < p.n && !seen[i], "order must be a permutation of 0..n-1");
    seen[i] = true;
  }
  Placed placed(p.times);
  Placement placement = place(p, order, placed);
  return OffsetPlan{std::move(placement.offsets), placement.size, p.lower_bound,
                    std::move(strategy)};
}

OffsetPlan plan_offsets(std::span<const LiveRange> buffers) {
  Problem p = prepare(buffers);
  Placed index(p.times);
  OffsetPlan best;
  best.lower_bound = p.lower_bound;
  bool have = false;
  for (const Strategy& s : kStrategies) {
    std::vector<uint32_t> order = s.order(p);
    Placement placed = place(p, order, index);
    if (!have || placed.size < best.size) {
      best.offsets = std::move(placed.offsets);
      best.size = placed.size;
      best.strategy = s.name;
      have = true;
    }
    if (best.size == p.lower_bound) break;  // optimal: no order can do better
  }
  return best;
}

Status verify_offsets(std::span<const LiveRange> buffers, const OffsetPlan& plan) {
  const size_t n = buffers.size();
  if (plan.offsets.size() != n) {
    return Status::invalid_argument("offset plan has " + std::to_string(plan.offsets.size()) +
                                    " offsets for " + std::to_string(n) + " buffers");
  }
  for (size_t i = 0; i < n; i++) {
    const LiveRange& b = buffers[i];
    if (b.alignment == 0 || !std::has_single_bit(b.alignment) || b.first > b.last) {
      return Status::invalid_argument("buffer " + std::to_string(i) + " is malformed (alignment " +
                                      std::to_string(b.alignment) + ", ops " +
                                      std::to_string(b.first) + ".." + std::to_string(b.last) +
                                      ")");
    }
    if (plan.offsets[i] % b.alignment != 0) {
      return Status::invalid_argument(describe(buffers, plan, i) + " is not aligned to " +
                                      std::to_string(b.alignment) + " bytes");
    }
    if (plan.offsets[i] > plan.size || b.bytes > plan.size - plan.offsets[i]) {
      return Status::invalid_argument(describe(buffers, plan, i) + " ends past the arena size " +
                                      std::to_string(plan.size));
    }
  }
  // Two lifetimes meet iff both buffers are live when the later one starts. Sweep the starts in
  // order, keeping the buffers live at that moment by offset; they must be disjoint, so a new
  // buffer collides with some live one iff it collides with its neighbour on either side.
  std::vector<uint32_t> by_first, by_last;
  for (size_t i = 0; i < n; i++) {
    if (buffers[i].bytes == 0) continue;
    by_first.push_back(uint32_t(i));
  }
  by_last = by_first;
  std::sort(by_first.begin(), by_first.end(),
            [&](uint32_t a, uint32_t b) { return buffers[a].first < buffers[b].first; });
  std::sort(by_last.begin(), by_last.end(),
            [&](uint32_t a, uint32_t b) { return buffers[a].last < buffers[b].last; });
  std::map<uint64_t, uint32_t> live;  // offset -> buffer
  size_t ended = 0;
  for (uint32_t i : by_first) {
    const int32_t now = buffers[i].first;
    for (; ended < by_last.size() && buffers[by_last[ended]].last < now; ended++) {
      live.erase(plan.offsets[by_last[ended]]);
    }
    const uint64_t begin = plan.offsets[i], end = begin + buffers[i].bytes;
    auto next = live.lower_bound(begin);
    uint32_t other = uint32_t(-1);
    if (next != live.end() && next->first < end) {
      other = next->second;
    } else if (next != live.begin()) {
      auto prev = std::prev(next);
      if (prev->first + buffers[prev->second].bytes > begin) other = prev->second;
    }
    if (other != uint32_t(-1)) {
      return Status::invalid_argument(
          describe(buffers, plan, other) + " and " + describe(buffers, plan, i) +
          " overlap in memory and are both live at op " + std::to_string(now));
    }
    live.emplace(begin, i);
  }
  return Status::ok();
}

}  // namespace headroom::memory
