// Memory-bound kernels against this machine's memory bandwidth: each benchmark reports the bytes
// it must move (read + write, counted once) per second, and `vs_triad`, that rate over a
// STREAM-like triad measured in the same process (once, before the first kernel that needs it).
// Sizes are far larger than the caches (300 MiB of L3 on the development machine): every
// buffer is at least 192 MiB, except the cross-entropy's logits, which are GPT-2's own
// (2048 x 50257 fp32, 412 MB). Kernels named "Before" are the previous versions (two-pass
// statistics, scalar-tail casts, the LayerNorm on `omp simd` loops with a second pass for its
// parameter gradients, GELU computed for every element where 16-bit storage now looks it up;
// kept here only to measure against in the same run. Benchmarks named "Paired" run a triad before
// every iteration and report `vs_triad_paired`, the median ratio to those neighbours (see
// paired_with_triad). Every buffer lives in memory like the arenas' (Buf).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fast_math.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/llama_kernels.h"
#include "memory/host_resource.h"

namespace headroom::cpu {
namespace {

// Buffers in memory like the arenas' (memory::HostAllocator: large blocks mmap'ed, on page and
// so cache-line boundaries, huge pages advised, touched once). A plain std::vector's large block
// comes from mmap 16 bytes past a page boundary, so each 64-byte vector of it straddles two lines:
// the padded loss step ran 1.12-1.17x its time on a line (docs/notes/memory-bound-kernels.md,
// "The loss's max in four chains, and benchmarks on a cache line").
template <typename T>
using Buf = std::vector<T, memory::HostAllocator<T>>;

// One prefaulted block per benchmark: the first touch of a page must not be timed.
template <typename T = float>
Buf<T> buffer(size_t n, float v) {
  return Buf<T>(n, from_f32<T>(v));
}

constexpr size_t kTriadN = size_t(64) << 20;  // 3 x 256 MiB

void triad(float* a, const float* b, const float* c, size_t n) {
#pragma omp parallel for simd schedule(static)
  for (size_t i = 0; i < n; i++) a[i] = b[i] + 0.5f * c[i];
}

// The triad's rate in bytes per second (12 bytes an element), the best of 10 after a warm-up.
double triad_bytes_per_s() {
  static const double rate = [] {
    Buf<float> a = buffer(kTriadN, 0), b = buffer(kTriadN, 1), c = buffer(kTriadN, 2);
    double best = 1e30;
    for (int r = 0; r < 11; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      triad(a.data(), b.data(), c.data(), kTriadN);
      benchmark::DoNotOptimize(a.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) best = std::min(best, s);
    }
    return double(kTriadN) * 12 / best;
  }();
  return rate;
}

// Bytes per iteration as bytes/s, and their ratio to the triad.
void report(benchmark::State& state, double bytes) {
  state.SetBytesProcessed(int64_t(double(state.iterations()) * bytes));
  state.counters["vs_triad"] = benchmark::Counter(bytes / triad_bytes_per_s(),
                                                  benchmark::Counter::kIsIterationInvariantRate);
}

// One benchmark iteration of `kernel` (after `setup`, untimed) right after one triad, both timed;
// the kernel's time is the iteration's (manual time), and vs_triad_paired is the median over
// iterations of the kernel's rate over the triad's just before it. This host's bandwidth drifts
// by a third within minutes (other tenants), so a ratio of neighbours in time is steadier than
// vs_triad, against the best triad of the program's start (docs/notes/memory-bound-kernels.md,
// "The loss's max in four chains, and benchmarks on a cache line").
template <typename Setup, typename Kernel>
void paired_with_triad(benchmark::State& state, double bytes, Setup&& setup, Kernel&& kernel) {
  static Buf<float> a = buffer(kTriadN, 0), b = buffer(kTriadN, 1), c = buffer(kTriadN, 2);
  std::vector<double> ratios;
  for (auto _ : state) {
    setup();
    const auto t0 = std::chrono::steady_clock::now();
    triad(a.data(), b.data(), c.data(), kTriadN);
    benchmark::DoNotOptimize(a.data());
    const auto t1 = std::chrono::steady_clock::now();
    kernel();
    const auto t2 = std::chrono::steady_clock::now();
    const double tk = std::chrono::duration<double>(t2 - t1).count();
    const double tt = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(tk);
    ratios.push_back((bytes / tk) / (double(kTriadN) * 12 / tt));
  }
  // (Not report(): its rates would divide by the iterations' whole time, triads included.)
  std::sort(ratios.begin(), ratios.end());
  if (!ratios.empty()) state.counters["vs_triad_paired"] = ratios[ratios.size() / 2];
}

// The kernel's iterations: timed alone (report(): GB/s and vs_triad), or with kPaired, each after
// a triad (paired_with_triad: vs_triad_paired). `bytes` is what one iteration must move.
template <bool kPaired, typename Kernel>
void timed(benchmark::State& state, double bytes, Kernel&& kernel) {
  if constexpr (kPaired) {
    paired_with_triad(
        state, bytes, [] {}, kernel);
  } else {
    for (auto _ : state) kernel();
    report(state, bytes);
  }
}

void BM_Triad(benchmark::State& state) {
  Buf<float> a = buffer(kTriadN, 0), b = buffer(kTriadN, 1), c = buffer(kTriadN, 2);
  for (auto _ : state) {
    triad(a.data(), b.data(), c.data(), kTriadN);
    benchmark::DoNotOptimize(a.data());
  }
  report(state, double(kTriadN) * 12);
}

// ---- the previous kernels, for before/after in one run -------------------------------------
namespace before {
void softmax_row_stats_two_pass(const float* x, int V, float* maxv, float* sum) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int i = 0; i < V; ++i) m = std::max(m, x[i]);
  float part[16] = {};
  int i = 0;
  for (; i + 16 <= V; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) part[j] += fast_exp(x[i + j] - m);
  }
  double s = 0.0;
  for (; i < V; ++i) s += fast_exp(x[i] - m);
  for (int j = 0; j < 16; ++j) s += part[j];
  *maxv = m;
  *sum = static_cast<float>(s);
}
void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int N,
                           int V) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float m, s;
    softmax_row_stats_two_pass(x, V, &m, &s);
    losses[n] = static_cast<float>(std::log(static_cast<double>(s)) + m - x[targets[n]]);
  }
}
void cross_entropy_backward(float* d, const float* logits, const int32_t* targets, int N, int V,
                            float dloss) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float m, s;
    softmax_row_stats_two_pass(x, V, &m, &s);
    const float k = dloss / s;
