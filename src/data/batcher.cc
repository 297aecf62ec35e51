// Document-boundary train/val split and the packed (B, T) window batcher.
#include "data/batcher.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/check.h"
#include "data/split_mix.h"

namespace headroom::data {

std::pair<TokenRange, TokenRange> split_train_val(const TokenFile& file, double val_fraction,
                                                  int64_t window_tokens) {
  HR_CHECK_MSG(val_fraction >= 0.0 && val_fraction < 1.0, "val_fraction must be in [0, 1)");
  HR_CHECK(window_tokens >= 1);
  const int64_t n = file.size();
  if (val_fraction == 0.0 || n < 2) return {{0, n}, {n, n}};

  int64_t val = std::max<int64_t>(1, std::llround(static_cast<double>(n) * val_fraction));
  int64_t target = std::clamp<int64_t>(n - val, 1, n - 1);
  // Where both parts can hold a window, keep the split inside that region.
  int64_t lo = 1, hi = n - 1;
  if (n >= 2 * window_tokens) {
    lo = window_tokens;
    hi = n - window_tokens;
  }
  target = std::clamp(target, lo, hi);

  // The nearest boundary in [lo, hi]: a split at k is a boundary when token k - 1 is an eot.
  // Searching outwards from the target touches only the tokens between target and the answer.
  const int32_t eot = file.eot();
  for (int64_t d = 0; target - d >= lo || target + d <= hi; ++d) {
    if (target - d >= lo && file.at(target - d - 1) == eot) {
      return {{0, target - d}, {target - d, n}};
    }
    if (d > 0 && target + d <= hi && file.at(target + d - 1) == eot) {
      return {{0, target + d}, {target + d, n}};
    }
  }
  return {{0, target}, {target, n}};  // no boundary: split inside a document
}

Result<PackedBatcher> PackedBatcher::create(const TokenFile& file, TokenRange range, int B, int T,
                                            Order order, uint64_t seed) {
  if (B <= 0 || T <= 0) {
    return Status::invalid_argument("batcher over " + file.path() + ": batch " + std::to_string(B) +
                                    " and seq " + std::to_string(T) + " must both be positive");
  }
  if (range.begin < 0 || range.end > file.size() || range.begin > range.end) {
    return Status::invalid_argument("batcher over " + file.path() + ": token range [" +
                                    std::to_string(range.begin) + ", " + std::to_string(range.end) +
                                    ") is not inside the file's " + std::to_string(file.size()) +
                                    " tokens");
  }
  if (range.size() < static_cast<int64_t>(T) + 1) {
    return Status::invalid_argument(
        file.path() + ": the corpus has " + std::to_string(range.size()) +
        " tokens, fewer than seq+1 = " + std::to_string(static_cast<int64_t>(T) + 1) +
        "; use a smaller --seq or more data");
  }
  return PackedBatcher(&file, range, B, T, order, seed);
}

int64_t PackedBatcher::window_start(int64_t position) {
  HR_CHECK(order_ == Order::kShuffled && position >= 0);
  const int64_t W = windows_per_epoch();
  const int64_t epoch = position / W;
  if (epoch != loaded_epoch_) {
    // A stream of its own per (seed, epoch); the constants only decorrelate the two.
    SplitMix rng{seed_ * 0xD1B54A32D192ED03ull + uint64_t(epoch) * 0x9E3779B97F4A7C15ull + 7};
    perm_.resize(size_t(W));
    for (int64_t i = 0; i < W; i++) perm_[size_t(i)] = i;
    shuffle(&perm_, &rng);
    loaded_epoch_ = epoch;
  }
  return range_.begin + perm_[size_t(position % W)] * T_;
}

void PackedBatcher::next(int32_t* inputs, int32_t* targets) {
  for (int b = 0; b < B_; ++b) {
    int64_t start;
    if (order_ == Order::kShuffled) {
      start = window_start(position_);
      position_++;
    } else {
      if (position_ + T_ + 1 > range_.end) position_ = range_.begin;
      start = position_;
      position_ += T_;
    }
    file_->copy(start, T_, inputs + static_cast<int64_t>(b) * T_);
    file_->copy(start + 1, T_, targets + static_cast<int64_t>(b) * T_);
  }
}

void PackedBatcher::set_position(int64_t position) {
  HR_CHECK_MSG(valid_position(position), "batcher position outside its token range");
  position_ = position;
}

}  // namespace headroom::data
