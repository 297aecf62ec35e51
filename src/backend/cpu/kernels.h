// CPU kernels for transformer training, fp32, as forward/backward pairs (llm.c style: raw
// pointers, dimensions as arguments). OpenMP-parallel; results do not depend on the thread count
// beyond floating-point rounding, and are deterministic for a fixed thread count.
//
// Conventions, for every kernel below:
//  - Dimension letters: N rows (= B*T tokens), C channels, B batch, T time, NH heads, V vocab.
//  - Parameter gradients (dweight, dbias, dwte, ...) ACCUMULATE (+=): the trainer zeroes them once
//    per optimizer step, and micro-batches add into them (gradient accumulation).
//  - Activation gradients are OVERWRITTEN (=), except where a comment says "accumulates" (only
//    layernorm_backward's dinp and residual_backward, which feed the residual stream).
//  - Buffers do not alias unless a comment allows it.
//  - No kernel allocates memory: scratch comes from the caller, sized as documented (the caller's
//    buffer table plans it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace headroom::cpu {

// ---- embedding -----------------------------------------------------------------------------
// out[B,T,C] = wte[tokens[b,t], :] + wpe[t, :] (wpe null: no position table). tokens in [0, V).
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C);
// dwte[tokens[b,t], :] += dout[b,t,:]; dwpe[t,:] += sum_b dout[b,t,:] (skipped if dwpe is null).
// Deterministic (no atomics).
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C);

// ---- layernorm (eps = 1e-5, biased variance, as torch.nn.LayerNorm) -------------------------
// out[N,C] = (inp - mean) * rstd * weight + bias; saves mean[N], rstd[N] for the backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C);
// dinp ACCUMULATES (+=) the input gradient (it is the residual stream's gradient);
// dweight, dbias accumulate.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);

// ---- matmul --------------------------------------------------------------------------------
enum class WeightLayout {
  kInOut,  // weight[IC, OC] row-major: Hugging Face GPT-2 Conv1D; out = inp @ weight
  kOutIn,  // weight[OC, IC] row-major: torch.nn.Linear and tied LM head; out = inp @ weight^T
};
// Row strides, in floats, of the activation operands when their rows are padded (see
// activation_row_stride); 0 means dense (the row length). `inp` is the stride of inp and dinp,
// `out` of out and dout.
struct MatmulStrides {
  int64_t inp = 0;
  int64_t out = 0;
};
// out[N,OC] = inp[N,IC] x weight (+ bias[OC] if bias is not null).
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides strides = {});
// dinp[N,IC] = dout x weight^T (overwritten; skipped if dinp is null);
// dweight += inp^T x dout in weight's layout; dbias[OC] += column sums of dout (if not null).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides strides = {});

// The row stride to give an activation of `cols` elements of `elem_bytes` per row: `cols`, or
// `cols` plus 64 bytes when rows `cols` elements apart would start a multiple of 4 KiB apart. Such
// strides make the loads of successive rows compete for the same cache sets (4K aliasing): GPT-2's
// 3072-wide MLP GEMMs ran 2.4-2.6x slower with them on the development machine (docs/gemm.md).
int64_t activation_row_stride(int64_t cols, int64_t elem_bytes = 4);
// The row stride of the LM head's logits [N, V] and of their gradient, full or per chunk of the
// fused head: V rounded up to 64 elements, so every row starts on a cache line in fp32 and in bf16
// (oneDNN ran the head's GEMMs 1.2-1.6x faster so: docs/notes/lm-head-rows.md).
inline int64_t logits_row_stride(int64_t V) { return (V + 63) / 64 * 64; }

// ---- causal multi-head self-attention (plain: keeps the T x T probabilities) -----------------
// qkv[B,T,3C] holds q, k, v side by side (as GPT-2's c_attn output); head h uses channels
// [h*HS, (h+1)*HS) of each, HS = C/NH. Scores are scaled by 1/sqrt(HS), causal mask.
// out[B,T,C]; att[B,NH,T,T] saves the softmax probabilities (entries above the diagonal are 0).
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH);
// dqkv[B,T,3C] overwritten. scratch: at least attention_backward_scratch_floats(B,T,NH) floats.
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH);
size_t attention_backward_scratch_floats(int B, int T, int NH);
// Grouped-query attention (Llama): qkv[B,T,(NH + 2 NKV) HS] holds the NH q heads, then the NKV k
// heads, then the NKV v heads (HS = C/NH each); query head h reads kv head h / (NH/NKV). out and
// att as above; dqkv[B,T,(NH + 2 NKV) HS] overwritten, each kv head's dk and dv summed over its
// group's query heads (in query-head order, one task per (b, kv head)). With NKV == NH, the
// functions above, bit for bit (they call these). REQUIRES: NKV > 0, NH % NKV == 0.
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH,
                       int NKV);
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv,
                        const float* att, int B, int T, int C, int NH, int NKV);
