// The CUDA elementwise family (embedding, norms, GELU, SwiGLU, RoPE, residual, cross-entropy,
// casts, optimizer) against the CPU op table on the same inputs: every storage type, odd shapes,
// strided rows, misaligned pointers (the scalar fallbacks), in-place forms, and parameter
// gradients accumulated from non-zero values. Tolerances are the CPU kernel tests': fp32 results
// whose sums run in another order within 1e-5 relative; 16-bit outputs within one rounding of
// the storage type (a value near a rounding boundary may round the other way).
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_test_util.h"

namespace headroom {
namespace {

using cudatest::DeviceBuffer;
using VecF = std::vector<float>;

const backend::Ops& cpu() { return backend::cpu_ops(); }

VecF rand_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  VecF v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}
std::vector<int32_t> rand_tokens(size_t n, int V, uint32_t seed, bool ignore = false) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(ignore ? -1 : 0, V - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

// Storage conversions on the host (round to nearest even, as both backends store).
template <typename T>
T store(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return bf16_t{f32_to_bf16_bits(x)};
  } else {
    return f16_t{f32_to_f16_bits(x)};
  }
}
inline float load(float x) { return x; }
inline float load(bf16_t x) { return bf16_bits_to_f32(x.bits); }
inline float load(f16_t x) { return f16_bits_to_f32(x.bits); }
template <typename T>
std::vector<T> to_storage(const VecF& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = store<T>(v[i]);
  return out;
}
template <typename T>
VecF to_floats(const std::vector<T>& v) {
  VecF out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = load(v[i]);
  return out;
}

// One rounding of the storage type, relative.
template <typename T>
constexpr double kRound = std::is_same_v<T, float>    ? 0.0
                          : std::is_same_v<T, bf16_t> ? 8e-3
                                                      : 1e-3;
template <typename T>
const char* type_name() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, bf16_t> ? "bf16" : "f16";
}

// |got - want| <= atol + rtol |want| everywhere; the first misses reported.
void expect_close(const VecF& got, const VecF& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int misses = 0;
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - double(want[i]));
    worst = std::max(worst, err);
    if (!(err <= atol + rtol * std::abs(double(want[i])))) {
      if (++misses <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i] << " (err "
                      << err << ")";
      }
    }
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << got.size()
                       << " outside tolerance, worst abs err " << worst;
}
template <typename T>
void expect_close(const std::vector<T>& got, const std::vector<T>& want, double atol, double rtol,
                  const std::string& what) {
  expect_close(to_floats(got), to_floats(want), atol, rtol, what);
}
void expect_same_bits(const VecF& a, const VecF& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

// ---- embedding --------------------------------------------------------------------------------

void check_embedding(const backend::Ops* ops, int B, int T, int C, int V, bool with_wpe) {
  const std::string at = "B=" + std::to_string(B) + " T=" + std::to_string(T) +
                         " C=" + std::to_string(C) + (with_wpe ? " wpe" : " no wpe");
  const size_t BT = size_t(B) * T;
  const auto tokens = rand_tokens(BT, V, 1);
  const VecF wte = rand_vec(size_t(V) * C, 2), wpe = rand_vec(size_t(T) * C, 3);
  VecF out(BT * size_t(C));
  cpu().embedding_forward(out.data(), tokens.data(), wte.data(), with_wpe ? wpe.data() : nullptr, B,
                          T, C);
  DeviceBuffer<int32_t> d_tokens(tokens);
  DeviceBuffer<float> d_wte(wte), d_wpe(wpe), d_out(out.size());
  ops->embedding_forward(d_out.get(), d_tokens.get(), d_wte.get(), with_wpe ? d_wpe.get() : nullptr,
                         B, T, C);
  expect_same_bits(d_out.download(), out, "embedding_forward " + at);  // one add: exact

  // Backward, accumulating into non-zero gradients.
  const VecF dout = rand_vec(out.size(), 4);
  VecF dwte = rand_vec(wte.size(), 5), dwpe = rand_vec(wpe.size(), 6);
  DeviceBuffer<float> d_dout(dout), d_dwte(dwte), d_dwpe(dwpe);
  cpu().embedding_backward(dwte.data(), with_wpe ? dwpe.data() : nullptr, dout.data(),
                           tokens.data(), B, T, C);
  ops->embedding_backward(d_dwte.get(), with_wpe ? d_dwpe.get() : nullptr, d_dout.get(),
                          d_tokens.get(), B, T, C);
  const VecF g_dwte = d_dwte.download();
  expect_close(g_dwte, dwte, 1e-4, 1e-5, "embedding dwte " + at);
  expect_close(d_dwpe.download(), dwpe, 1e-5, 1e-5, "embedding dwpe " + at);
  // Deterministic: the same call from the same start gives the same bits.
  d_dwte.upload(rand_vec(wte.size(), 5));
  ops->embedding_backward(d_dwte.get(), nullptr, d_dout.get(), d_tokens.get(), B, T, C);
  expect_same_bits(d_dwte.download(), g_dwte, "embedding dwte twice " + at);
}

TEST(CudaElementwise, Embedding) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_embedding(ops, 2, 5, 7, 11, true);      // odd: the scalar path, many repeats
  check_embedding(ops, 3, 64, 768, 100, true);  // packs of 4, tokens repeated ~6 times
  check_embedding(ops, 2, 33, 256, 5000, false);
  check_embedding(ops, 1, 300, 64, 3, true);  // runs of ~100 rows per token
}