#pragma omp simd
    for (int i = 0; i < V; ++i) d[n * V + i] = fast_exp(x[i] - m) * k;
    d[n * V + targets[n]] -= dloss;
  }
}
// main's GELU before the lookup tables and before the sigma form (session 11): every element
// computed, with AVX-512 16 lanes at a time, each thread's range ending in one masked vector, as
// x - x / (exp(2u) + 1) with exp16 and a reciprocal refined by one Newton step.
#if HR_AVX512_KERNELS
inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_maskz_rcp14_ps(0xFFFF, d);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
}
// s = 1 / (exp(2u) + 1) with u = sqrt(2/pi) (x + 0.044715 x^3), x2 = x^2.
inline __m512 tanh_form_s(__m512 x, __m512 x2) {
  const __m512 u2 =
      _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(2.0f * 0.7978845608028654f)),
                    _mm512_fmadd_ps(x2, _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f)));
  return recip16(_mm512_add_ps(exp16(u2), _mm512_set1_ps(1.0f)));
}
inline __m512 gelu16(__m512 x) {
  return _mm512_fnmadd_ps(x, tanh_form_s(x, _mm512_mul_ps(x, x)), x);
}
inline __m512 gelu_grad16(__m512 x) {
  const __m512 x2 = _mm512_mul_ps(x, x);
  const __m512 s = tanh_form_s(x, x2);
  const __m512 du2 =
      _mm512_fmadd_ps(x2, _mm512_set1_ps(2.0f * 0.7978845608028654f * 3.0f * 0.044715f),
                      _mm512_set1_ps(2.0f * 0.7978845608028654f));
  const __m512 one_minus_s = _mm512_sub_ps(_mm512_set1_ps(1.0f), s);
  return _mm512_mul_ps(one_minus_s,
                       _mm512_fmadd_ps(_mm512_mul_ps(x, s), du2, _mm512_set1_ps(1.0f)));
}
template <typename TO, typename TI, typename F>
void map16(TO* out, const TI* in, const TI* in2, int64_t n, F f) {
#pragma omp parallel
  {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t units = (n + 63) / 64, per = units / nth, rem = units % nth;
    const int64_t u0 = tid * per + std::min(tid, rem), u1 = u0 + per + (tid < rem ? 1 : 0);
    const int64_t i0 = std::min(n, u0 * 64), i1 = std::min(n, u1 * 64);
    for (int64_t i = i0; i < i1; i += 16) {
      const __mmask16 m = first_lanes(i1 - i);
      store16(out + i, m,
              in2 != nullptr ? f(load16(in + i, m), load16(in2 + i, m))
                             : f(load16(in + i, m), _mm512_setzero_ps()));
    }
  }
}
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
  map16(out, inp, static_cast<const T*>(nullptr), n, [](__m512 x, __m512) { return gelu16(x); });
}
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
  map16(dinp, inp, dout, n, [](__m512 x, __m512 d) { return _mm512_mul_ps(gelu_grad16(x), d); });
}
#else
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f32(inp[i]);
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    out[i] = from_f32<T>(0.5f * x * (1.0f + fast_tanh(u)));
  }
}
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = to_f32(inp[i]);
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float th = fast_tanh(u);
    const float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    dinp[i] = from_f32<T>(grad * to_f32(dout[i]));
  }
}
#endif
void cast_to_bf16(bf16_t* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<bf16_t>(inp[i]);
}
void round_to_f16_values(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = round_f16(inp[i]);
}
// main's LayerNorm (before the AVX-512 row kernels and the one-pass backward).
template <typename TOut>
void layernorm_forward(TOut* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
  constexpr float kEps = 1e-5f;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int c = 0; c < C; ++c) s += x[c];
    const float m = s / C;
    float v = 0.0f;  // two-pass variance: no cancellation for rows with a large mean
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    const float r = 1.0f / std::sqrt(v / C + kEps);
    TOut* o = out + n * C;
    if (bias != nullptr) {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = from_f32<TOut>((x[c] - m) * r * weight[c] + bias[c]);
    } else {
#pragma omp simd
      for (int c = 0; c < C; ++c) o[c] = from_f32<TOut>((x[c] - m) * r * weight[c]);
    }
    mean[n] = m;
    rstd[n] = r;
  }
}