// B*NH*T floats: one row of dL/d(probabilities) per (b, query head), whatever NKV.
size_t attention_backward_scratch_floats(int B, int T, int NH, int NKV);

// ---- GELU, tanh approximation (torch.nn.functional.gelu(x, approximate="tanh")) -------------
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = dout * gelu'(inp) (overwritten; dinp may alias dout).
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

// ---- residual ------------------------------------------------------------------------------
// out = a + b (out may alias a or b).
void residual_forward(float* out, const float* a, const float* b, int64_t n);
// da += dout; db += dout (both accumulate; either may be null).
void residual_backward(float* da, float* db, const float* dout, int64_t n);

// ---- softmax cross-entropy over the vocabulary --------------------------------------------
// losses[N] = -log softmax(logits[n,:])[targets[n]]. A target of -1 means "ignore": loss 0.
// One read of the logits from memory (the row's max, then its exponentials from L2; see Note
// [Softmax statistics with the exponentials kept] in docs/notes/memory-bound-kernels.md). With
// lse not null, also saves each row's log-sum-exp there
// (lse[N]; 0 for ignored rows, which are not read) for the backward below. Each row's results
// are the same bits whatever the thread count.
// ld: the logits' row stride in floats (0: dense, V); columns [V, ld) are never read.
void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                           int N, int V, int64_t ld = 0);
// dlogits[n,:] = (softmax(logits[n,:]) - onehot(targets[n])) * dloss, i.e. the gradient of
// dloss * sum_n losses[n]; rows with target -1 get 0. dlogits may alias logits (in place).
// dloss is normally 1 / (tokens in the whole optimizer step). Takes the forward's lse: one read
// of the logits from memory (the row's max, then exp(logits - max) * dloss * exp(max - lse) from
// L2) and one write.
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, int N, int V, float dloss);
// The backward in place, with dlogits stored as the GEMM that reads them wants them: kF32 as
// above; kF16 as fp32 holding the f16 rounding of each value (the fp16 path's f16 GEMM operand);
// kBF16 as a bf16 matrix [N, V] of row stride 2 ld (bf16 elements), each row over the first
// half of its own fp32 row (each value rounded once to nearest even: what
// round_rows_to_bf16_inplace makes of the fp32 gradient), in the same pass. ld: the logits' row
// stride in floats (0: dense, V), and the fp32 gradients' in floats; columns [V, ld) of the
// logits are neither read nor written, nor (with kBF16) the second half of each row.
// REQUIRES: lse from cross_entropy_forward over these logits.
void cross_entropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, int N,
                                    int V, float dloss, DType storage, int64_t ld = 0);
// cross_entropy_forward and then cross_entropy_backward_inplace, in one pass per row (for a
// training step, whose dloss is known before its forward): each row's statistics are taken on its
// first read, and its gradient written while the row is still in L2, so the logits are read from
// memory once instead of twice; the exponentials are kept over the row as fp32 and scaled (each
// computed once). losses, lse (when not null) and the gradient are the same bits as the two calls
// give; with bf16 the rest of each row (bf16 columns [V, 2 ld)) is left unspecified: scratch. See
// Note [One-pass loss and gradient] in docs/notes/loss.md.
void cross_entropy_forward_backward_inplace(float* losses, float* lse, float* logits,
                                            const int32_t* targets, int N, int V, float dloss,
                                            DType storage, int64_t ld = 0);
// Without a saved lse: the forward's losses only, and a backward that recomputes each row's
// statistics (keeping the exponentials in dlogits, then scaling them there).
void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int N,
                           int V);
void cross_entropy_backward(float* dlogits, const float* logits, const int32_t* targets, int N,
                            int V, float dloss);

// ---- bf16 mixed precision ----------------------------------------------------------------
// Overloads of the kernels above for bf16 activations (bf16_t, core/dtype.h): the same
// mathematics computed in fp32, each stored value rounded once to nearest even. Parameters
// (weights, biases, LayerNorm) are fp32 except the GEMM weights, which are bf16 copies of the fp32
// master weights; parameter gradients are fp32 and accumulate in fp32. The residual stream and
// the LayerNorm statistics stay fp32 (as under torch.autocast). See docs/notes/mixed-precision.md.
void layernorm_forward(bf16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const bf16_t* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);
// As above, and also stores the updated dinp rounded to bf16 in dinp_low[N, C] (the residual
// stream's gradient as the bf16 GEMMs read it), in the same pass instead of a cast after it.
void layernorm_backward(float* dinp, bf16_t* dinp_low, float* dweight, float* dbias,
                        const bf16_t* dout, const float* inp, const float* weight,
                        const float* mean, const float* rstd, int N, int C);