// ---- LayerNorm / RMSNorm ------------------------------------------------------------------

template <typename T>
void check_layernorm(const backend::Ops* ops, int N, int C) {
  const std::string at =
      std::string(type_name<T>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C);
  const size_t NC = size_t(N) * C;
  VecF inp = rand_vec(NC, 10, -2.0f, 2.0f);
  for (size_t i = 0; i < NC; ++i) inp[i] += (i / size_t(C)) % 2 ? 3.0f : 0.0f;  // means off 0
  const VecF w = rand_vec(C, 11, 0.5f, 1.5f), b = rand_vec(C, 12);
  std::vector<T> out(NC);
  VecF mean(N), rstd(N);
  cpu().layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N,
                          C);
  DeviceBuffer<float> d_inp(inp), d_w(w), d_b(b), d_mean(N), d_rstd(N);
  DeviceBuffer<T> d_out(NC);
  ops->layernorm_forward(d_out.get(), d_mean.get(), d_rstd.get(), d_inp.get(), d_w.get(), d_b.get(),
                         N, C);
  expect_close(d_out.download(), out, 1e-5, std::max(1e-5, kRound<T>), "layernorm out " + at);
  expect_close(d_mean.download(), mean, 1e-6, 1e-5, "layernorm mean " + at);
  expect_close(d_rstd.download(), rstd, 1e-6, 1e-5, "layernorm rstd " + at);

  // Backward from the CPU's statistics (the same inputs), dinp and the parameter gradients
  // accumulating from non-zero values.
  const std::vector<T> dout = to_storage<T>(rand_vec(NC, 13));
  DeviceBuffer<T> d_dout(dout);
  d_mean.upload(mean);
  d_rstd.upload(rstd);
  VecF dinp = rand_vec(NC, 14), dw = rand_vec(C, 15), db = rand_vec(C, 16);
  DeviceBuffer<float> d_dinp(dinp), d_dw(dw), d_db(db);
  cpu().layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                           mean.data(), rstd.data(), N, C);
  ops->layernorm_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(),
                          d_w.get(), d_mean.get(), d_rstd.get(), N, C);
  expect_close(d_dinp.download(), dinp, 1e-5, 1e-4, "layernorm dinp " + at);
  const VecF g_dw = d_dw.download();
  expect_close(g_dw, dw, 1e-4, 1e-4, "layernorm dweight " + at);
  expect_close(d_db.download(), db, 1e-4, 1e-4, "layernorm dbias " + at);
  // Deterministic, and the parameter gradients alone (dinp null) add the same sums.
  d_dw.upload(rand_vec(C, 15));
  ops->layernorm_backward(static_cast<float*>(nullptr), d_dw.get(), static_cast<float*>(nullptr),
                          d_dout.get(), d_inp.get(), d_w.get(), d_mean.get(), d_rstd.get(), N, C);
  expect_same_bits(d_dw.download(), g_dw, "layernorm dweight alone, same bits " + at);

  if constexpr (!std::is_same_v<T, float>) {
    VecF dinp2 = rand_vec(NC, 14), dw2 = rand_vec(C, 15), db2 = rand_vec(C, 16);
    std::vector<T> lo(NC);
    DeviceBuffer<float> e_dinp(dinp2), e_dw(dw2), e_db(db2);
    DeviceBuffer<T> e_lo(NC);
    cpu().layernorm_backward(dinp2.data(), lo.data(), dw2.data(), db2.data(), dout.data(),
                             inp.data(), w.data(), mean.data(), rstd.data(), N, C);
    ops->layernorm_backward(e_dinp.get(), e_lo.get(), e_dw.get(), e_db.get(), d_dout.get(),
                            d_inp.get(), d_w.get(), d_mean.get(), d_rstd.get(), N, C);
    const VecF g = e_dinp.download();
    expect_close(g, dinp2, 1e-5, 1e-4, "layernorm low dinp " + at);
    expect_close(e_lo.download(), lo, 1e-5, kRound<T>, "layernorm low dinp_low " + at);
    // dinp_low is the rounding of the device's own dinp.
    const VecF g_lo = to_floats(e_lo.download());
    for (size_t i = 0; i < NC; ++i) ASSERT_EQ(g_lo[i], load(store<T>(g[i]))) << at << " " << i;
    expect_close(e_dw.download(), dw2, 1e-4, 1e-4, "layernorm low dweight " + at);
    expect_close(e_db.download(), db2, 1e-4, 1e-4, "layernorm low dbias " + at);
  }
}