// With dinp_low (not null), also stores each updated dinp value rounded to TL there.
template <typename TD, typename TL = float>
void layernorm_backward(float* dinp, float* dweight, float* dbias, const TD* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C,
                        TL* dinp_low = nullptr) {
  // Input gradient: rows are independent.
  if (dinp != nullptr) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const TD* dy = dout + n * C;
      const float m = mean[n], r = rstd[n];
      float sum_dn = 0.0f, sum_dn_n = 0.0f;
#pragma omp simd reduction(+ : sum_dn, sum_dn_n)
      for (int c = 0; c < C; ++c) {
        const float dn = to_f32(dy[c]) * weight[c];
        sum_dn += dn;
        sum_dn_n += dn * (x[c] - m) * r;
      }
      const float mean_dn = sum_dn / C, mean_dn_n = sum_dn_n / C;
      float* dx = dinp + n * C;
      if (dinp_low == nullptr) {
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const float norm = (x[c] - m) * r;
          dx[c] += (to_f32(dy[c]) * weight[c] - mean_dn - norm * mean_dn_n) * r;
        }
      } else {
        TL* lo = dinp_low + n * C;
#pragma omp simd
        for (int c = 0; c < C; ++c) {
          const float norm = (x[c] - m) * r;
          const float v = dx[c] + (to_f32(dy[c]) * weight[c] - mean_dn - norm * mean_dn_n) * r;
          dx[c] = v;
          lo[c] = from_f32<TL>(v);
        }
      }
    }
  }
  // Parameter gradients: reductions over rows, parallel over channels (deterministic).
  if (dweight == nullptr && dbias == nullptr) return;
#pragma omp parallel
  {
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int64_t units = (int64_t{C} + 15) / 16, per = units / nth, rem = units % nth;
    const int64_t c0 = std::min<int64_t>(C, (tid * per + std::min(tid, rem)) * 16);
    const int64_t c1 =
        std::min<int64_t>(C, (tid * per + std::min(tid, rem) + per + (tid < rem)) * 16);
    for (int64_t cb = c0; cb < c1; cb += 256) {
      const int64_t w = std::min<int64_t>(256, c1 - cb);
      float acc_w[256] = {}, acc_b[256] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C + cb;
        const TD* dy = dout + n * C + cb;
        const float m = mean[n], r = rstd[n];
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) {
          const float d = to_f32(dy[j]);
          acc_w[j] += d * ((x[j] - m) * r);
          acc_b[j] += d;
        }
      }
      if (dweight != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) dweight[cb + j] += acc_w[j];
      }
      if (dbias != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < w; ++j) dbias[cb + j] += acc_b[j];
      }
    }
  }
}

}  // namespace before

// ---- LayerNorm: 65536 rows of 768 (192 MiB fp32) -------------------------------------------
constexpr int kRows = 65536, C = 768;

// Over state.range(0) rows: 65536 (from memory) or 256 (768 KiB of input: from L2, what the
// arithmetic alone allows).
// kBefore: main's kernel before the AVX-512 row kernels.
template <typename T, bool kBefore, bool kPaired = false>
void BM_LayerNormForward(benchmark::State& state) {
  const int rows = int(state.range(0));
  Buf<float> inp(size_t(rows) * C), w = buffer(C, 1), b = buffer(C, 0),
                                    mean = buffer(size_t(rows), 0), rstd = buffer(size_t(rows), 0);
  for (size_t i = 0; i < inp.size(); ++i) inp[i] = float(int(i * 2654435761u % 2000u)) * 0.001f;
  Buf<T> out = buffer<T>(size_t(rows) * C, 0);
  timed<kPaired>(state, double(rows) * C * (4 + sizeof(T)), [&] {
    if constexpr (kBefore) {
      before::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(),
                                b.data(), rows, C);
    } else {
      layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), rows,
                        C);
    }
  });
}

template <typename T, bool kBefore, bool kPaired = false>
void BM_LayerNormBackward(benchmark::State& state) {
  Buf<float> inp = buffer(size_t(kRows) * C, 0.5f), dinp = buffer(size_t(kRows) * C, 0),
             w = buffer(C, 1), dw = buffer(C, 0), db = buffer(C, 0), mean = buffer(kRows, 0),
             rstd = buffer(kRows, 1);
  Buf<T> dout = buffer<T>(size_t(kRows) * C, 0.1f);
  // What one pass must move: inp, dout and dinp read, dinp written. (main's kernel read inp and
  // dout a second time for the parameter gradients; the current one folds them into the pass.)
  timed<kPaired>(state, double(kRows) * C * (12 + sizeof(T)), [&] {
    if constexpr (kBefore) {
      before::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(),
                                 w.data(), mean.data(), rstd.data(), kRows, C);
    } else {
      layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                         mean.data(), rstd.data(), kRows, C);
    }
  });
}

// ---- elementwise: 64M elements --------------------------------------------------------------
constexpr int64_t kElems = int64_t(64) << 20;

// GELU over state.range(0) elements: 64M (from memory) or 256K (from L2: what the arithmetic
// alone allows, the ceiling for the memory-bound size). Inputs spread over [-4, 4) (an MLP's
// pre-activations are of that order), so that table lookups (16-bit storage) touch the entries
// a training step touches, not one entry.
template <typename T>
Buf<T> gelu_input(int64_t n) {
  Buf<T> v(static_cast<size_t>(n));
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t h = uint32_t(i) * 2654435761u;
    v[i] = from_f32<T>(float(h >> 8) * (8.0f / 16777216.0f) - 4.0f);
  }
  return v;
}
template <typename T, bool kBefore, bool kPaired = false>
void BM_GeluForward(benchmark::State& state) {
  const int64_t n = state.range(0);
  Buf<T> inp = gelu_input<T>(n), out = buffer<T>(size_t(n), 0);
  timed<kPaired>(state, double(n) * 2 * sizeof(T), [&] {
    if constexpr (kBefore) {
      before::gelu_forward(out.data(), inp.data(), n);
    } else {
      gelu_forward(out.data(), inp.data(), n);
    }
  });
}

