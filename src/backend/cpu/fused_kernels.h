// Memory-saving fp32 kernels: tiled causal attention that never holds the T x T probabilities,
// and an LM head fused with cross-entropy that never holds the N x V logits. Same conventions as
// kernels.h (parameter grads accumulate, activation grads are overwritten, no allocation: scratch
// comes from the caller and its size is a function of the shapes only, so the planner can plan
// it). Design, scratch sizes and measurements: docs/notes/fused-kernels.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace headroom::cpu {

// ---- tiled causal self-attention (FlashAttention-2 style, online softmax) -------------------
// Same layout and mathematics as attention_forward/attention_backward in kernels.h: qkv[B,T,3C]
// holds q, k, v side by side; head h uses channels [h*HS, (h+1)*HS) of each, HS = C/NH; scores
// are scaled by 1/sqrt(HS); causal mask. REQUIRES: C % NH == 0, T >= 1.
//
// Work is split into query blocks x key blocks of kAttentionBlock rows; each OpenMP thread uses
// one fixed-size slot of the scratch. At most kAttentionMaxWorkers threads take part (the scratch
// has that many slots at most, so its size depends on the shapes only, never on the thread
// count). Every output element is computed by one task in a fixed order, so results are
// bit-identical for any thread count.
inline constexpr int kAttentionBlock = 64;
inline constexpr int kAttentionMaxWorkers = 64;

// out[B,T,C] = softmax(q k^T / sqrt(HS)) v per head; lse[B,NH,T] = log(sum_s exp(score_ts)), the
// log-sum-exp of each row of scaled scores (saved for the backward; B*NH*T floats instead of the
// B*NH*T*T probabilities). scratch: attention_tiled_scratch_floats(B,T,C,NH) floats.
void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             float* scratch);
// min(B*NH, 64) slots (tasks are heads) of 2*Tp*HS + 64*64 + 64 floats (Tp = T rounded up to
// 64; HS = 64, T = 256: 144 KiB a slot); with bf16 storage, the slots of the kernel that will run
// (see AttentionBf16Kernel below): for the bf16 tile products 1.5*Tp*HSp + 64*HSp + 6208
// floats (HSp = HS rounded up to 32), for the fp32 fallback the fp32 slot plus fp32 copies of the
// head's rows (T*4*HS floats).
size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, DType storage = DType::kF32);

// dqkv[B,T,3C] overwritten with the gradient of sum(out * dout). Recomputes the probabilities
// block by block from q, k and lse; out is the forward's output (for D_t = dout_t . out_t).
// scratch: attention_tiled_backward_scratch_floats(B,T,C,NH) floats.
void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch);
// min(B*NH, 64) slots of 3*Tp*HS + 2*64*HS + 2*64*64 + 64 floats (HS = 64, T = 256: 256 KiB a
// slot); with bf16 storage, for the bf16 tile products 6.5*Tp*HSp + Tp + 10240 floats, for the
// fp32 fallback the fp32 slot plus fp32 copies of the head's rows (T*8*HS floats).
size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH,
                                               DType storage = DType::kF32);

// bf16 storage (qkv, out, dout, dqkv; lse stays fp32): each task widens the rows it reads to
// fp32 in its scratch slot, computes as above and rounds its outputs once. Scratch sizes from
// the functions above with DType::kBF16.
void attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                             int NH, float* scratch);
void attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                              const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                              float* scratch);
// On a CPU with AMX-BF16 or AVX512-BF16 (checked at run time; AMX also needs the kernel's
// permission, asked for once) the bf16 overloads instead take the tile products in bf16 with
// fp32 accumulation, as FlashAttention does in bf16: P and dS are rounded to bf16 before their
// products; scores, softmax and accumulators stay fp32. Heads narrower than 32 take the
// fallback on any CPU (the bf16 layouts pad HS to 32). The scratch sizes above follow the path
// that will run. Results are bit-identical for any thread count on each path; the paths differ by
// rounding (Note [Tiled attention]).
enum class AttentionBf16Kernel {
  kAuto,        // the best the CPU has: kAmx, else kAvx512Bf16, else kWidenFp32
  kAmx,         // AMX-BF16 tiles (_tile_dpbf16ps)
  kAvx512Bf16,  // AVX512-BF16 vectors (vdpbf16ps)
  kWidenFp32,   // widen to fp32 and run the fp32 kernels, on any CPU
};
// Process-wide switch for tests and benchmarks; a kernel the CPU lacks falls back to the next
// one down the list. Scratch must be sized after it is set. The default is kAuto, or what the
// environment variable HEADROOM_BF16_ATTENTION says (auto, amx, avx512bf16 or widen; anything
// else throws std::invalid_argument), read once, to compare kernels in whole training steps.
void set_attention_bf16_kernel(AttentionBf16Kernel kernel);
// The kernel bf16 storage runs now (never kAuto).
AttentionBf16Kernel attention_bf16_kernel();

// f16 storage: the same as bf16 (scratch sizes with DType::kF16, equal to bf16's).
void attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T, int C, int NH,
                             float* scratch);
void attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv, const f16_t* out,
                              const float* lse, int B, int T, int C, int NH, float* scratch);