template <typename T>
void check_rmsnorm(const backend::Ops* ops, int N, int C) {
  const std::string at =
      std::string(type_name<T>()) + " N=" + std::to_string(N) + " C=" + std::to_string(C);
  const size_t NC = size_t(N) * C;
  const float eps = 1e-6f;
  const VecF inp = rand_vec(NC, 20, -2.0f, 2.0f), w = rand_vec(C, 21, 0.5f, 1.5f);
  std::vector<T> out(NC);
  VecF rstd(N);
  cpu().rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, eps);
  DeviceBuffer<float> d_inp(inp), d_w(w), d_rstd(N);
  DeviceBuffer<T> d_out(NC);
  ops->rmsnorm_forward(d_out.get(), d_rstd.get(), d_inp.get(), d_w.get(), N, C, eps);
  expect_close(d_out.download(), out, 1e-5, std::max(1e-5, kRound<T>), "rmsnorm out " + at);
  expect_close(d_rstd.download(), rstd, 1e-6, 1e-5, "rmsnorm rstd " + at);

  const std::vector<T> dout = to_storage<T>(rand_vec(NC, 22));
  DeviceBuffer<T> d_dout(dout);
  d_rstd.upload(rstd);
  VecF dinp = rand_vec(NC, 23), dw = rand_vec(C, 24);
  DeviceBuffer<float> d_dinp(dinp), d_dw(dw);
  cpu().rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N,
                         C);
  ops->rmsnorm_backward(d_dinp.get(), d_dw.get(), d_dout.get(), d_inp.get(), d_w.get(),
                        d_rstd.get(), N, C);
  expect_close(d_dinp.download(), dinp, 1e-5, 1e-4, "rmsnorm dinp " + at);
  const VecF g_dw = d_dw.download();
  expect_close(g_dw, dw, 1e-4, 1e-4, "rmsnorm dweight " + at);
  d_dw.upload(rand_vec(C, 24));
  ops->rmsnorm_backward(static_cast<float*>(nullptr), d_dw.get(), d_dout.get(), d_inp.get(),
                        d_w.get(), d_rstd.get(), N, C);
  expect_same_bits(d_dw.download(), g_dw, "rmsnorm dweight alone, same bits " + at);

  if constexpr (!std::is_same_v<T, float>) {
    VecF dinp2 = rand_vec(NC, 23), dw2 = rand_vec(C, 24);
    std::vector<T> lo(NC);
    DeviceBuffer<float> e_dinp(dinp2), e_dw(dw2);
    DeviceBuffer<T> e_lo(NC);
    cpu().rmsnorm_backward(dinp2.data(), lo.data(), dw2.data(), dout.data(), inp.data(), w.data(),
                           rstd.data(), N, C);
    ops->rmsnorm_backward(e_dinp.get(), e_lo.get(), e_dw.get(), d_dout.get(), d_inp.get(),
                          d_w.get(), d_rstd.get(), N, C);
    const VecF g = e_dinp.download();
    expect_close(g, dinp2, 1e-5, 1e-4, "rmsnorm low dinp " + at);
    expect_close(e_lo.download(), lo, 1e-5, kRound<T>, "rmsnorm low dinp_low " + at);
    const VecF g_lo = to_floats(e_lo.download());
    for (size_t i = 0; i < NC; ++i) ASSERT_EQ(g_lo[i], load(store<T>(g[i]))) << at << " " << i;
    expect_close(e_dw.download(), dw2, 1e-4, 1e-4, "rmsnorm low dweight " + at);
  }
}