template <typename T, bool kBefore, bool kPaired = false>
void BM_GeluBackward(benchmark::State& state) {
  const int64_t n = state.range(0);
  // Not in place (the model runs it in place: BM_GeluBackwardInPlacePaired): repeated in place,
  // dout would decay to subnormals and 0 where |gelu'| < 1, which is not what a step sees. The
  // write then costs a read for ownership (as the triad's and the forward's do).
  Buf<T> inp = gelu_input<T>(n), d = buffer<T>(size_t(n), 0.1f), dx = buffer<T>(size_t(n), 0);
  timed<kPaired>(state, double(n) * 3 * sizeof(T), [&] {
    if constexpr (kBefore) {
      before::gelu_backward(dx.data(), inp.data(), d.data(), n);
    } else {
      gelu_backward(dx.data(), inp.data(), d.data(), n);
    }
  });
}

// In place, as the model runs it (gelu_backward(d, x, d), gpt2.cc): dout's lines are read before
// they are written, so the write costs no read for ownership. dout is restored from a copy before
// each iteration (untimed; the triad between them evicts it from the caches), so that it does not
// decay as BM_GeluBackward's comment says.
template <typename T>
void BM_GeluBackwardInPlacePaired(benchmark::State& state) {
  const int64_t n = state.range(0);
  Buf<T> inp = gelu_input<T>(n), d0 = buffer<T>(size_t(n), 0.1f), d = buffer<T>(size_t(n), 0);
  paired_with_triad(
      state, double(n) * 3 * sizeof(T),
      [&] { std::memcpy(d.data(), d0.data(), size_t(n) * sizeof(T)); },
      [&] { gelu_backward(d.data(), inp.data(), d.data(), n); });
}

template <bool kPaired = false>
void BM_Residual(benchmark::State& state) {
  Buf<float> a = buffer(size_t(kElems), 1), b = buffer(size_t(kElems), 2);
  timed<kPaired>(state, double(kElems) * 12,
                 [&] { residual_forward(a.data(), a.data(), b.data(), kElems); });
}

template <bool kPaired = false>
void BM_ResidualBackward(benchmark::State& state) {
  Buf<float> a = buffer(size_t(kElems), 1), d = buffer(size_t(kElems), 2);
  timed<kPaired>(state, double(kElems) * 12,
                 [&] { residual_backward(a.data(), nullptr, d.data(), kElems); });
}

template <bool kBefore, bool kPaired = false>
void BM_CastToBf16(benchmark::State& state) {
  Buf<float> inp = buffer(size_t(kElems), 0.3f);
  Buf<bf16_t> out = buffer<bf16_t>(size_t(kElems), 0);
  timed<kPaired>(state, double(kElems) * 6, [&] {
    if constexpr (kBefore) {
      before::cast_to_bf16(out.data(), inp.data(), kElems);
    } else {
      cast_to_bf16(out.data(), inp.data(), kElems);
    }
  });
}

template <bool kPaired = false>
void BM_CastToF16(benchmark::State& state) {
  Buf<float> inp = buffer(size_t(kElems), 0.3f);
  Buf<f16_t> out = buffer<f16_t>(size_t(kElems), 0);
  timed<kPaired>(state, double(kElems) * 6, [&] { cast_to_f16(out.data(), inp.data(), kElems); });
}

template <bool kBefore, bool kPaired = false>
void BM_RoundToF16Values(benchmark::State& state) {
  Buf<float> x = buffer(size_t(kElems), 0.3f);
  timed<kPaired>(state, double(kElems) * 8, [&] {
    if constexpr (kBefore) {
      before::round_to_f16_values(x.data(), x.data(), kElems);
    } else {
      round_to_f16_values(x.data(), x.data(), kElems);
    }
  });
}

template <bool kPaired = false>
void BM_AdamW(benchmark::State& state) {
  const int64_t n = 124'000'000;
  Buf<float> p = buffer(size_t(n), 0.01f), g = buffer(size_t(n), 0.001f), m = buffer(size_t(n), 0),
             v = buffer(size_t(n), 0);
  AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  // reads p, g, m, v; writes p, m, v
  timed<kPaired>(state, double(n) * 28,
                 [&] { adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp); });
}

template <bool kPaired = false>
void BM_AdamWWithBf16Copy(benchmark::State& state) {
  const int64_t n = 124'000'000;
  Buf<float> p = buffer(size_t(n), 0.01f), g = buffer(size_t(n), 0.001f), m = buffer(size_t(n), 0),
             v = buffer(size_t(n), 0);
  Buf<bf16_t> copy = buffer<bf16_t>(size_t(n), 0);
  AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  timed<kPaired>(state, double(n) * 30,
                 [&] { adamw_update(p.data(), g.data(), m.data(), v.data(), n, hp, copy.data()); });
}

// The gradient norm's pass (sum_squares prefetches 8 KiB ahead).
template <bool kPaired = false>
void BM_SumSquares(benchmark::State& state) {
  const int64_t n = 124'000'000;
  Buf<float> g = buffer(size_t(n), 0.001f);
  timed<kPaired>(state, double(n) * 4, [&] { benchmark::DoNotOptimize(sum_squares(g.data(), n)); });
}

// The trainer's ZeRO-0 AdamW pass: the bf16 copy streamed, the gradients zeroed behind the reads
// (zero after the first iteration: the same bytes move).
template <bool kPaired = false>
void BM_AdamWAndZeroWithBf16Copy(benchmark::State& state) {
  const int64_t n = 124'000'000;
  Buf<float> p = buffer(size_t(n), 0.01f), g = buffer(size_t(n), 0.001f), m = buffer(size_t(n), 0),
             v = buffer(size_t(n), 0);
  Buf<bf16_t> copy = buffer<bf16_t>(size_t(n), 0);
  AdamWParams hp{1e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1, 1.0f};
  // reads p, g, m, v; writes p, m, v, g (no read for ownership: just read) and the copy
  timed<kPaired>(state, double(n) * 34, [&] {
    adamw_update_and_zero(p.data(), g.data(), m.data(), v.data(), n, hp, copy.data());
  });
}