// ---- grouped-query attention (Llama): the functions above with NKV kv heads ------------------
// qkv[B, T, (NH + 2 NKV) HS] holds the NH q heads, then the NKV k heads, then the NKV v heads,
// HS = C / NH channels each; query head h reads kv head h / (NH / NKV); out[B, T, C] and lse[B,
// NH, T] as above. dqkv[B, T, (NH + 2 NKV) HS] is overwritten; each kv head's dk and dv are
// summed over its group's query heads (in fp32, in query-head order, inside one task: no K/V
// heads are expanded in memory). With NKV == NH these are the functions above, bit for bit (they
// call these). REQUIRES: NKV > 0, NH % NKV == 0, C % NH == 0, T >= 1. Bit-identical for any
// thread count on each path.
// The forward's tasks are query heads (scratch as above, whatever NKV); the backward's are (b, kv
// head) pairs: min(B * NKV, 64) slots of the sizes above.
size_t attention_tiled_scratch_floats(int B, int T, int C, int NH, int NKV,
                                      DType storage = DType::kF32);
size_t attention_tiled_backward_scratch_floats(int B, int T, int C, int NH, int NKV,
                                               DType storage = DType::kF32);
void attention_tiled_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             int NKV, float* scratch);
void attention_tiled_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int B, int T, int C, int NH, int NKV,
                              float* scratch);
void attention_tiled_forward(bf16_t* out, float* lse, const bf16_t* qkv, int B, int T, int C,
                             int NH, int NKV, float* scratch);
void attention_tiled_backward(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv,
                              const bf16_t* out, const float* lse, int B, int T, int C, int NH,
                              int NKV, float* scratch);
void attention_tiled_forward(f16_t* out, float* lse, const f16_t* qkv, int B, int T, int C, int NH,
                             int NKV, float* scratch);
void attention_tiled_backward(f16_t* dqkv, const f16_t* dout, const f16_t* qkv, const f16_t* out,
                              const float* lse, int B, int T, int C, int NH, int NKV,
                              float* scratch);

// ---- LM head fused with cross-entropy, chunked over tokens ----------------------------------
// logits[n,:] = x[n,:] x wte^T (wte[V,C], the tied embedding, kOutIn layout) are computed for
// `chunk` rows at a time into scratch and reduced at once, so the N x V logits never exist.
// Targets are in [0, V) or -1 (ignored: loss 0, zero gradient). REQUIRES: chunk >= 1.
// scratch: lm_head_ce_scratch_floats(chunk, V) = chunk * ld floats for every function below, ld
// = V rounded up to 64 (rows on cache lines: docs/notes/lm-head-rows.md). wte_rows (every
// function below): the rows of wte that may be read (>= V; 0 = V). With at least ld (wte's rows
// past V being any finite values, e.g. the next tensor of a flat buffer), each chunk's GEMM
// computes all ld columns, which oneDNN's bf16 AMX kernel runs 1.3-1.7x faster (dense output
// rows); columns past V are never read, so results are unchanged. With bf16 storage (the
// overloads below) also chunk * ld bf16 values of dlogits: 1.5x that.
size_t lm_head_ce_scratch_floats(int chunk, int V, DType storage = DType::kF32);

// losses[N] = logsumexp(logits[n,:]) - logits[n, targets[n]] (0 where the target is -1);
// lse[N] = logsumexp(logits[n,:]) for every row (ignored rows included), saved for the backward.
void lm_head_ce_forward(float* losses, float* lse, const float* x, const float* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows = 0);

// Gradient of dloss * sum_n losses[n]: recomputes each chunk's logits, turns them in place into
// dlogits = (softmax - onehot(target)) * dloss using lse, then dx[rows,C] = dlogits x wte
// (OVERWRITTEN; skipped if dx is null) and dwte[V,C] += dlogits^T x x[rows] (ACCUMULATES; skipped
// if dwte is null). Costs one extra LM-head GEMM (the recompute) over the unfused path.
void lm_head_ce_backward(float* dx, float* dwte, const float* x, const float* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows = 0);

// bf16 storage (x, wte: the bf16 copy of the tied embedding; dx): bf16 GEMMs into fp32 logits,
// the loss and softmax in fp32, dlogits rounded to bf16 for the backward GEMMs (as autocast);
// dwte (fp32) accumulates.
void lm_head_ce_forward(float* losses, float* lse, const bf16_t* x, const bf16_t* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows = 0);
void lm_head_ce_backward(bf16_t* dx, float* dwte, const bf16_t* x, const bf16_t* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows = 0);

// f16 storage (x, dx; wte is fp32 holding f16 values, kernels.h): x widened through the f16 GEMM
// staging (kernels.h F16GemmStaging: 2 x chunk x C floats), fp32 logits, the loss and softmax in
// fp32, dlogits rounded to f16 values in place (as autocast's f16 GEMMs would read them); dwte
// (fp32) accumulates. Scratch: chunk * ld floats, as fp32.
void lm_head_ce_forward(float* losses, float* lse, const f16_t* x, const float* wte,
                        const int32_t* targets, int N, int C, int V, int chunk, float* scratch,
                        int wte_rows = 0);
void lm_head_ce_backward(f16_t* dx, float* dwte, const f16_t* x, const float* wte,
                         const int32_t* targets, const float* lse, int N, int C, int V, int chunk,
                         float dloss, float* scratch, int wte_rows = 0);

// Forward and backward in one pass, for when dloss is known before the forward (the loss is the
// last op and dloss = 1 / tokens of the optimizer step): losses as lm_head_ce_forward, dx and
// dwte as lm_head_ce_backward, with no recompute (the unfused path's GEMM count) and no lse.
void lm_head_ce_forward_backward(float* losses, float* dx, float* dwte, const float* x,
                                 const float* wte, const int32_t* targets, int N, int C, int V,
                                 int chunk, float dloss, float* scratch);

}  // namespace headroom::cpu
