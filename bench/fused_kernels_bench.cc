// The memory-saving kernels of fused_kernels.h side by side with the plain path they replace,
// alternated inside each iteration so that load from other processes hits both alike: tiled vs
// plain attention (GPT-2 124M shapes), and the chunked LM head + cross-entropy vs matmul +
// cross_entropy over the full N x V logits. Results and the command: docs/notes/fused-kernels.md.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"

namespace {

using namespace headroom;  // NOLINT: bf16_t, DType
using namespace headroom::cpu;
using Clock = std::chrono::steady_clock;

std::vector<float> rand_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

template <typename F>
double seconds(F f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double{a[i]} - b[i]));
  return m;
}

// ---- attention: tiled vs plain ----------------------------------------------------------------
// Args: B, T, C, NH. Each iteration runs the plain and the tiled kernel, forward and backward.
// FLOPs counted for both alike: the causal pairs t >= s, 4*HS per pair forward (q.k and p*v) and
// 8*HS backward (the tiled backward's recomputed scores are not counted: they are its price).
void BM_Attention(benchmark::State& state) {
  const int B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  const int HS = C / NH;
  const size_t nqkv = size_t{3} * B * T * C, nout = size_t{1} * B * T * C;
  const std::vector<float> qkv = rand_vec(nqkv, 1), dout = rand_vec(nout, 2, -0.01f, 0.01f);
  std::vector<float> out_p(nout), out_t(nout), dqkv_p(nqkv), dqkv_t(nqkv);
  std::vector<float> att(size_t{1} * B * NH * T * T), lse(size_t{1} * B * NH * T);
  std::vector<float> bscratch_p(attention_backward_scratch_floats(B, T, NH));
  std::vector<float> fscratch_t(attention_tiled_scratch_floats(B, T, C, NH));
  std::vector<float> bscratch_t(attention_tiled_backward_scratch_floats(B, T, C, NH));

  double fp = 0, ft = 0, bp = 0, bt = 0;
  for (auto _ : state) {
    fp += seconds([&] { attention_forward(out_p.data(), att.data(), qkv.data(), B, T, C, NH); });
    ft += seconds([&] {
      attention_tiled_forward(out_t.data(), lse.data(), qkv.data(), B, T, C, NH, fscratch_t.data());
    });
    bp += seconds([&] {
      attention_backward(dqkv_p.data(), bscratch_p.data(), dout.data(), qkv.data(), att.data(), B,
                         T, C, NH);
    });
    bt += seconds([&] {
      attention_tiled_backward(dqkv_t.data(), dout.data(), qkv.data(), out_t.data(), lse.data(), B,
                               T, C, NH, bscratch_t.data());
    });
    benchmark::ClobberMemory();
  }
  // A wrong kernel fails the benchmark instead of being timed (tests/backend states the
  // tolerances; these are looser only for the larger shapes).
  const double eo = max_abs_diff(out_p, out_t), ed = max_abs_diff(dqkv_p, dqkv_t);
  if (!(eo < 1e-5 && ed < 1e-5)) {
    state.SkipWithError(
        ("tiled != plain: out " + std::to_string(eo) + ", dqkv " + std::to_string(ed)).c_str());
    return;
  }
  const double n = static_cast<double>(state.iterations());
  const double pairs = double{1} * B * NH * T * (T + 1) / 2;
  state.counters["plain_fwd_ms"] = 1e3 * fp / n;
  state.counters["tiled_fwd_ms"] = 1e3 * ft / n;
  state.counters["plain_bwd_ms"] = 1e3 * bp / n;
  state.counters["tiled_bwd_ms"] = 1e3 * bt / n;
  state.counters["fwd_tiled/plain"] = ft / fp;
  state.counters["bwd_tiled/plain"] = bt / bp;
  state.counters["step_tiled/plain"] = (ft + bt) / (fp + bp);
  state.counters["tiled_fwd_GFLOP/s"] = pairs * 4 * HS * n / ft * 1e-9;
  state.counters["tiled_bwd_GFLOP/s"] = pairs * 8 * HS * n / bt * 1e-9;
  // What each keeps from the forward for the backward, and the tiled kernels' scratch.
  state.counters["plain_saved_MiB"] = att.size() * 4.0 / (1 << 20);
  state.counters["tiled_saved_MiB"] = lse.size() * 4.0 / (1 << 20);
  state.counters["tiled_scratch_MiB"] =
      std::max(fscratch_t.size(), bscratch_t.size()) * 4.0 / (1 << 20);
}