// ---- the loss over GPT-2's logits: 2048 tokens x 50257 (412 MB fp32) ------------------------
constexpr int kTokens = 2048, kVocab = 50257;

struct Logits {
  Buf<float> x;
  Buf<int32_t> targets;
  Logits() : x(size_t(kTokens) * kVocab), targets(kTokens) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i * 2654435761u % 2000u)) * 0.005f;
    for (int n = 0; n < kTokens; ++n) targets[size_t(n)] = (n * 7919) % kVocab;
  }
};
constexpr double kLogitBytes = double(kTokens) * kVocab * 4;

template <bool kBefore>
void BM_CrossEntropyForward(benchmark::State& state) {
  Logits l;
  Buf<float> losses(kTokens), lse(kTokens);
  for (auto _ : state) {
    if constexpr (kBefore) {
      before::cross_entropy_forward(losses.data(), l.x.data(), l.targets.data(), kTokens, kVocab);
    } else {
      cross_entropy_forward(losses.data(), lse.data(), l.x.data(), l.targets.data(), kTokens,
                            kVocab);
    }
  }
  report(state, kLogitBytes);  // the logits read once: what one pass must move
}

// In place, as the model runs it. The same logits every iteration: the gradient overwrites
// them, so each iteration first restores them outside the timing.
void ce_backward_bench(benchmark::State& state, DType storage, bool before_kernels) {
  Logits l;
  Buf<float> x = l.x, losses(kTokens), lse(kTokens);
  cross_entropy_forward(losses.data(), lse.data(), l.x.data(), l.targets.data(), kTokens, kVocab);
  const float dloss = 1.0f / kTokens;
  for (auto _ : state) {
    state.PauseTiming();
    std::memcpy(x.data(), l.x.data(), x.size() * sizeof(float));
    state.ResumeTiming();
    if (before_kernels) {
      before::cross_entropy_backward(x.data(), x.data(), l.targets.data(), kTokens, kVocab, dloss);
      if (storage == DType::kBF16) round_rows_to_bf16_inplace(x.data(), kTokens, kVocab, kVocab);
      if (storage == DType::kF16)
        before::round_to_f16_values(x.data(), x.data(), int64_t(x.size()));
    } else {
      cross_entropy_backward_inplace(x.data(), lse.data(), l.targets.data(), kTokens, kVocab, dloss,
                                     storage);
    }
    benchmark::DoNotOptimize(x.data());
  }
  // One read of the logits and one write of dlogits in their storage: what one pass must move.
  report(state, kLogitBytes * (storage == DType::kBF16 ? 1.5 : 2.0));
}

void BM_CrossEntropyBackward(benchmark::State& s) { ce_backward_bench(s, DType::kF32, false); }
void BM_CrossEntropyBackwardBefore(benchmark::State& s) { ce_backward_bench(s, DType::kF32, true); }
void BM_CrossEntropyBackwardBf16(benchmark::State& s) { ce_backward_bench(s, DType::kBF16, false); }
void BM_CrossEntropyBackwardBf16Before(benchmark::State& s) {
  ce_backward_bench(s, DType::kBF16, true);
}
void BM_CrossEntropyBackwardF16(benchmark::State& s) { ce_backward_bench(s, DType::kF16, false); }

// A training step's loss (Note [One-pass loss and gradient], docs/notes/loss.md): the forward and
// then the in-place backward (two reads of the logits), or both in one pass per row (one read).
// padded: rows at the model's stride (logits_row_stride: 50304 floats, every row on a 64-byte
// boundary), as a training step runs it; else dense (stride V).
// paired: each iteration after a triad (paired_with_triad), the one pass only.
void ce_step_bench(benchmark::State& state, DType storage, bool one_pass, bool padded = false,
                   bool paired = false) {
  Logits l;
  const int64_t ld = padded ? logits_row_stride(kVocab) : kVocab;
  Buf<float> x0(size_t(kTokens) * size_t(ld), 0.0f), losses(kTokens), lse(kTokens);
  for (int n = 0; n < kTokens; ++n) {
    std::memcpy(x0.data() + n * ld, l.x.data() + size_t(n) * kVocab, kVocab * sizeof(float));
  }
  Buf<float> x = x0;
  const float dloss = 1.0f / kTokens;
  // One read of the logits and one write of dlogits: what the one pass moves.
  const double bytes = kLogitBytes * (storage == DType::kBF16 ? 1.5 : 2.0);
  if (paired) {
    paired_with_triad(
        state, bytes, [&] { std::memcpy(x.data(), x0.data(), x.size() * sizeof(float)); },
        [&] {
          cross_entropy_forward_backward_inplace(losses.data(), lse.data(), x.data(),
                                                 l.targets.data(), kTokens, kVocab, dloss, storage,
                                                 ld);
        });
    return;
  }
  for (auto _ : state) {
    state.PauseTiming();
    std::memcpy(x.data(), x0.data(), x.size() * sizeof(float));
    state.ResumeTiming();
    if (one_pass) {
      cross_entropy_forward_backward_inplace(losses.data(), lse.data(), x.data(), l.targets.data(),
                                             kTokens, kVocab, dloss, storage, ld);
    } else {
      cross_entropy_forward(losses.data(), lse.data(), x.data(), l.targets.data(), kTokens, kVocab,
                            ld);
      cross_entropy_backward_inplace(x.data(), lse.data(), l.targets.data(), kTokens, kVocab, dloss,
                                     storage, ld);
    }
    benchmark::DoNotOptimize(x.data());
  }
  report(state, bytes);
}
void BM_CrossEntropyStepTwoPass(benchmark::State& s) { ce_step_bench(s, DType::kF32, false); }
void BM_CrossEntropyStep(benchmark::State& s) { ce_step_bench(s, DType::kF32, true); }
void BM_CrossEntropyStepBf16TwoPass(benchmark::State& s) { ce_step_bench(s, DType::kBF16, false); }
void BM_CrossEntropyStepBf16(benchmark::State& s) { ce_step_bench(s, DType::kBF16, true); }
void BM_CrossEntropyStepPadded(benchmark::State& s) { ce_step_bench(s, DType::kF32, true, true); }
void BM_CrossEntropyStepBf16Padded(benchmark::State& s) {
  ce_step_bench(s, DType::kBF16, true, true);
}
void BM_CrossEntropyStepPaddedPaired(benchmark::State& s) {
  ce_step_bench(s, DType::kF32, true, true, true);
}
void BM_CrossEntropyStepBf16Paired(benchmark::State& s) {
  ce_step_bench(s, DType::kBF16, true, false, true);
}
void BM_CrossEntropyStepBf16PaddedPaired(benchmark::State& s) {
  ce_step_bench(s, DType::kBF16, true, true, true);
}