template <typename T>
void check_norms(const backend::Ops* ops) {
  const int shapes[][2] = {{1, 7}, {3, 33}, {17, 768}, {300, 1600}, {2, 8192}, {513, 64}};
  for (const auto& s : shapes) {
    check_layernorm<T>(ops, s[0], s[1]);
    check_rmsnorm<T>(ops, s[0], s[1]);
  }
}

TEST(CudaElementwise, NormsF32) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_norms<float>(ops);
}
TEST(CudaElementwise, NormsBf16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_norms<bf16_t>(ops);
}
TEST(CudaElementwise, NormsF16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_norms<f16_t>(ops);
}

// ---- GELU, SwiGLU -----------------------------------------------------------------------------

// `offset` elements into the buffers: 1 makes every pointer misaligned (the scalar path).
template <typename T>
void check_gelu(const backend::Ops* ops, int64_t n, int64_t offset) {
  const std::string at =
      std::string(type_name<T>()) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
  VecF xf = rand_vec(size_t(n + offset), 30, -6.0f, 6.0f);
  if (n > 4) {
    xf[offset] = -30.0f;  // below the -10 cut
    xf[offset + 1] = 30.0f;
    xf[offset + 2] = 0.0f;
  }
  const std::vector<T> x = to_storage<T>(xf), dy = to_storage<T>(rand_vec(xf.size(), 31));
  std::vector<T> out(x.size(), store<T>(0.0f)), dx(x.size(), store<T>(0.0f));
  cpu().gelu_forward(out.data() + offset, x.data() + offset, n);
  cpu().gelu_backward(dx.data() + offset, x.data() + offset, dy.data() + offset, n);
  DeviceBuffer<T> d_x(x), d_out(to_storage<T>(VecF(x.size(), 0.0f))), d_dy(dy);
  ops->gelu_forward(d_out.get() + offset, d_x.get() + offset, n);
  expect_close(d_out.download(), out, 1e-6, std::max(2e-6, kRound<T>), "gelu out " + at);
  // In place: dinp over dout.
  ops->gelu_backward(d_dy.get() + offset, d_x.get() + offset, d_dy.get() + offset, n);
  std::vector<T> g = d_dy.download();
  for (int64_t i = 0; i < offset; ++i) g[size_t(i)] = dx[size_t(i)];  // untouched prefix
  expect_close(g, dx, 1e-6, std::max(2e-6, kRound<T>), "gelu dinp (in place) " + at);
}

template <typename T>
void check_swiglu(const backend::Ops* ops, int64_t N, int64_t I, int64_t ld_out, int64_t ld_gu) {
  const std::string at = std::string(type_name<T>()) + " N=" + std::to_string(N) +
                         " I=" + std::to_string(I) + " ld_out=" + std::to_string(ld_out) +
                         " ld_gu=" + std::to_string(ld_gu);
  VecF guf = rand_vec(size_t(N * ld_gu), 40, -5.0f, 5.0f);
  guf[0] = -100.0f;  // sigma underflows: silu -0, its gradient 0 (no inf * 0)
  guf[1] = 100.0f;
  const std::vector<T> gu = to_storage<T>(guf);
  const std::vector<T> pad = to_storage<T>(VecF(size_t(N * ld_out), 7.0f));
  std::vector<T> out = pad;
  cpu().swiglu_forward(out.data(), gu.data(), N, I, ld_out, ld_gu);
  DeviceBuffer<T> d_gu(gu), d_out(pad);
  ops->swiglu_forward(d_out.get(), d_gu.get(), N, I, ld_out, ld_gu);
  // Padding columns are compared too: neither backend touches them.
  expect_close(d_out.download(), out, 1e-6, std::max(2e-6, kRound<T>), "swiglu out " + at);

  const std::vector<T> dout = to_storage<T>(rand_vec(size_t(N * ld_out), 41));
  std::vector<T> dgu = gu;  // in place, as the model runs it
  cpu().swiglu_backward(dgu.data(), dgu.data(), dout.data(), N, I, ld_gu, ld_out);
  DeviceBuffer<T> d_dout(dout);
  ops->swiglu_backward(d_gu.get(), d_gu.get(), d_dout.get(), N, I, ld_gu, ld_out);
  expect_close(d_gu.download(), dgu, 1e-6, std::max(2e-6, kRound<T>),
               "swiglu dgu (in place) " + at);
}

