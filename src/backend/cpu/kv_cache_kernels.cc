// Attention over a KV cache (kv_cache_kernels.h).
#include "backend/cpu/kv_cache_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"

namespace headroom::cpu {
namespace {

// q . k over 16 lanes (one AVX-512 register when the compiler vectorises it), summed in a fixed
// order: the same bits on every thread.
float dot16(const float* q, const float* k, int n) {
  float lanes[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; j++) lanes[j] += q[i + j] * k[i + j];
  }
  for (int j = 0; i < n; i++, j++) lanes[j] += q[i] * k[i];
  for (int w = 8; w > 0; w /= 2) {
    for (int j = 0; j < w; j++) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}

}  // namespace

void attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                              int rows, int pos0, int context, int NH, int NKV, int HS) {
  HR_CHECK(rows >= 0 && pos0 >= 0 && pos0 + rows <= context);
  HR_CHECK(NKV > 0 && NH % NKV == 0 && HS > 0 && HS <= kMaxCachedHeadSize);
  const int64_t ld = int64_t(NH + 2 * NKV) * HS;  // qkv's row
  const int64_t Q = int64_t(NH) * HS, KV = int64_t(NKV) * HS;
  // 1. The new rows' keys and values join the cache.
  for (int r = 0; r < rows; r++) {
    const float* row = qkv + r * ld;
    for (int g = 0; g < NKV; g++) {
      const int64_t at = (int64_t(g) * context + pos0 + r) * HS;
      std::memcpy(k_cache + at, row + Q + int64_t(g) * HS, size_t(HS) * sizeof(float));
      std::memcpy(v_cache + at, row + Q + KV + int64_t(g) * HS, size_t(HS) * sizeof(float));
    }
  }
  // 2. Each (row, head) on its own: the same operations in the same order for any thread count.
  const float scale = 1.0f / std::sqrt(float(HS));
  const int group = NH / NKV;
#pragma omp parallel for collapse(2) schedule(static)
  for (int r = 0; r < rows; r++) {
    for (int h = 0; h < NH; h++) {
      const float* q = qkv + r * ld + int64_t(h) * HS;
      const int g = h / group;
      const float* k = k_cache + int64_t(g) * context * HS;
      const float* v = v_cache + int64_t(g) * context * HS;
      float acc[kMaxCachedHeadSize];
      std::fill(acc, acc + HS, 0.0f);
      float mx = -INFINITY, sum = 0.0f;
      const int last = pos0 + r;
      for (int t = 0; t <= last; t++) {
        const float* kt = k + int64_t(t) * HS;
        const float s = dot16(q, kt, HS) * scale;
        const float* vt = v + int64_t(t) * HS;
        if (s > mx) {
          // A new maximum: what was summed so far shrinks by exp(old - new).
          const float c = std::exp(mx - s);
          sum *= c;
          for (int i = 0; i < HS; i++) acc[i] = acc[i] * c + vt[i];
          sum += 1.0f;
          mx = s;
        } else {
          const float p = std::exp(s - mx);
          sum += p;
          for (int i = 0; i < HS; i++) acc[i] += p * vt[i];
        }
      }
      float* o = out + int64_t(r) * Q + int64_t(h) * HS;
      const float inv = 1.0f / sum;
      for (int i = 0; i < HS; i++) o[i] = acc[i] * inv;
    }
  }
}

}  // namespace headroom::cpu
