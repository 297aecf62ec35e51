// CPU kernels of the Llama family's blocks (RMSNorm, SwiGLU, rotary position embeddings), as
// forward/backward pairs with kernels.h's conventions: raw pointers, dimensions as arguments,
// OpenMP, parameter gradients ACCUMULATE, activation gradients are OVERWRITTEN unless a comment
// says otherwise, no allocation, and every result the same bits for any thread count. Grouped-
// query attention is in kernels.h (plain) and fused_kernels.h (tiled), as overloads with NKV.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace headroom::cpu {

// ---- RMSNorm (as Hugging Face's LlamaRMSNorm, statistics in fp32) ---------------------------
// out[N,C] = (inp * rstd) * weight with rstd[n] = 1 / sqrt(mean_c(inp[n,c]^2) + eps), saved for
// the backward. The sum of squares runs over 16 lanes in an order fixed by C (not by the
// thread). 16-bit outputs: each value computed in fp32, rounded once to nearest even.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps);
void rmsnorm_forward(bf16_t* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps);
void rmsnorm_forward(f16_t* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps);
// With g = dout * weight and norm = inp * rstd:
//   dinp += rstd * (g - norm * mean_c(g * norm))   (ACCUMULATES: the residual stream's gradient)
//   dweight += sum_n dout * norm                   (accumulates)
// dweight's sums over rows are taken in blocks of rows fixed by N (as layernorm_backward's), so
// they do not depend on the thread count. dinp or dweight may be null (skipped).
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C);
void rmsnorm_backward(float* dinp, float* dweight, const bf16_t* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C);
void rmsnorm_backward(float* dinp, float* dweight, const f16_t* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C);
// As above, and also stores the updated dinp rounded to bf16 / f16 in dinp_low[N, C] in the same
// pass (the residual stream's gradient as the 16-bit GEMMs read it). REQUIRES: dinp, dinp_low
// not null.
void rmsnorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, const bf16_t* dout,
                      const float* inp, const float* weight, const float* rstd, int N, int C);
void rmsnorm_backward(float* dinp, f16_t* dinp_low, float* dweight, const f16_t* dout,
                      const float* inp, const float* weight, const float* rstd, int N, int C);

// ---- SwiGLU --------------------------------------------------------------------------------
// gu[N, 2I]: each row holds [gate (I) | up (I)], row stride ld_gu elements (>= 2I); out[N, I],
// row stride ld_out (>= I): out = silu(gate) * up, silu(x) = x sigmoid(x) = x / (1 + exp(-x)).
// Elements past each row's width are neither read nor written. Computed in fp32 (16-bit storage
// rounded once).
void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu);
void swiglu_forward(bf16_t* out, const bf16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu);
void swiglu_forward(f16_t* out, const f16_t* gu, int64_t N, int64_t I, int64_t ld_out,
                    int64_t ld_gu);
// dgu[N, 2I] (row stride ld_gu, gu's) OVERWRITTEN with [d gate | d up]:
//   d up = dout * silu(gate), d gate = dout * up * s (1 + gate (1 - s)), s = sigmoid(gate).
// dgu may alias gu (in place, as the model runs it): each vector of gate and up is read before
// the vectors at the same positions are written. dout[N, I] has row stride ld_dout.
void swiglu_backward(float* dgu, const float* gu, const float* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout);
void swiglu_backward(bf16_t* dgu, const bf16_t* gu, const bf16_t* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout);
void swiglu_backward(f16_t* dgu, const f16_t* gu, const f16_t* dout, int64_t N, int64_t I,
                     int64_t ld_gu, int64_t ld_dout);

// ---- rotary position embeddings (Hugging Face Llama's "rotate_half" convention) -------------
// Head dimension HS (even): element i < HS/2 of a head pairs with element i + HS/2.
struct RopeScaling {
  enum class Kind { kNone, kLlama3 } kind = Kind::kNone;
  float factor = 1, low_freq_factor = 1, high_freq_factor = 4;
  int original_max_position_embeddings = 8192;
};
// inv_freq[HS/2]: inv_freq[i] = 1 / theta^(2i/HS) (the exponent 2i/HS in fp32, as transformers
// computes it, the power in double, rounded once), then, with kLlama3, transformers'
// _compute_llama3_parameters (in double, rounded once): wavelen = 2 pi / inv_freq; kept where
// wavelen < original / high_freq_factor, divided by factor where wavelen > original /
// low_freq_factor, else (1 - smooth) inv_freq / factor + smooth inv_freq with smooth =
// (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor).
// REQUIRES: HS even and > 0, theta > 0; with kLlama3, factor > 0, high > low.
void rope_inv_freq(float* inv_freq, int HS, float theta, const RopeScaling& scaling);
// cos[T, HS/2], sin[T, HS/2] for positions pos0 .. pos0 + T - 1: angle = pos * inv_freq[i] in
// double, its cosine and sine in double, each rounded once to float.
void rope_table(float* cos, float* sin, const float* inv_freq, int HS, int pos0, int T);
// In place on the q heads and k heads of qkv[B, T, (NH + 2 NKV) * HS] (NH q heads, then NKV k
// heads, then NKV v heads, each HS wide; the v heads are not touched). Row t of each batch
// element uses row t of cos / sin [T, HS/2]. With x1 = x[i], x2 = x[i + HS/2]:
//   forward:  x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin;
//   backward: the transpose (the inverse rotation) on dqkv's q and k heads:
//             d1' = d1 cos + d2 sin, d2' = d2 cos - d1 sin.
// 16-bit storage: computed in fp32, each value rounded once. REQUIRES: HS even.
void rope_forward(float* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS);
void rope_forward(bf16_t* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS);
void rope_forward(f16_t* qkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                  int HS);
void rope_backward(float* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS);
void rope_backward(bf16_t* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS);
void rope_backward(f16_t* dqkv, const float* cos, const float* sin, int B, int T, int NH, int NKV,
                   int HS);

}  // namespace headroom::cpu