// ---- attention with bf16 storage: bf16 tile products vs the fp32 fallback -------------------
// Args: B, T, C, NH. Each iteration runs, forward and backward, the fp32 tiled kernel on fp32
// data, the bf16 fallback (bf16 rows widened to fp32, the fp32 kernel: the bf16 path before the
// bf16 tile products) and the kernel kAuto picks on this CPU (AMX-BF16, else AVX512-BF16), all
// on the same values. FLOPs as BM_Attention.
void BM_AttentionBf16(benchmark::State& state) {
  const int B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  const int HS = C / NH;
  const size_t nqkv = size_t{3} * B * T * C, nout = size_t{1} * B * T * C;
  std::vector<float> qkv = rand_vec(nqkv, 1), dout = rand_vec(nout, 2, -0.01f, 0.01f);
  std::vector<bf16_t> qkvb(nqkv), doutb(nout);
  for (size_t i = 0; i < nqkv; ++i) qkv[i] = to_f32(qkvb[i] = from_f32<bf16_t>(qkv[i]));
  for (size_t i = 0; i < nout; ++i) dout[i] = to_f32(doutb[i] = from_f32<bf16_t>(dout[i]));
  std::vector<float> out(nout), dqkv(nqkv), lse(size_t{1} * B * NH * T), lse_w(lse.size()),
      lse_n(lse.size());
  std::vector<bf16_t> out_w(nout), dqkv_w(nqkv), out_n(nout), dqkv_n(nqkv);
  std::vector<float> fs(attention_tiled_scratch_floats(B, T, C, NH));
  std::vector<float> bs(attention_tiled_backward_scratch_floats(B, T, C, NH));
  set_attention_bf16_kernel(AttentionBf16Kernel::kWidenFp32);
  std::vector<float> fs_w(attention_tiled_scratch_floats(B, T, C, NH, DType::kBF16));
  std::vector<float> bs_w(attention_tiled_backward_scratch_floats(B, T, C, NH, DType::kBF16));
  set_attention_bf16_kernel(AttentionBf16Kernel::kAuto);
  const AttentionBf16Kernel kernel = attention_bf16_kernel();
  std::vector<float> fs_n(attention_tiled_scratch_floats(B, T, C, NH, DType::kBF16));
  std::vector<float> bs_n(attention_tiled_backward_scratch_floats(B, T, C, NH, DType::kBF16));

  double f32f = 0, f32b = 0, wf = 0, wb = 0, nf = 0, nb = 0;
  for (auto _ : state) {
    f32f += seconds([&] {
      attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, fs.data());
    });
    f32b += seconds([&] {
      attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T,
                               C, NH, bs.data());
    });
    set_attention_bf16_kernel(AttentionBf16Kernel::kWidenFp32);
    wf += seconds([&] {
      attention_tiled_forward(out_w.data(), lse_w.data(), qkvb.data(), B, T, C, NH, fs_w.data());
    });
    wb += seconds([&] {
      attention_tiled_backward(dqkv_w.data(), doutb.data(), qkvb.data(), out_w.data(), lse_w.data(),
                               B, T, C, NH, bs_w.data());
    });
    set_attention_bf16_kernel(AttentionBf16Kernel::kAuto);
    nf += seconds([&] {
      attention_tiled_forward(out_n.data(), lse_n.data(), qkvb.data(), B, T, C, NH, fs_n.data());
    });
    nb += seconds([&] {
      attention_tiled_backward(dqkv_n.data(), doutb.data(), qkvb.data(), out_n.data(), lse_n.data(),
                               B, T, C, NH, bs_n.data());
    });
    benchmark::ClobberMemory();
  }
  // A wrong kernel fails the benchmark (tolerances: tests/backend/fused_kernels_test.cc).
  double eo = 0, ed = 0;
  for (size_t i = 0; i < nout; ++i) eo = std::max(eo, std::abs(double{to_f32(out_n[i])} - out[i]));
  for (size_t i = 0; i < nqkv; ++i) {
    ed = std::max(ed, std::abs(double{to_f32(dqkv_n[i])} - dqkv[i]));
  }
  if (!(eo < 1.0 / 128 && ed < 1.0 / 32)) {
    state.SkipWithError(
        ("bf16 != fp32: out " + std::to_string(eo) + ", dqkv " + std::to_string(ed)).c_str());
    return;
  }
  const double n = static_cast<double>(state.iterations());
  const double pairs = double{1} * B * NH * T * (T + 1) / 2;
  state.SetLabel(kernel == AttentionBf16Kernel::kAmx          ? "amx"
                 : kernel == AttentionBf16Kernel::kAvx512Bf16 ? "avx512bf16"
                                                              : "fallback only");
  state.counters["fp32_ms"] = 1e3 * (f32f + f32b) / n;
  state.counters["bf16_old_ms"] = 1e3 * (wf + wb) / n;
  state.counters["bf16_new_fwd_ms"] = 1e3 * nf / n;
  state.counters["bf16_new_bwd_ms"] = 1e3 * nb / n;
  state.counters["bf16_new_ms"] = 1e3 * (nf + nb) / n;
  state.counters["new/old"] = (nf + nb) / (wf + wb);
  state.counters["new/fp32"] = (nf + nb) / (f32f + f32b);
  state.counters["new_GFLOP/s"] = pairs * 12 * HS * n / (nf + nb) * 1e-9;
}