template <typename T>
void check_activations(const backend::Ops* ops) {
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(4099), int64_t(65536)}) {
    check_gelu<T>(ops, n, 0);
    check_gelu<T>(ops, n, 1);
  }
  check_swiglu<T>(ops, 4, 64, 64, 128);       // dense, packs
  check_swiglu<T>(ops, 5, 37, 42, 77);        // odd widths and strides: scalar
  check_swiglu<T>(ops, 3, 2048, 2056, 4112);  // strided, packs
  check_swiglu<T>(ops, 70000, 8, 8, 16);      // rows past gridDim.y's 65535
}

TEST(CudaElementwise, ActivationsF32) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_activations<float>(ops);
}
TEST(CudaElementwise, ActivationsBf16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_activations<bf16_t>(ops);
}
TEST(CudaElementwise, ActivationsF16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_activations<f16_t>(ops);
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST(CudaElementwise, RopeTables) {
  HR_CUDA_OPS_OR_SKIP(ops);
  backend::RopeScaling llama3;
  llama3.kind = backend::RopeScaling::Kind::kLlama3;
  llama3.factor = 8;
  llama3.low_freq_factor = 1;
  llama3.high_freq_factor = 4;
  llama3.original_max_position_embeddings = 8192;
  for (const auto& [HS, theta, scaling] :
       {std::tuple{64, 10000.0f, backend::RopeScaling{}}, std::tuple{128, 500000.0f, llama3},
        std::tuple{6, 10000.0f, backend::RopeScaling{}}}) {
    const std::string at = "HS=" + std::to_string(HS);
    VecF f(HS / 2);
    cpu().rope_inv_freq(f.data(), HS, theta, scaling);
    DeviceBuffer<float> d_f(f.size());
    ops->rope_inv_freq(d_f.get(), HS, theta, scaling);
    // Double arithmetic on both sides, rounded once: equal but for a last-bit difference of pow.
    expect_close(d_f.download(), f, 0.0, 2e-7, "rope_inv_freq " + at);
    const int T = 37, pos0 = 1000;
    VecF c(size_t(T) * HS / 2), s(c.size());
    cpu().rope_table(c.data(), s.data(), f.data(), HS, pos0, T);
    d_f.upload(f);
    DeviceBuffer<float> d_c(c.size()), d_s(s.size());
    ops->rope_table(d_c.get(), d_s.get(), d_f.get(), HS, pos0, T);
    expect_close(d_c.download(), c, 1e-7, 1e-7, "rope_table cos " + at);
    expect_close(d_s.download(), s, 1e-7, 1e-7, "rope_table sin " + at);
  }
}

template <typename T>
void check_rope(const backend::Ops* ops, int B, int T_, int NH, int NKV, int HS) {
  const std::string at = std::string(type_name<T>()) + " B=" + std::to_string(B) +
                         " T=" + std::to_string(T_) + " NH=" + std::to_string(NH) +
                         " NKV=" + std::to_string(NKV) + " HS=" + std::to_string(HS);
  VecF inv(HS / 2), c(size_t(T_) * HS / 2), s(c.size());
  cpu().rope_inv_freq(inv.data(), HS, 10000.0f, backend::RopeScaling{});
  cpu().rope_table(c.data(), s.data(), inv.data(), HS, 0, T_);
  const size_t n = size_t(B) * T_ * (NH + 2 * NKV) * HS;
  const std::vector<T> qkv0 = to_storage<T>(rand_vec(n, 50));
  DeviceBuffer<float> d_c(c), d_s(s);
  std::vector<T> qkv = qkv0;
  cpu().rope_forward(qkv.data(), c.data(), s.data(), B, T_, NH, NKV, HS);
  DeviceBuffer<T> d_qkv(qkv0);
  ops->rope_forward(d_qkv.get(), d_c.get(), d_s.get(), B, T_, NH, NKV, HS);
  expect_close(d_qkv.download(), qkv, 1e-6, std::max(2e-6, kRound<T>), "rope_forward " + at);
  std::vector<T> dq = qkv0;
  cpu().rope_backward(dq.data(), c.data(), s.data(), B, T_, NH, NKV, HS);
  d_qkv.upload(qkv0);
  ops->rope_backward(d_qkv.get(), d_c.get(), d_s.get(), B, T_, NH, NKV, HS);
  // The v heads are untouched: compared with the same values.
  expect_close(d_qkv.download(), dq, 1e-6, std::max(2e-6, kRound<T>), "rope_backward " + at);
}

template <typename T>
void check_ropes(const backend::Ops* ops) {
  check_rope<T>(ops, 2, 5, 4, 2, 8);
  check_rope<T>(ops, 1, 17, 8, 8, 128);
  check_rope<T>(ops, 3, 9, 6, 1, 6);  // H = 3: odd half
}

TEST(CudaElementwise, RopeF32) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_ropes<float>(ops);
}
TEST(CudaElementwise, RopeBf16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_ropes<bf16_t>(ops);
}
TEST(CudaElementwise, RopeF16) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_ropes<f16_t>(ops);
}