// bf16 x bf16 GEMMs (AMX / AVX512-BF16 through oneDNN) with an fp32 bias, into fp32 (e.g. the
// residual stream) or bf16.
void matmul_forward(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides strides = {});
void matmul_forward(bf16_t* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides strides = {});
// dinp (bf16) overwritten; dweight and dbias (fp32) accumulate.
void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                     const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                     WeightLayout layout, MatmulStrides strides = {});
// Areas (planned by the caller) for the transposed operands of the bf16 weight gradient: inp^T
// [IC, N] and dout^T [OC, N], dense rows. oneDNN's AMX GEMM runs dweight += inp^T x dout faster
// with both operands stored K-contiguous than with the strided rows it otherwise reads, the two
// transposing copies (transpose.h) included, on GPT-2 124M's MLP and LM-head shapes; not on its
// attention shapes (docs/gemm.md, "Transposed operands for the bf16 weight gradients").
struct Bf16WgradStaging {
  bf16_t* inp_t = nullptr;
  size_t inp_t_elems = 0;
  bf16_t* out_t = nullptr;
  size_t out_t_elems = 0;
};
// Whether the weight gradient of an [N, IC] x [IC, OC] bf16 matmul should take the transposed
// operands: max(IC, OC) >= 3072, the shapes where it measured faster. HEADROOM_BF16_WGRAD_TRANSPOSE
// (read at each call) overrides for tests and A/B timing: "1" every shape, "0" none; any other
// value throws std::invalid_argument naming it (the CLI checks it before any work).
bool bf16_wgrad_transposes(int N, int IC, int OC);
// On that path, which operands are copied: both for oneDNN, which wants them K-contiguous; only
// the GEMM's A where our AMX kernel runs it (amx_gemm.h: it packs B from rows anyway, so B is
// read in place): inp^T for kInOut (dW[IC,OC] += inp^T dout), dout^T for kOutIn (dW[OC,IC] +=
// dout^T inp).
struct Bf16WgradCopies {
  bool inp_t = false, out_t = false;
};
Bf16WgradCopies bf16_wgrad_copies(int N, WeightLayout layout);
// The same matmul_backward, the weight gradient computed from the transposed copies
// bf16_wgrad_copies names (inp^T, dout^T or both), written into `staging` (overwritten), and a
// GEMM over them: the same sums, possibly in another order (bits may differ within GEMM
// rounding). An empty staging (both pointers null) is the overload above. REQUIRES (when dweight
// is not null): staging.inp_t_elems >= IC * N, and staging.out_t_elems >= OC * N; for kOutIn it
// may be smaller, down to min(OC, 16) * N: dout^T then goes through it in chunks of rows (a
// multiple of 16), a transpose and a GEMM each (the LM head's vocabulary, in the planned staging).
void matmul_backward(bf16_t* dinp, float* dweight, float* dbias, const bf16_t* dout,
                     const bf16_t* inp, const bf16_t* weight, int N, int IC, int OC,
                     WeightLayout layout, MatmulStrides strides, const Bf16WgradStaging& staging);
// GELU in bf16 (and f16) storage: with AVX-512, either by lookup in two 65536-entry tables built
// from the computed path (gathers), or computed (gelu16); the same bits either way. Which:
// gelu_by_table(): the tables on Intel CPUs, where gathers are fast; computed elsewhere (on AMD's
// Zen 5 the computed path was as fast or faster; docs/notes/memory-bound-kernels.md, "Zen 5").
void gelu_forward(bf16_t* out, const bf16_t* inp, int64_t n);
void gelu_backward(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, int64_t n);
// Whether 16-bit GELU takes the tables. HEADROOM_GELU_TABLE (read at each call) overrides for
// tests and A/B timing: "1" tables, "0" computed; any other value throws std::invalid_argument
// naming it (the CLI checks it before any work). Without AVX-512 kernels: computed, always.
bool gelu_by_table();
// out[i] = bf16(inp[i]), round to nearest even (NaN stays NaN).
void cast_to_bf16(bf16_t* out, const float* inp, int64_t n);
// Rounds x[rows, cols] (row stride ld floats) to bf16 in place: row r's bf16 values start where
// its floats started, so as bf16 the matrix has row stride 2 * ld elements.
void round_rows_to_bf16_inplace(float* x, int64_t rows, int64_t cols, int64_t ld);

