// Knowledge distillation fused into the chunked LM head: per chunk of tokens, the student's and
// the teacher's logits, the cross-entropy and the temperature-softened KL between them, and the
// gradient of the student's logits, so that neither model's N x V logits ever exist. Same
// conventions as fused_kernels.h. See docs/notes/distillation.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/ops.h"
#include "core/dtype.h"

namespace headroom::cpu {

// Per token n with a target (targets[n] in [0, V); -1 ignores the token: loss 0, no gradient):
//   loss[n] = alpha * tau^2 * KL(softmax(t_n / tau) || softmax(s_n / tau)) + (1 - alpha) * CE(s_n)
// with s_n = x[n,:] x w^T the student's logits (w[V, C], kOutIn) and t_n = teacher.x[n,:] x
// teacher.w^T the teacher's (teacher.w[V, teacher.C]). The teacher is read only: it gets no
// gradient. REQUIRES: chunk >= 1, 0 <= alpha <= 1, tau > 0, teacher.dtype kF32 or kBF16.
//
// Scratch: `scratch` as lm_head_ce's, lm_head_ce_scratch_floats(min(chunk, N), V, storage) floats
// (the student's chunk of logits, chunk * ld floats with ld = V rounded up to 64, and with bf16
// storage the chunk's bf16 dlogits after it); teacher.logits_chunk the teacher's chunk, chunk *
// ld floats (lm_head_kd_teacher_floats(min(chunk, N), V)), a buffer of its own so that the plan
// counts it as the teacher's.
size_t lm_head_kd_teacher_floats(int chunk, int V);

// losses[N]: the per-token loss above. stats[4N], saved for the backward and for reports:
// stats[n] = logsumexp(s_n) (what lm_head_ce_forward's lse holds, every row), stats[N + n] =
// logsumexp(s_n / tau), stats[2N + n] = logsumexp(t_n / tau), stats[3N + n] = CE(s_n) alone (0 on
// ignored rows). With alpha = 0 the losses are lm_head_ce_forward's bit for bit.
void lm_head_kd_forward(float* losses, float* stats, const float* x, const float* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows = 0);
// Gradient of dloss * sum_n losses[n]: recomputes both chunks of logits, dlogits = dloss * ((1 -
// alpha) (softmax(s) - onehot) + alpha tau (softmax(s / tau) - softmax(t / tau))) from the saved
// stats, then dx = dlogits x w (OVERWRITTEN; skipped if null) and dw += dlogits^T x x
// (ACCUMULATES; skipped if null). With alpha = 0, lm_head_ce_backward's results bit for bit.
void lm_head_kd_backward(float* dx, float* dw, const float* x, const float* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows = 0);

// bf16 storage (x, w the bf16 copy; dx): as lm_head_ce_forward/backward's bf16 overloads, with
// dlogits rounded to bf16 for the backward GEMMs.
void lm_head_kd_forward(float* losses, float* stats, const bf16_t* x, const bf16_t* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows = 0);
void lm_head_kd_backward(bf16_t* dx, float* dw, const bf16_t* x, const bf16_t* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows = 0);

// f16 storage (w fp32 holding f16 values; the f16 GEMM staging bound, as lm_head_ce's f16
// overloads): dlogits rounded to f16 values in place.
void lm_head_kd_forward(float* losses, float* stats, const f16_t* x, const float* w,
                        const backend::KdTeacher& teacher, const int32_t* targets, int N, int C,
                        int V, int chunk, backend::KdLoss kd, float* scratch, int w_rows = 0);
void lm_head_kd_backward(f16_t* dx, float* dw, const f16_t* x, const float* w,
                         const backend::KdTeacher& teacher, const int32_t* targets,
                         const float* stats, int N, int C, int V, int chunk, backend::KdLoss kd,
                         float dloss, float* scratch, int w_rows = 0);

}  // namespace headroom::cpu