// ---- residual, casts, zero, scale -------------------------------------------------------------

TEST(CudaElementwise, ResidualCastsZeroScale) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (int64_t n : {int64_t(1), int64_t(13), int64_t(100003)}) {
    for (int64_t off : {int64_t(0), int64_t(1)}) {
      const std::string at = "n=" + std::to_string(n) + " offset=" + std::to_string(off);
      VecF a = rand_vec(size_t(n + off), 60, -1e5f, 1e5f), b = rand_vec(a.size(), 61);
      if (n > 8) {  // rounding edges: f16 overflow, subnormals, ties
        a[off] = 70000.0f;
        a[off + 1] = -70000.0f;
        a[off + 2] = 1e-40f;
        a[off + 3] = 3e-6f;
        a[off + 4] = 1.0f + 1.0f / 256.0f;  // a bf16 tie
        a[off + 5] = 0.0f;
      }
      DeviceBuffer<float> d_a(a), d_b(b), d_out(a.size());
      VecF out(a.size(), 0.0f);
      cpu().residual_forward(out.data() + off, a.data() + off, b.data() + off, n);
      d_out.upload(VecF(a.size(), 0.0f));
      ops->residual_forward(d_out.get() + off, d_a.get() + off, d_b.get() + off, n);
      expect_same_bits(d_out.download(), out, "residual " + at);
      // Aliased: out over b.
      ops->residual_forward(d_b.get() + off, d_a.get() + off, d_b.get() + off, n);
      VecF gb = d_b.download();
      for (int64_t i = 0; i < off; ++i) gb[size_t(i)] = out[size_t(i)];
      expect_same_bits(gb, out, "residual in place " + at);

      std::vector<bf16_t> cb(a.size(), bf16_t{0});
      std::vector<f16_t> ch(a.size(), f16_t{0});
      VecF rh(a.size(), 0.0f);
      cpu().cast_to_bf16(cb.data() + off, a.data() + off, n);
      cpu().cast_to_f16(ch.data() + off, a.data() + off, n);
      cpu().round_to_f16_values(rh.data() + off, a.data() + off, n);
      DeviceBuffer<bf16_t> d_cb(cb);
      DeviceBuffer<f16_t> d_ch(ch);
      DeviceBuffer<float> d_rh(rh.size());
      d_rh.upload(VecF(a.size(), 0.0f));
      ops->cast_to_bf16(d_cb.get() + off, d_a.get() + off, n);
      ops->cast_to_f16(d_ch.get() + off, d_a.get() + off, n);
      ops->round_to_f16_values(d_rh.get() + off, d_a.get() + off, n);
      const auto gcb = d_cb.download();
      const auto gch = d_ch.download();
      for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(gcb[i].bits, cb[i].bits) << "cast_to_bf16 " << at << " " << i << " " << a[i];
        ASSERT_EQ(gch[i].bits, ch[i].bits) << "cast_to_f16 " << at << " " << i << " " << a[i];
      }
      expect_same_bits(d_rh.download(), rh, "round_to_f16_values " + at);
      // In place.
      ops->round_to_f16_values(d_a.get() + off, d_a.get() + off, n);
      VecF ga = d_a.download();
      for (int64_t i = 0; i < off; ++i) ga[size_t(i)] = rh[size_t(i)];
      expect_same_bits(ga, rh, "round_to_f16_values in place " + at);

      VecF x = rand_vec(a.size(), 62);
      DeviceBuffer<float> d_x(x);
      cpu().scale_inplace(x.data() + off, n, 0.37f);
      ops->scale_inplace(d_x.get() + off, n, 0.37f);
      expect_same_bits(d_x.download(), x, "scale_inplace " + at);
      ops->zero(d_x.get() + off, n);
      const VecF z = d_x.download();
      for (int64_t i = off; i < n + off; ++i) ASSERT_EQ(z[size_t(i)], 0.0f) << "zero " << at;
      ASSERT_EQ(z[0], off ? x[0] : 0.0f) << "zero wrote before its range " << at;
    }
  }
}

