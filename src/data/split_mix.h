// The fixed random generator of the data order (shuffled windows, shuffled documents): the same
// sequence with every standard library, where std::shuffle and the std distributions are not.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace headroom::data {

// splitmix64 (Steele, Lea and Flood), seeded with any 64-bit value.
struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) (Lemire's multiply-shift; the bias is below 2^-32 for n < 2^32).
  uint64_t below(uint64_t n) { return uint64_t((unsigned __int128)next() * n >> 64); }
};

// Fisher-Yates with SplitMix: a permutation that depends only on the generator's state.
template <typename T>
void shuffle(std::vector<T>* v, SplitMix* rng) {
  for (size_t i = v->size(); i > 1; i--) std::swap((*v)[i - 1], (*v)[rng->below(i)]);
}

}  // namespace headroom::data