// ---- fp16 mixed precision ---------------------------------------------------------------
// Overloads for IEEE half activations (f16_t): the same mathematics computed in fp32, each stored
// value rounded once to nearest even; fp32 everywhere bf16 keeps fp32. See Note [fp16 GEMMs] in
// docs/notes/mixed-precision.md: oneDNN 2.6 creates no f16 matmul on x86, so an f16 GEMM widens
// its f16 operands (exactly: every f16 is an fp32) into a staging area, runs the fp32 GEMM and
// rounds an f16 output once. That is the arithmetic of an f16 x f16 -> fp32 GEMM: products of
// f16 values are exact in fp32 and the sums accumulate in fp32. The GEMM weight is fp32 holding
// f16 values (round_to_f16_values, cast per layer by the model), so it is never staged.
void layernorm_forward(f16_t* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const f16_t* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);
// With dinp_low: as the bf16 overload above, rounding to f16.
void layernorm_backward(float* dinp, f16_t* dinp_low, float* dweight, float* dbias,
                        const f16_t* dout, const float* inp, const float* weight, const float* mean,
                        const float* rstd, int N, int C);
void matmul_forward(float* out, const f16_t* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides strides = {});
void matmul_forward(f16_t* out, const f16_t* inp, const float* weight, const float* bias, int N,
                    int IC, int OC, WeightLayout layout, MatmulStrides strides = {});
void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const f16_t* dout, const f16_t* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides strides = {});
// The LM head's backward: dout is fp32 holding f16 values (dlogits rounded in place).
void matmul_backward(f16_t* dinp, float* dweight, float* dbias, const float* dout, const f16_t* inp,
                     const float* weight, int N, int IC, int OC, WeightLayout layout,
                     MatmulStrides strides = {});
void gelu_forward(f16_t* out, const f16_t* inp, int64_t n);
void gelu_backward(f16_t* dinp, const f16_t* inp, const f16_t* dout, int64_t n);
// out[i] = f16(inp[i]), round to nearest even (F16C / AVX-512 vcvtps2ph), overflow to infinity.
void cast_to_f16(f16_t* out, const float* inp, int64_t n);
// out[i] = inp[i] rounded to the nearest f16 value, kept as fp32 (out may alias inp).
void round_to_f16_values(float* out, const float* inp, int64_t n);
// gemm() (gemm.h) with one f16 operand or an f16 output, through the staging area.
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const f16_t* A, int lda,
              const float* B, int ldb, float* C, int ldc, const float* bias, bool accumulate);
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
              const f16_t* B, int ldb, float* C, int ldc, const float* bias, bool accumulate);
void gemm_f16(bool trans_a, bool trans_b, int M, int N, int K, const float* A, int lda,
              const float* B, int ldb, f16_t* C, int ldc, const float* bias);
// Floats of staging that the f16 overloads of matmul_forward / matmul_backward need for an
// [N, IC] x [IC, OC] matmul (the largest of its GEMMs): N * (IC + OC), each row padded as
// activation_row_stride pads fp32 rows (e.g. 3072 -> 3088 floats).
size_t f16_matmul_staging_floats(int64_t N, int64_t IC, int64_t OC);
// Binds the staging area (planned by the caller) for the f16 GEMMs of this scope on every
// thread; restores the previous binding when it ends. Not reentrant across threads: one model
// step at a time, as the GEMMs themselves are serialised (gemm.h).
class F16GemmStaging {
 public:
  F16GemmStaging(float* area, size_t floats);
  ~F16GemmStaging();
  F16GemmStaging(const F16GemmStaging&) = delete;
  F16GemmStaging& operator=(const F16GemmStaging&) = delete;

 private:
  float* prev_;
  size_t prev_floats_;
};
// The binding F16GemmStaging makes, as a call: binds `area` and returns the previous binding
// (for the backend op table, whose callers scope it themselves).
void bind_f16_gemm_staging(float* area, size_t floats, float** prev, size_t* prev_floats);

// ---- optimizer -----------------------------------------------------------------------------
struct AdamWParams {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;  // decoupled: param -= lr * weight_decay * param
  int step;            // 1-based, for bias correction
  float grad_scale;    // grads are multiplied by this first (clipping, loss-scale undo); 1 = none
};
// Updates params, m, v in place from grads (torch.optim.AdamW semantics). With params_bf16, also
// writes the updated parameters rounded to bf16 there (the GEMM copy of mixed precision), in the
// same pass.
void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                  const AdamWParams& p, bf16_t* params_bf16 = nullptr);
// adamw_update that also zeroes grads[0, n) in the same pass, each vector after it is read: the
// gradients' reset for the next step without a pass of its own. The same params, m, v and copy.
void adamw_update_and_zero(float* params, float* grads, float* m, float* v, int64_t n,
                           const AdamWParams& p, bf16_t* params_bf16 = nullptr);

// ---- reductions and simple ops ------------------------------------------------------------
// Sum of squares in double precision (for the global gradient norm). Deterministic.
double sum_squares(const float* x, int64_t n);
void scale_inplace(float* x, int64_t n, float s);
void zero(float* x, int64_t n);
// x[i] = +0.0f where mask[i] == 0, for i < n (a sparsity mask; model::apply_mask is this).
void apply_mask(const uint8_t* mask, float* x, int64_t n);

}  // namespace headroom::cpu