// ---- cross-entropy ----------------------------------------------------------------------------

// The gradient rows as floats: fp32 (and fp32 holding f16 values) rows [0, V) of stride ld;
// bf16 rows of V values over the first half of each fp32 row.
VecF grad_rows(const VecF& logits, int N, int V, int64_t ld, DType storage) {
  VecF g(size_t(N) * V);
  for (int n = 0; n < N; ++n) {
    for (int j = 0; j < V; ++j) {
      if (storage == DType::kBF16) {
        bf16_t v;
        std::memcpy(&v, reinterpret_cast<const char*>(logits.data() + n * ld) + 2 * j, 2);
        g[size_t(n) * V + j] = load(v);
      } else {
        g[size_t(n) * V + j] = logits[size_t(n * ld + j)];
      }
    }
  }
  return g;
}

void check_cross_entropy(const backend::Ops* ops, int N, int V, int64_t ld_arg) {
  const int64_t ld = ld_arg == 0 ? V : ld_arg;
  const std::string at =
      "N=" + std::to_string(N) + " V=" + std::to_string(V) + " ld=" + std::to_string(ld_arg);
  VecF logits = rand_vec(size_t(N * ld), 70, -8.0f, 8.0f);
  auto targets = rand_tokens(N, V, 71, /*ignore=*/true);
  targets[0] = V - 1;
  if (N > 1) targets[1] = -1;
  const float dloss = 1.0f / float(N);
  VecF losses(N), lse(N);
  cpu().cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V,
                              ld_arg);
  DeviceBuffer<float> d_logits(logits), d_losses(N), d_lse(N);
  DeviceBuffer<int32_t> d_targets(targets);
  ops->cross_entropy_forward(d_losses.get(), d_lse.get(), d_logits.get(), d_targets.get(), N, V,
                             ld_arg);
  expect_close(d_losses.download(), losses, 1e-5, 1e-5, "ce losses " + at);
  expect_close(d_lse.download(), lse, 1e-5, 1e-6, "ce lse " + at);
  for (DType storage : {DType::kF32, DType::kF16, DType::kBF16}) {
    const std::string st = at + (storage == DType::kF32   ? " f32"
                                 : storage == DType::kF16 ? " f16"
                                                          : " bf16");
    // Gradients are probabilities times dloss: tiny values, so an absolute floor of one f16
    // subnormal step (f16) or 1e-9 (otherwise) on top of one rounding of the storage.
    const double rtol = storage == DType::kF32 ? 1e-4 : storage == DType::kF16 ? 1e-3 : 8e-3;
    const double atol = storage == DType::kF16 ? 1.2e-7 : 1e-9;
    VecF want = logits;
    cpu().cross_entropy_backward_inplace(want.data(), lse.data(), targets.data(), N, V, dloss,
                                         storage, ld_arg);
    d_logits.upload(logits);
    d_lse.upload(lse);
    ops->cross_entropy_backward_inplace(d_logits.get(), d_lse.get(), d_targets.get(), N, V, dloss,
                                        storage, ld_arg);
    const VecF got = d_logits.download();
    expect_close(grad_rows(got, N, V, ld, storage), grad_rows(want, N, V, ld, storage), atol, rtol,
                 "ce backward " + st);
    if (storage != DType::kBF16) {  // the padding columns are never written
      for (int n = 0; n < N; ++n) {
        for (int64_t j = V; j < ld; ++j)
          ASSERT_EQ(got[size_t(n * ld + j)], logits[size_t(n * ld + j)]);
      }
    }
    // Both in one pass.
    VecF want2 = logits, losses2(N), lse2(N);
    cpu().cross_entropy_forward_backward_inplace(losses2.data(), lse2.data(), want2.data(),
                                                 targets.data(), N, V, dloss, storage, ld_arg);
    d_logits.upload(logits);
    ops->cross_entropy_forward_backward_inplace(d_losses.get(), d_lse.get(), d_logits.get(),
                                                d_targets.get(), N, V, dloss, storage, ld_arg);
    expect_close(d_losses.download(), losses2, 1e-5, 1e-5, "ce fwd+bwd losses " + st);
    expect_close(d_lse.download(), lse2, 1e-5, 1e-6, "ce fwd+bwd lse " + st);
    expect_close(grad_rows(d_logits.download(), N, V, ld, storage),
                 grad_rows(want2, N, V, ld, storage), atol, rtol, "ce fwd+bwd grad " + st);
  }
}