// ---- Llama kernels (llama_kernels.h), paired with the triad ------------------------------------
// Llama 3.2 1B's shapes: C = 2048, I = 8192, NH = 32 q heads and NKV = 8 kv heads of 64. Every
// buffer at least 192 MiB in fp32, as above.

// RMSNorm over 24576 rows of 2048 (192 MiB fp32 input). Forward: inp read, out written;
// backward: inp, dout and dinp read, dinp written (dweight summed in the same pass).
constexpr int kRmsRows = 24576, kRmsC = 2048;
template <typename T>
void BM_RmsNormForwardPaired(benchmark::State& state) {
  Buf<float> inp(size_t(kRmsRows) * kRmsC), w = buffer(kRmsC, 1), rstd = buffer(kRmsRows, 0);
  for (size_t i = 0; i < inp.size(); ++i) inp[i] = float(int(i * 2654435761u % 2000u)) * 0.001f;
  Buf<T> out = buffer<T>(inp.size(), 0);
  timed<true>(state, double(inp.size()) * (4 + sizeof(T)), [&] {
    rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), kRmsRows, kRmsC, 1e-5f);
  });
}
template <typename T>
void BM_RmsNormBackwardPaired(benchmark::State& state) {
  Buf<float> inp = buffer(size_t(kRmsRows) * kRmsC, 0.5f), dinp = buffer(inp.size(), 0),
             w = buffer(kRmsC, 1), dw = buffer(kRmsC, 0), rstd = buffer(kRmsRows, 1);
  Buf<T> dout = buffer<T>(inp.size(), 0.1f);
  timed<true>(state, double(inp.size()) * (12 + sizeof(T)), [&] {
    rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(),
                     kRmsRows, kRmsC);
  });
}

// SwiGLU over 4096 rows of I = 8192 (gu: 256 MiB fp32). Forward: gu read, out written; the
// backward in place, as the model runs it: gu and dout read, dgu written over gu (restored from a
// copy before each iteration, untimed, as BM_GeluBackwardInPlacePaired does).
constexpr int64_t kGluRows = 4096, kGluI = 8192;
template <typename T>
Buf<T> swiglu_input() {
  Buf<T> v(size_t(kGluRows * 2 * kGluI));
  for (size_t i = 0; i < v.size(); ++i) {
    v[i] = from_f32<T>(float((uint32_t(i) * 2654435761u) >> 8) * (8.0f / 16777216.0f) - 4.0f);
  }
  return v;
}
template <typename T>
void BM_SwiGluForwardPaired(benchmark::State& state) {
  Buf<T> gu = swiglu_input<T>(), out = buffer<T>(size_t(kGluRows * kGluI), 0);
  timed<true>(state, double(kGluRows * kGluI) * 3 * sizeof(T),
              [&] { swiglu_forward(out.data(), gu.data(), kGluRows, kGluI, kGluI, 2 * kGluI); });
}
template <typename T>
void BM_SwiGluBackwardInPlacePaired(benchmark::State& state) {
  Buf<T> gu0 = swiglu_input<T>(), gu = buffer<T>(gu0.size(), 0);
  Buf<T> dout = buffer<T>(size_t(kGluRows * kGluI), 0.1f);
  paired_with_triad(
      state, double(kGluRows * kGluI) * 5 * sizeof(T),
      [&] { std::memcpy(gu.data(), gu0.data(), gu0.size() * sizeof(T)); },
      [&] {
        swiglu_backward(gu.data(), gu.data(), dout.data(), kGluRows, kGluI, 2 * kGluI, kGluI);
      });
}