// ---- grouped-query attention: NKV kv heads vs multi-head on expanded K/V -----------------------
// Args: B, T, C, NH, NKV. Each iteration runs the tiled kernels forward and backward on a GQA qkv
// [B, T, (NH + 2 NKV) HS] and the multi-head kernels on the same K/V expanded to every query head
// ([B, T, 3C]: the same FLOPs, what a model without GQA kernels would run), in fp32 and in bf16
// (the kernel kAuto picks). gqa/mha: the time ratio (the backward's tasks are (b, kv head) pairs,
// B NKV of them). FLOPs as BM_Attention.
void BM_AttentionGqa(benchmark::State& state) {
  const int B = state.range(0), T = state.range(1), C = state.range(2), NH = state.range(3);
  const int NKV = state.range(4), HS = C / NH, G = NH / NKV;
  const int64_t W = int64_t{NH + 2 * NKV} * HS;
  const size_t ng = size_t(B) * T * W, n3 = size_t{3} * B * T * C, nout = size_t{1} * B * T * C;
  std::vector<float> qkv = rand_vec(ng, 1), dout = rand_vec(nout, 2, -0.01f, 0.01f);
  for (float& x : qkv) x = to_f32(from_f32<bf16_t>(x));  // bf16 values: the same inputs in both
  std::vector<float> qkv3(n3);
  for (size_t r = 0; r < size_t(B) * T; ++r) {
    for (int h = 0; h < NH; ++h) {
      for (int d = 0; d < HS; ++d) {
        qkv3[r * 3 * C + h * HS + d] = qkv[r * W + h * HS + d];
        qkv3[r * 3 * C + C + h * HS + d] = qkv[r * W + (NH + h / G) * HS + d];
        qkv3[r * 3 * C + 2 * C + h * HS + d] = qkv[r * W + (NH + NKV + h / G) * HS + d];
      }
    }
  }
  std::vector<bf16_t> qkvb(ng), qkv3b(n3), doutb(nout);
  for (size_t i = 0; i < ng; ++i) qkvb[i] = from_f32<bf16_t>(qkv[i]);
  for (size_t i = 0; i < n3; ++i) qkv3b[i] = from_f32<bf16_t>(qkv3[i]);
  for (size_t i = 0; i < nout; ++i) doutb[i] = from_f32<bf16_t>(dout[i]);
  std::vector<float> out(nout), out3(nout), dqkv(ng), dqkv3(n3), lse(size_t{1} * B * NH * T),
      lse3(lse.size());
  std::vector<bf16_t> outb(nout), out3b(nout), dqkvb(ng), dqkv3b(n3);
  // One scratch for the four runs: the largest of their sizes.
  const size_t fsz = std::max({attention_tiled_scratch_floats(B, T, C, NH, NKV, DType::kBF16),
                               attention_tiled_scratch_floats(B, T, C, NH, NKV),
                               attention_tiled_scratch_floats(B, T, C, NH, DType::kBF16),
                               attention_tiled_scratch_floats(B, T, C, NH)});
  const size_t bsz =
      std::max({attention_tiled_backward_scratch_floats(B, T, C, NH, NKV, DType::kBF16),
                attention_tiled_backward_scratch_floats(B, T, C, NH, NKV),
                attention_tiled_backward_scratch_floats(B, T, C, NH, DType::kBF16),
                attention_tiled_backward_scratch_floats(B, T, C, NH)});
  std::vector<float> fs(fsz), bs(bsz);
  double gf = 0, gb = 0, mf = 0, mb = 0, gfb = 0, gbb = 0, mfb = 0, mbb = 0;
  for (auto _ : state) {
    gf += seconds([&] {
      attention_tiled_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV, fs.data());
    });
    gb += seconds([&] {
      attention_tiled_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T,
                               C, NH, NKV, bs.data());
    });
    mf += seconds([&] {
      attention_tiled_forward(out3.data(), lse3.data(), qkv3.data(), B, T, C, NH, fs.data());
    });
    mb += seconds([&] {
      attention_tiled_backward(dqkv3.data(), dout.data(), qkv3.data(), out3.data(), lse3.data(), B,
                               T, C, NH, bs.data());
    });
    gfb += seconds([&] {
      attention_tiled_forward(outb.data(), lse.data(), qkvb.data(), B, T, C, NH, NKV, fs.data());
    });
    gbb += seconds([&] {
      attention_tiled_backward(dqkvb.data(), doutb.data(), qkvb.data(), outb.data(), lse.data(), B,
                               T, C, NH, NKV, bs.data());
    });
    mfb += seconds([&] {
      attention_tiled_forward(out3b.data(), lse3.data(), qkv3b.data(), B, T, C, NH, fs.data());
    });
    mbb += seconds([&] {
      attention_tiled_backward(dqkv3b.data(), doutb.data(), qkv3b.data(), out3b.data(), lse3.data(),
                               B, T, C, NH, bs.data());
    });
    benchmark::ClobberMemory();
  }
  // A wrong kernel fails the benchmark: each query head's output is the multi-head kernel's on
  // its kv head, bit for bit (tests/backend/gqa_attention_test.cc).
  bool same = out == out3;
  for (size_t i = 0; i < nout; ++i) same = same && outb[i].bits == out3b[i].bits;
  if (!same) {
    state.SkipWithError("GQA out != multi-head out on expanded K/V");
    return;
  }
  const double n = static_cast<double>(state.iterations());
  const double pairs = double{1} * B * NH * T * (T + 1) / 2;
  state.SetLabel(attention_bf16_kernel() == AttentionBf16Kernel::kAmx          ? "amx"
                 : attention_bf16_kernel() == AttentionBf16Kernel::kAvx512Bf16 ? "avx512bf16"
                                                                               : "fallback only");
  state.counters["fp32_fwd_ms"] = 1e3 * gf / n;
  state.counters["fp32_bwd_ms"] = 1e3 * gb / n;
  state.counters["bf16_fwd_ms"] = 1e3 * gfb / n;
  state.counters["bf16_bwd_ms"] = 1e3 * gbb / n;
  state.counters["fp32_gqa/mha"] = (gf + gb) / (mf + mb);
  state.counters["bf16_gqa/mha"] = (gfb + gbb) / (mfb + mbb);
  state.counters["fp32_GFLOP/s"] = pairs * 12 * HS * n / (gf + gb) * 1e-9;
  state.counters["bf16_GFLOP/s"] = pairs * 12 * HS * n / (gfb + gbb) * 1e-9;
  state.counters["kv_MiB_saved"] = double(n3 - ng) * 4.0 / (1 << 20);  // fp32 qkv
}