TEST(CudaElementwise, CrossEntropy) {
  HR_CUDA_OPS_OR_SKIP(ops);
  check_cross_entropy(ops, 1, 5, 0);
  check_cross_entropy(ops, 7, 1000, 0);
  check_cross_entropy(ops, 6, 50257, 50304);  // GPT-2's vocabulary, padded rows
  check_cross_entropy(ops, 3, 128256, 0);     // Llama 3's: many bf16 chunks per row
  check_cross_entropy(ops, 4, 2049, 2111);    // a chunk boundary + 1, odd stride
}

// ---- optimizer --------------------------------------------------------------------------------

TEST(CudaElementwise, AdamW) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (int64_t n : {int64_t(1), int64_t(1031), int64_t(1 << 20)}) {
    for (int64_t off : {int64_t(0), int64_t(1)}) {
      for (bool copy : {false, true}) {
        for (bool zero_grads : {false, true}) {
          const std::string at = "n=" + std::to_string(n) + " offset=" + std::to_string(off) +
                                 (copy ? " copy" : "") + (zero_grads ? " zero" : "");
          const size_t sz = size_t(n + off);
          VecF p = rand_vec(sz, 80), g = rand_vec(sz, 81, -3.0f, 3.0f), m = rand_vec(sz, 82),
               v = rand_vec(sz, 83, 0.0f, 1.0f);
          backend::AdamWParams hp;
          hp.lr = 3e-4f;
          hp.beta1 = 0.9f;
          hp.beta2 = 0.95f;
          hp.eps = 1e-8f;
          hp.weight_decay = 0.1f;
          hp.step = 7;
          hp.grad_scale = 0.5f;
          DeviceBuffer<float> d_p(p), d_g(g), d_m(m), d_v(v);
          DeviceBuffer<bf16_t> d_c(sz);
          std::vector<bf16_t> c(sz, bf16_t{0});
          d_c.upload(c);
          cpu().adamw_update(p.data() + off, g.data() + off, m.data() + off, v.data() + off, n, hp,
                             copy ? c.data() + off : nullptr, zero_grads);
          ops->adamw_update(d_p.get() + off, d_g.get() + off, d_m.get() + off, d_v.get() + off, n,
                            hp, copy ? d_c.get() + off : nullptr, zero_grads);
          // The same IEEE operations in the same order, but the CPU's scalar loop may contract
          // into FMAs (GCC's default), which rounds b1 m + (1 - b1) g and p decay - update
          // once instead of twice: two ulps of the operands (magnitude about 1), absolute, as
          // the sums cancel.
          expect_close(d_p.download(), p, 2.4e-7, 2.5e-7, "adamw params " + at);
          expect_close(d_m.download(), m, 2.4e-7, 2.5e-7, "adamw m " + at);
          expect_close(d_v.download(), v, 1e-30, 2.5e-7, "adamw v " + at);
          expect_same_bits(d_g.download(), g, "adamw grads " + at);
          expect_close(d_c.download(), c, 0.0, 8e-3, "adamw bf16 copy " + at);
        }
      }
    }
  }
}

TEST(CudaElementwise, SumSquares) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(257), int64_t(1000003), int64_t(50000000)}) {
    const VecF x = rand_vec(size_t(std::max<int64_t>(n, 1)), 90, -2.0f, 2.0f);
    DeviceBuffer<float> d_x(x);
    const double want = cpu().sum_squares(x.data(), n);
    const double got = ops->sum_squares(d_x.get(), n);
    // Both sum in double, in different orders: far inside float's 1e-7.
    EXPECT_NEAR(got, want, 1e-10 * std::max(1.0, want)) << "n=" << n;
    EXPECT_EQ(ops->sum_squares(d_x.get(), n), got) << "deterministic, n=" << n;
  }
}

}  // namespace
}  // namespace headroom
