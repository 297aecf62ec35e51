// CPU kernels of generation with a KV cache (docs/notes/generation.md): attention of new tokens
// over every earlier position's cached keys and values, with kernels.h's conventions (raw
// pointers, dimensions as arguments, OpenMP, no allocation, the same bits for any thread count).
#pragma once

#include <cstdint>

namespace headroom::cpu {

// The largest head size attention_cached_forward takes (its accumulator lives on the stack).
inline constexpr int kMaxCachedHeadSize = 512;

// Causal self-attention of `rows` new tokens at positions pos0 .. pos0 + rows - 1 over the cache:
//   1. appends each row's keys and values (qkv[rows, (NH + 2 NKV) HS]: q heads, k heads, v heads,
//      as attention_forward's) to k_cache / v_cache[NKV, context, HS] at its position;
//   2. out[r, h HS .. (h+1) HS) = softmax_t(q_rh . k_g[t] / sqrt(HS)) v_g[t] over t <= pos0 + r,
//      g = h / (NH / NKV), in fp32 with an online softmax (the running maximum rescales the sum
//      and the accumulator: no scores buffer), positions in increasing order.
// REQUIRES: pos0 + rows <= context, NH % NKV == 0, HS <= kMaxCachedHeadSize.
void attention_cached_forward(float* out, float* k_cache, float* v_cache, const float* qkv,
                              int rows, int pos0, int context, int NH, int NKV, int HS);

}  // namespace headroom::cpu