// ---- LM head + cross-entropy: chunked vs unfused ---------------------------------------------
// Args: N, C, V, chunk. Each iteration runs forward + backward three ways: unfused (full N x V
// logits, matmul + cross_entropy), fused (forward, then backward with the recompute) and fused
// one-pass (lm_head_ce_forward_backward). GFLOP/s count the unfused path's three GEMMs
// (6*N*C*V) for all three, so they compare as inverse times.
void BM_LmHead(benchmark::State& state) {
  const int N = state.range(0), C = state.range(1), V = state.range(2), chunk = state.range(3);
  const std::vector<float> x = rand_vec(size_t{1} * N * C, 3), wte = rand_vec(size_t{1} * V * C, 4);
  std::vector<int32_t> targets(N);
  for (int n = 0; n < N; ++n) targets[n] = n % 64 == 63 ? -1 : (n * 7919) % V;
  const float dloss = 1.0f / N;
  std::vector<float> logits(size_t{1} * N * V, 0.0f);
  std::vector<float> scratch(lm_head_ce_scratch_floats(chunk, V), 0.0f);
  std::vector<float> loss_u(N), loss_f(N), loss_o(N), lse(N);
  std::vector<float> dx_u(x.size()), dx_f(x.size()), dx_o(x.size());
  std::vector<float> dwte_u(wte.size(), 0.0f), dwte_f(wte.size(), 0.0f), dwte_o(wte.size(), 0.0f);

  double tu = 0, tf = 0, to = 0;
  for (auto _ : state) {
    tu += seconds([&] {
      matmul_forward(logits.data(), x.data(), wte.data(), nullptr, N, C, V, WeightLayout::kOutIn);
      cross_entropy_forward(loss_u.data(), logits.data(), targets.data(), N, V);
      cross_entropy_backward(logits.data(), logits.data(), targets.data(), N, V, dloss);
      matmul_backward(dx_u.data(), dwte_u.data(), nullptr, logits.data(), x.data(), wte.data(), N,
                      C, V, WeightLayout::kOutIn);
    });
    tf += seconds([&] {
      lm_head_ce_forward(loss_f.data(), lse.data(), x.data(), wte.data(), targets.data(), N, C, V,
                         chunk, scratch.data());
      lm_head_ce_backward(dx_f.data(), dwte_f.data(), x.data(), wte.data(), targets.data(),
                          lse.data(), N, C, V, chunk, dloss, scratch.data());
    });
    to += seconds([&] {
      lm_head_ce_forward_backward(loss_o.data(), dx_o.data(), dwte_o.data(), x.data(), wte.data(),
                                  targets.data(), N, C, V, chunk, dloss, scratch.data());
    });
    benchmark::ClobberMemory();
  }
  const double el = std::max(max_abs_diff(loss_u, loss_f), max_abs_diff(loss_u, loss_o));
  const double ex = std::max(max_abs_diff(dx_u, dx_f), max_abs_diff(dx_u, dx_o));
  const double ew = std::max(max_abs_diff(dwte_u, dwte_f), max_abs_diff(dwte_u, dwte_o));
  if (!(el < 1e-4 && ex < 1e-6 && ew < 1e-5)) {
    state.SkipWithError(("fused != unfused: losses " + std::to_string(el) + ", dx " +
                         std::to_string(ex) + ", dwte " + std::to_string(ew))
                            .c_str());
    return;
  }
  const double n = static_cast<double>(state.iterations());
  const double flops = 6.0 * N * C * V * n;
  state.counters["unfused_s"] = tu / n;
  state.counters["fused_s"] = tf / n;
  state.counters["onepass_s"] = to / n;
  state.counters["fused/unfused"] = tf / tu;
  state.counters["onepass/unfused"] = to / tu;
  state.counters["unfused_GFLOP/s"] = flops / tu * 1e-9;
  state.counters["fused_GFLOP/s"] = flops / tf * 1e-9;
  state.counters["onepass_GFLOP/s"] = flops / to * 1e-9;
  // Logits memory: the unfused path's N x V logits (reused for dlogits) vs the chunk scratch.
  state.counters["unfused_logits_MiB"] = logits.size() * 4.0 / (1 << 20);
  state.counters["fused_scratch_MiB"] = scratch.size() * 4.0 / (1 << 20);
}

}  // namespace

BENCHMARK(BM_Attention)
    ->Name("attention/tiled_vs_plain")
    ->ArgNames({"B", "T", "C", "NH"})
    ->Args({8, 256, 768, 12})
    ->Args({2, 1024, 768, 12})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_AttentionBf16)
    ->Name("attention/bf16_tiles_vs_widened")
    ->ArgNames({"B", "T", "C", "NH"})
    ->Args({8, 256, 768, 12})
    ->Args({2, 1024, 768, 12})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_AttentionGqa)
    ->Name("attention/gqa_vs_expanded_mha")
    ->ArgNames({"B", "T", "C", "NH", "NKV"})
    ->Args({1, 512, 512, 8, 8})
    ->Args({1, 512, 512, 8, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK(BM_LmHead)
    ->Name("lm_head_ce/fused_vs_unfused")
    ->ArgNames({"N", "C", "V", "chunk"})
    ->Args({2048, 768, 50257, 128})
    ->Args({2048, 768, 50257, 256})
    ->Args({2048, 768, 50257, 512})
    ->Args({2048, 768, 50257, 1024})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("omp_max_threads", std::to_string(omp_get_max_threads()));
  benchmark::AddCustomContext("attention_block", std::to_string(kAttentionBlock));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
