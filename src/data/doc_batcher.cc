// Document pieces, length buckets and the per-step token-budget batches (see doc_batcher.h).
#include "data/doc_batcher.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/check.h"
#include "data/split_mix.h"

namespace headroom::data {

Result<Batching> parse_batching(const std::string& name) {
  if (name == "packed") return Batching::kPacked;
  if (name == "bucketed") return Batching::kBucketed;
  return Status::invalid_argument(fmt::format(
      "--batching '{}': use packed (fixed windows of the concatenated documents) or bucketed "
      "(one document per row, rows of similar length)",
      name));
}

const char* batching_name(Batching b) { return b == Batching::kPacked ? "packed" : "bucketed"; }

std::vector<Piece> document_pieces(const TokenFile& file, TokenRange range, int T) {
  HR_CHECK(T >= 1);
  std::vector<Piece> out;
  const int32_t eot = file.eot();
  int64_t doc = range.begin;
  for (int64_t i = range.begin; i < range.end; i++) {
    if (file.at(i) != eot && i + 1 < range.end) continue;
    // Document [doc, i] (with its eot, or the range's unterminated tail).
    for (int64_t p = doc; p <= i; p += T) {
      out.push_back({p, int32_t(std::min<int64_t>(T, i + 1 - p)), p == doc});
    }
    doc = i + 1;
  }
  return out;
}

DocumentBatcher::DocumentBatcher(const TokenFile* file, TokenRange range, int T, int bucket,
                                 int64_t step_tokens, uint64_t seed)
    : file_(file), range_(range), T_(T), bucket_(bucket), step_tokens_(step_tokens), seed_(seed) {}

Result<DocumentBatcher> DocumentBatcher::create(const TokenFile& file, TokenRange range, int T,
                                                int bucket, int64_t step_tokens, uint64_t seed) {
  if (T <= 0) return Status::invalid_argument(fmt::format("--seq {} must be positive", T));
  if (bucket <= 0) {
    return Status::invalid_argument(
        fmt::format("--bucket {} must be positive (bucket lengths are its multiples)", bucket));
  }
  if (step_tokens < T) {
    return Status::invalid_argument(fmt::format(
        "the step's token budget {} is below one sequence of --seq {}", step_tokens, T));
  }
  if (range.begin < 0 || range.end > file.size() || range.size() <= 0) {
    return Status::invalid_argument(
        fmt::format("{}: the token range [{}, {}) holds no document of the file's {} tokens",
                    file.path(), range.begin, range.end, file.size()));
  }
  DocumentBatcher b(&file, range, T, bucket, step_tokens, seed);
  b.pieces_ = document_pieces(file, range, T);
  // Batches and padding per epoch do not depend on the shuffle: count them once.
  std::vector<int64_t> per_bucket(size_t(T) + 1, 0);
  int64_t real = 0;
  for (const Piece& p : b.pieces_) {
    per_bucket[size_t(b.bucket_length(p.length))]++;
    real += p.length;
  }
  int64_t slots = 0;
  for (int len = 1; len <= T; len++) {
    if (!per_bucket[size_t(len)]) continue;
    const int64_t rows = step_tokens / len;
    b.batches_per_epoch_ += (per_bucket[size_t(len)] + rows - 1) / rows;
    slots += per_bucket[size_t(len)] * len;
  }
  b.padding_fraction_ = slots ? double(slots - real) / double(slots) : 0.0;
  return b;
}

int DocumentBatcher::bucket_length(int length) const {
  return std::min(T_, (length + bucket_ - 1) / bucket_ * bucket_);
}

void DocumentBatcher::epoch_plan(int64_t epoch, std::vector<Batch>* batches,
                                 std::vector<int64_t>* order) const {
  SplitMix rng{seed_ * 0x2545F4914F6CDD1Dull + uint64_t(epoch) * 0x9E3779B97F4A7C15ull + 1};
  order->resize(pieces_.size());
  for (size_t i = 0; i < order->size(); i++) (*order)[i] = int64_t(i);
  shuffle(order, &rng);
  // Group by bucket, keeping the shuffled order inside each bucket.
  std::stable_sort(order->begin(), order->end(), [&](int64_t a, int64_t b) {
    return bucket_length(pieces_[size_t(a)].length) < bucket_length(pieces_[size_t(b)].length);
  });
  batches->clear();
  for (size_t i = 0; i < order->size();) {
    const int len = bucket_length(pieces_[size_t((*order)[i])].length);
    size_t end = i;
    while (end < order->size() && bucket_length(pieces_[size_t((*order)[end])].length) == len)
      end++;
    const int64_t rows = step_tokens_ / len;
    for (size_t s = i; s < end; s += size_t(rows)) {
      batches->push_back({len, int64_t(s), int(std::min<int64_t>(rows, int64_t(end - s)))});
    }
    i = end;
  }
  shuffle(batches, &rng);
}

void DocumentBatcher::load_epoch(int64_t epoch) {
  if (epoch == loaded_epoch_) return;
  epoch_plan(epoch, &batches_, &order_);
  HR_CHECK(int64_t(batches_.size()) == batches_per_epoch_);
  loaded_epoch_ = epoch;
}

DocumentBatcher::Shape DocumentBatcher::next(int32_t* inputs, int32_t* targets) {
  load_epoch(position_ / batches_per_epoch_);
  const Batch& b = batches_[size_t(position_ % batches_per_epoch_)];
  const int32_t eot = file_->eot();
  Shape s{b.rows, b.length, 0};
  for (int r = 0; r < b.rows; r++) {
    const Piece& p = pieces_[size_t(order_[size_t(b.first + r)])];
    int32_t* in = inputs + int64_t(r) * b.length;
    int32_t* tg = targets + int64_t(r) * b.length;
    file_->copy(p.begin, p.length, tg);
    in[0] = p.first ? eot : file_->at(p.begin - 1);
    if (p.length > 1) file_->copy(p.begin, p.length - 1, in + 1);
    std::fill(in + p.length, in + b.length, eot);
    std::fill(tg + p.length, tg + b.length, -1);
    s.real_tokens += p.length;
  }
  position_++;
  return s;
}

void DocumentBatcher::set_position(int64_t position) {
  HR_CHECK_MSG(valid_position(position), "document batcher position must not be negative");
  position_ = position;
}

std::vector<std::pair<int, int>> DocumentBatcher::batch_shapes() const {
  std::vector<int64_t> per_bucket(size_t(T_) + 1, 0);
  for (const Piece& p : pieces_) per_bucket[size_t(bucket_length(p.length))]++;
  std::vector<std::pair<int, int>> shapes;
  for (int len = 1; len <= T_; len++) {
    const int64_t n = per_bucket[size_t(len)];
    if (!n) continue;
    const int64_t rows = step_tokens_ / len;
    if (n >= rows) shapes.push_back({int(rows), len});
    if (n % rows) shapes.push_back({int(n % rows), len});
  }
  return shapes;
}

}  // namespace headroom::data