// RoPE in place on qkv[8, 2048, (32 + 2 * 8) * 64] (192 MiB fp32): the q and k heads (5/6 of each
// row) read and written, the v heads untouched; the cos / sin tables (512 KiB) from the caches.
// Repeated in place: a rotation keeps the values' size.
constexpr int kRopeB = 8, kRopeT = 2048, kRopeNH = 32, kRopeNKV = 8, kRopeHS = 64;
template <typename T, bool kBackward>
void BM_RopePaired(benchmark::State& state) {
  const size_t width = size_t(kRopeNH + 2 * kRopeNKV) * kRopeHS;
  Buf<T> qkv = buffer<T>(size_t(kRopeB) * kRopeT * width, 0.5f);
  Buf<float> inv_freq = buffer(kRopeHS / 2, 0), cos = buffer(size_t(kRopeT) * kRopeHS / 2, 0),
             sin = buffer(cos.size(), 0);
  rope_inv_freq(inv_freq.data(), kRopeHS, 500000.0f, RopeScaling{});
  rope_table(cos.data(), sin.data(), inv_freq.data(), kRopeHS, 0, kRopeT);
  const double moved = double(kRopeB) * kRopeT * (kRopeNH + kRopeNKV) * kRopeHS * 2 * sizeof(T);
  timed<true>(state, moved, [&] {
    if constexpr (kBackward) {
      rope_backward(qkv.data(), cos.data(), sin.data(), kRopeB, kRopeT, kRopeNH, kRopeNKV, kRopeHS);
    } else {
      rope_forward(qkv.data(), cos.data(), sin.data(), kRopeB, kRopeT, kRopeNH, kRopeNKV, kRopeHS);
    }
  });
}

