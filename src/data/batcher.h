// Train/validation split of a token file and the packed batcher: fixed (B, T) windows cut from
// the concatenated documents, deterministic and resumable from a single position.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/status.h"
#include "data/token_file.h"

namespace headroom::data {

// A half-open range [begin, end) of token indices in a TokenFile.
struct TokenRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Splits `file` into (train, val) = ([0, s), [s, size())). s is the document boundary (an index
// just after an eot token) nearest to (1 - val_fraction) * size(), restricted so that both parts
// hold at least `window_tokens` tokens (pass T + 1) when the file has 2 * window_tokens tokens.
// With no usable boundary (a single document, or none in that region) s is the token position
// itself. val_fraction == 0 gives an empty val range; a positive fraction gives at least one
// token of val when the file has two or more tokens.
// REQUIRES: 0 <= val_fraction < 1, window_tokens >= 1.
std::pair<TokenRange, TokenRange> split_train_val(const TokenFile& file, double val_fraction,
                                                  int64_t window_tokens = 1);

// Cuts windows of T + 1 tokens from a range of the packed stream (documents joined by eot
// tokens): inputs are the first T tokens of a window, targets the last T (shifted by one).
//
// Two orders (docs/notes/first-run.md):
// - kShuffled (training): the range holds W = windows_per_epoch() windows starting T tokens
//   apart at range.begin; an epoch serves each of them once, in an order shuffled by
//   (seed, epoch), and epoch e + 1 follows epoch e. The rows of one batch come from all over the
//   corpus, so a batch is a sample of it, not 1 KiB of one file (a corpus stored file by file,
//   such as the fortunes, otherwise trains on one topic at a time). position() counts the
//   windows served since the start of epoch 0.
// - kSequential (validation, and checkpoints written before the shuffle): successive windows
//   start T tokens apart; when the next window of T + 1 tokens would run past the range end, it
//   starts over at the range begin. position() is the token index where the next window starts.
// Either way the state is one integer, position(), so a checkpoint restores the exact stream with
// set_position(), and the windows served depend only on how many were served before, never on
// B: a step of G sequences reads the same windows whatever its micro-batch.
//
// The TokenFile must outlive the batcher. Not thread-safe: one batcher per consumer thread.
class PackedBatcher {
 public:
  enum class Order { kSequential, kShuffled };

  // Errors: InvalidArgument if B or T is not positive, the range lies outside the file, or the
  // range holds fewer than T + 1 tokens.
  static Result<PackedBatcher> create(const TokenFile& file, TokenRange range, int B, int T,
                                      Order order = Order::kSequential, uint64_t seed = 0);

  // Fills inputs[B * T] and targets[B * T] (row-major [B, T]) and advances by B windows.
  void next(int32_t* inputs, int32_t* targets);

  // kSequential: the token index where the next window starts, in [range.begin, range.end].
  // kShuffled: windows served since the start of epoch 0, any non-negative count.
  int64_t position() const { return position_; }
  // REQUIRES: valid_position(position). Use valid_position to turn bad resume data into a Status.
  void set_position(int64_t position);
  bool valid_position(int64_t position) const {
    if (order_ == Order::kShuffled) return position >= 0;
    return position >= range_.begin && position <= range_.end;
  }
  // The token index where the window served `position` windows after epoch 0's start begins
  // (kShuffled; for tests and the note's figures).
  int64_t window_start(int64_t position);

  Order order() const { return order_; }
  int batch() const { return B_; }
  int seq() const { return T_; }
  TokenRange range() const { return range_; }
  // Windows before the stream starts over at range().begin.
  int64_t windows_per_epoch() const { return (range_.size() - 1) / T_; }

 private:
  PackedBatcher(const TokenFile* file, TokenRange range, int B, int T, Order order, uint64_t seed)
      : file_(file),
        range_(range),
        B_(B),
        T_(T),
        order_(order),
        seed_(seed),
        position_(order == Order::kShuffled ? 0 : range.begin) {}

  const TokenFile* file_;
  TokenRange range_;
  int B_;
  int T_;
  Order order_;
  uint64_t seed_;
  int64_t position_;
  // kShuffled: the window indices of epoch loaded_epoch_ in serving order.
  std::vector<int64_t> perm_;
  int64_t loaded_epoch_ = -1;
};

}  // namespace headroom::data