#define HR_BENCH(...) BENCHMARK(__VA_ARGS__)->Unit(benchmark::kMillisecond)->UseRealTime()
HR_BENCH(BM_Triad);
HR_BENCH(BM_LayerNormForward<float, true>)
    ->Name("BM_LayerNormForwardBefore<float>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormForward<float, false>)
    ->Name("BM_LayerNormForward<float>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormForward<bf16_t, true>)
    ->Name("BM_LayerNormForwardBefore<bf16_t>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormForward<bf16_t, false>)
    ->Name("BM_LayerNormForward<bf16_t>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormForward<f16_t, true>)
    ->Name("BM_LayerNormForwardBefore<f16_t>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormForward<f16_t, false>)
    ->Name("BM_LayerNormForward<f16_t>")
    ->Arg(kRows)
    ->Arg(256);
HR_BENCH(BM_LayerNormBackward<float, true>)->Name("BM_LayerNormBackwardBefore<float>");
HR_BENCH(BM_LayerNormBackward<float, false>)->Name("BM_LayerNormBackward<float>");
HR_BENCH(BM_LayerNormBackward<bf16_t, true>)->Name("BM_LayerNormBackwardBefore<bf16_t>");
HR_BENCH(BM_LayerNormBackward<bf16_t, false>)->Name("BM_LayerNormBackward<bf16_t>");
HR_BENCH(BM_LayerNormBackward<f16_t, true>)->Name("BM_LayerNormBackwardBefore<f16_t>");
HR_BENCH(BM_LayerNormBackward<f16_t, false>)->Name("BM_LayerNormBackward<f16_t>");
HR_BENCH(BM_GeluForward<float, true>)
    ->Name("BM_GeluForwardBefore<float>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluForward<float, false>)->Name("BM_GeluForward<float>")->Arg(kElems)->Arg(256 << 10);
HR_BENCH(BM_GeluForward<bf16_t, true>)
    ->Name("BM_GeluForwardBefore<bf16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluForward<bf16_t, false>)
    ->Name("BM_GeluForward<bf16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluForward<f16_t, true>)
    ->Name("BM_GeluForwardBefore<f16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluForward<f16_t, false>)->Name("BM_GeluForward<f16_t>")->Arg(kElems)->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<float, true>)
    ->Name("BM_GeluBackwardBefore<float>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<float, false>)
    ->Name("BM_GeluBackward<float>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<bf16_t, true>)
    ->Name("BM_GeluBackwardBefore<bf16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<bf16_t, false>)
    ->Name("BM_GeluBackward<bf16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<f16_t, true>)
    ->Name("BM_GeluBackwardBefore<f16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_GeluBackward<f16_t, false>)
    ->Name("BM_GeluBackward<f16_t>")
    ->Arg(kElems)
    ->Arg(256 << 10);
HR_BENCH(BM_Residual<>)->Name("BM_Residual");
HR_BENCH(BM_ResidualBackward<>)->Name("BM_ResidualBackward");
HR_BENCH(BM_CastToBf16<true>)->Name("BM_CastToBf16Before");
HR_BENCH(BM_CastToBf16<false>)->Name("BM_CastToBf16");
HR_BENCH(BM_CastToF16<>)->Name("BM_CastToF16");
HR_BENCH(BM_RoundToF16Values<true>)->Name("BM_RoundToF16ValuesBefore");
HR_BENCH(BM_RoundToF16Values<false>)->Name("BM_RoundToF16Values");
HR_BENCH(BM_AdamW<>)->Name("BM_AdamW");
HR_BENCH(BM_AdamWWithBf16Copy<>)->Name("BM_AdamWWithBf16Copy");
HR_BENCH(BM_AdamWAndZeroWithBf16Copy<>)->Name("BM_AdamWAndZeroWithBf16Copy");
HR_BENCH(BM_SumSquares<>)->Name("BM_SumSquares");
HR_BENCH(BM_CrossEntropyForward<true>)->Name("BM_CrossEntropyForwardBefore");
HR_BENCH(BM_CrossEntropyForward<false>)->Name("BM_CrossEntropyForward");
HR_BENCH(BM_CrossEntropyBackwardBefore);
HR_BENCH(BM_CrossEntropyBackward);
HR_BENCH(BM_CrossEntropyBackwardBf16Before);
HR_BENCH(BM_CrossEntropyBackwardBf16);
HR_BENCH(BM_CrossEntropyBackwardF16);
HR_BENCH(BM_CrossEntropyStepTwoPass);
HR_BENCH(BM_CrossEntropyStep);
HR_BENCH(BM_CrossEntropyStepBf16TwoPass);
HR_BENCH(BM_CrossEntropyStepBf16);
HR_BENCH(BM_CrossEntropyStepPadded);
HR_BENCH(BM_CrossEntropyStepBf16Padded);
// Paired with the triad, iteration by iteration (manual time: the kernel's alone).
#define HR_PAIRED(...) BENCHMARK(__VA_ARGS__)->Unit(benchmark::kMillisecond)->UseManualTime()
HR_PAIRED(BM_CrossEntropyStepPaddedPaired);
HR_PAIRED(BM_CrossEntropyStepBf16Paired);
HR_PAIRED(BM_CrossEntropyStepBf16PaddedPaired);
HR_PAIRED(BM_LayerNormForward<float, false, true>)
    ->Name("BM_LayerNormForwardPaired<float>")
    ->Arg(kRows);
HR_PAIRED(BM_LayerNormForward<bf16_t, false, true>)
    ->Name("BM_LayerNormForwardPaired<bf16_t>")
    ->Arg(kRows);
HR_PAIRED(BM_LayerNormForward<f16_t, false, true>)
    ->Name("BM_LayerNormForwardPaired<f16_t>")
    ->Arg(kRows);
HR_PAIRED(BM_LayerNormBackward<float, false, true>)->Name("BM_LayerNormBackwardPaired<float>");
HR_PAIRED(BM_LayerNormBackward<bf16_t, false, true>)->Name("BM_LayerNormBackwardPaired<bf16_t>");
HR_PAIRED(BM_LayerNormBackward<f16_t, false, true>)->Name("BM_LayerNormBackwardPaired<f16_t>");
HR_PAIRED(BM_GeluForward<float, false, true>)->Name("BM_GeluForwardPaired<float>")->Arg(kElems);
HR_PAIRED(BM_GeluForward<bf16_t, false, true>)->Name("BM_GeluForwardPaired<bf16_t>")->Arg(kElems);
HR_PAIRED(BM_GeluForward<f16_t, false, true>)->Name("BM_GeluForwardPaired<f16_t>")->Arg(kElems);
HR_PAIRED(BM_GeluBackward<float, false, true>)->Name("BM_GeluBackwardPaired<float>")->Arg(kElems);
HR_PAIRED(BM_GeluBackward<bf16_t, false, true>)->Name("BM_GeluBackwardPaired<bf16_t>")->Arg(kElems);
HR_PAIRED(BM_GeluBackward<f16_t, false, true>)->Name("BM_GeluBackwardPaired<f16_t>")->Arg(kElems);
HR_PAIRED(BM_GeluBackwardInPlacePaired<bf16_t>)
    ->Name("BM_GeluBackwardInPlacePaired<bf16_t>")
    ->Arg(kElems);
HR_PAIRED(BM_GeluBackwardInPlacePaired<f16_t>)
    ->Name("BM_GeluBackwardInPlacePaired<f16_t>")
    ->Arg(kElems);
HR_PAIRED(BM_Residual<true>)->Name("BM_ResidualPaired");
HR_PAIRED(BM_ResidualBackward<true>)->Name("BM_ResidualBackwardPaired");
HR_PAIRED(BM_CastToBf16<false, true>)->Name("BM_CastToBf16Paired");
HR_PAIRED(BM_CastToF16<true>)->Name("BM_CastToF16Paired");
HR_PAIRED(BM_RoundToF16Values<false, true>)->Name("BM_RoundToF16ValuesPaired");
HR_PAIRED(BM_AdamW<true>)->Name("BM_AdamWPaired");
HR_PAIRED(BM_AdamWWithBf16Copy<true>)->Name("BM_AdamWWithBf16CopyPaired");
HR_PAIRED(BM_AdamWAndZeroWithBf16Copy<true>)->Name("BM_AdamWAndZeroWithBf16CopyPaired");
HR_PAIRED(BM_SumSquares<true>)->Name("BM_SumSquaresPaired");
HR_PAIRED(BM_RmsNormForwardPaired<float>)->Name("BM_RmsNormForwardPaired<float>");
HR_PAIRED(BM_RmsNormForwardPaired<bf16_t>)->Name("BM_RmsNormForwardPaired<bf16_t>");
HR_PAIRED(BM_RmsNormBackwardPaired<float>)->Name("BM_RmsNormBackwardPaired<float>");
HR_PAIRED(BM_RmsNormBackwardPaired<bf16_t>)->Name("BM_RmsNormBackwardPaired<bf16_t>");
HR_PAIRED(BM_SwiGluForwardPaired<float>)->Name("BM_SwiGluForwardPaired<float>");
HR_PAIRED(BM_SwiGluForwardPaired<bf16_t>)->Name("BM_SwiGluForwardPaired<bf16_t>");
HR_PAIRED(BM_SwiGluBackwardInPlacePaired<float>)->Name("BM_SwiGluBackwardInPlacePaired<float>");
HR_PAIRED(BM_SwiGluBackwardInPlacePaired<bf16_t>)->Name("BM_SwiGluBackwardInPlacePaired<bf16_t>");
HR_PAIRED(BM_RopePaired<float, false>)->Name("BM_RopeForwardPaired<float>");
HR_PAIRED(BM_RopePaired<bf16_t, false>)->Name("BM_RopeForwardPaired<bf16_t>");
HR_PAIRED(BM_RopePaired<float, true>)->Name("BM_RopeBackwardPaired<float>");
HR_PAIRED(BM_RopePaired<bf16_t, true>)->Name("BM_RopeBackwardPaired<bf16_t>");

}  // namespace
}  // namespace headroom::cpu

BENCHMARK_MAIN();
