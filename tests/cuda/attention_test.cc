// The CUDA attention family against the CPU ops on the same inputs: plain (fp32, probabilities
// kept), tiled in fp32, bf16 and f16 (and tiled against plain), cached over a prefill and
// single-row steps; outputs start as NaN so that an element left unwritten fails, scratch ends in
// a guard that must survive, and every backward runs twice to the same bits (no scheduling
// dependence).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/bf16.h"
#include "backend/cuda/attention_kernels.h"
#include "cuda_test_util.h"

namespace headroom {
namespace {

using cudatest::DeviceBuffer;
using VecF = std::vector<float>;
using cpu::dtype_of;
using cpu::from_f32;
using cpu::to_f32;

struct Shape {
  int B, T, C, NH, NKV;
  int HS() const { return C / NH; }
  int G() const { return NH / NKV; }
  int64_t W() const { return int64_t(NH + 2 * NKV) * HS(); }
  size_t n_qkv() const { return size_t(B) * T * W(); }
  size_t n_out() const { return size_t(B) * T * C; }
  size_t n_lse() const { return size_t(B) * NH * T; }
  size_t n_att() const { return size_t(B) * NH * T * T; }
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " C=" + std::to_string(C) +
           " NH=" + std::to_string(NH) + " NKV=" + std::to_string(NKV) +
           " HS=" + std::to_string(HS());
  }
};

// T 1, 17, 64 and 200 (one row; one partial tile; one whole tile; four tiles, the last partial),
// multi-head and groups of 4:1 and 8:2, head sizes 64 and 128, and two the tiled kernels pad
// (48 to 64, 100 to 128).
const Shape kShapes[] = {
    {1, 1, 256, 4, 4},    {2, 17, 256, 4, 1},  {1, 64, 1024, 8, 2}, {2, 200, 256, 4, 4},
    {1, 200, 1024, 8, 2}, {1, 130, 512, 4, 1}, {1, 70, 96, 2, 1},   {1, 65, 400, 4, 2},
};

// And GPT-2's layer (T 1024, 12 heads of 64: sixteen query tiles, long online-softmax chains)
// for the tiled tests.
const Shape kGpt2Shape{1, 1024, 768, 12, 12};
std::vector<Shape> tiled_shapes() {
  std::vector<Shape> v(std::begin(kShapes), std::end(kShapes));
  v.push_back(kGpt2Shape);
  return v;
}

VecF rand_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  VecF v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}
template <typename T>
std::vector<T> narrow_vec(const VecF& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_f32<T>(v[i]);
  return out;
}
template <typename T>
VecF widen_vec(const std::vector<T>& v) {
  VecF out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = to_f32(v[i]);
  return out;
}
// Values T holds exactly, so the fp32 reference sees the same inputs.
template <typename T>
VecF exact_rand(size_t n, uint32_t seed) {
  return widen_vec(narrow_vec<T>(rand_vec(n, seed)));
}

// |a - b| <= atol + rtol |b| everywhere (NaN fails); the first misses and the worst reported.
void expect_close(const VecF& a, const VecF& b, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  int misses = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double err = std::abs(double(a[i]) - double(b[i]));
    if (err > worst) worst = err;
    if (!(err <= atol + rtol * std::abs(double(b[i]))) && ++misses <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: cuda " << a[i] << ", cpu " << b[i];
    }
  }
  EXPECT_EQ(misses, 0) << what << ": " << misses << " of " << a.size()
                       << " outside tolerance; worst abs err " << worst;
}

// The same bits everywhere (a rerun of a deterministic op); the first differences reported.
void expect_same_bits(const VecF& a, const VecF& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  size_t misses = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0 && ++misses <= 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << a[i] << " then " << b[i];
    }
  }
  EXPECT_EQ(misses, 0u) << what << ": " << misses << " of " << a.size() << " differ";
}

constexpr size_t kGuard = 64;
constexpr float kGuardValue = 12345.0f;

struct Result {
  VecF out, lse, dqkv;  // lse: the probabilities for the plain ops
};

Result cpu_plain(const Shape& s, const VecF& qkv, const VecF& dout) {
  const backend::Ops& cpu = backend::cpu_ops();
  Result r;
  r.out.assign(s.n_out(), NAN);
  r.lse.assign(s.n_att(), NAN);
  r.dqkv.assign(s.n_qkv(), NAN);
  VecF scratch(cpu.attention_backward_scratch_floats(s.B, s.T, s.NH, s.NKV));
  cpu.attention_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.C, s.NH, s.NKV);
  cpu.attention_backward(r.dqkv.data(), scratch.data(), dout.data(), qkv.data(), r.lse.data(), s.B,
                         s.T, s.C, s.NH, s.NKV);
  return r;
}

Result cuda_plain(const backend::Ops& ops, const Shape& s, const VecF& qkv, const VecF& dout) {
  DeviceBuffer<float> dq(qkv), ddout(dout), out(VecF(s.n_out(), NAN)), att(VecF(s.n_att(), NAN)),
      dqkv(VecF(s.n_qkv(), NAN));
  const size_t ns = ops.attention_backward_scratch_floats(s.B, s.T, s.NH, s.NKV);
  VecF guard(ns + kGuard, NAN);
  std::fill(guard.begin() + ns, guard.end(), kGuardValue);
  DeviceBuffer<float> scratch(guard);
  ops.attention_forward(out.get(), att.get(), dq.get(), s.B, s.T, s.C, s.NH, s.NKV);
  ops.attention_backward(dqkv.get(), scratch.get(), ddout.get(), dq.get(), att.get(), s.B, s.T, s.C,
                         s.NH, s.NKV);
  Result r{out.download(), att.download(), dqkv.download()};
  const VecF after = scratch.download();
  for (size_t i = ns; i < after.size(); ++i) EXPECT_EQ(after[i], kGuardValue) << "scratch overrun";
  // Again from NaN: the same bits.
  dqkv.upload(VecF(s.n_qkv(), NAN));
  ops.attention_backward(dqkv.get(), scratch.get(), ddout.get(), dq.get(), att.get(), s.B, s.T, s.C,
                         s.NH, s.NKV);
  expect_same_bits(dqkv.download(), r.dqkv, "a second backward's dqkv");
  return r;
}

// The CPU's tiled op in storage T; `out_bwd` / `lse_bwd` (when given) replace its own forward's
// in its backward (to check another backend's backward on that backend's forward).
template <typename T>
Result cpu_tiled(const Shape& s, const VecF& qkv, const VecF& dout, const VecF* out_bwd = nullptr,
                 const VecF* lse_bwd = nullptr) {
  const backend::Ops& cpu = backend::cpu_ops();
  const DType st = dtype_of<T>();
  const std::vector<T> q = narrow_vec<T>(qkv), dy = narrow_vec<T>(dout);
  std::vector<T> out(s.n_out()), dqkv(s.n_qkv());
  Result r;
  r.lse.assign(s.n_lse(), NAN);
  VecF fs(cpu.attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st));
  VecF bs(cpu.attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st));
  cpu.attention_tiled_forward(out.data(), r.lse.data(), q.data(), s.B, s.T, s.C, s.NH, s.NKV,
                              fs.data());
  r.out = widen_vec(out);
  const std::vector<T> ob = out_bwd ? narrow_vec<T>(*out_bwd) : out;
  const VecF& lb = lse_bwd ? *lse_bwd : r.lse;
  cpu.attention_tiled_backward(dqkv.data(), dy.data(), q.data(), ob.data(), lb.data(), s.B, s.T,
                               s.C, s.NH, s.NKV, bs.data());
  r.dqkv = widen_vec(dqkv);
  return r;
}

template <typename T>
Result cuda_tiled(const backend::Ops& ops, const Shape& s, const VecF& qkv, const VecF& dout) {
  const DType st = dtype_of<T>();
  const T nan = from_f32<T>(NAN);
  DeviceBuffer<T> dq(narrow_vec<T>(qkv)), ddout(narrow_vec<T>(dout)),
      out(std::vector<T>(s.n_out(), nan)), dqkv(std::vector<T>(s.n_qkv(), nan));
  DeviceBuffer<float> lse(VecF(s.n_lse(), NAN));
  const size_t nf = ops.attention_tiled_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st);
  const size_t nb = ops.attention_tiled_backward_scratch_floats(s.B, s.T, s.C, s.NH, s.NKV, st);
  VecF fg(nf + kGuard, NAN), bg(nb + kGuard, NAN);
  std::fill(fg.begin() + nf, fg.end(), kGuardValue);
  std::fill(bg.begin() + nb, bg.end(), kGuardValue);
  DeviceBuffer<float> fs(fg), bs(bg);
  ops.attention_tiled_forward(out.get(), lse.get(), dq.get(), s.B, s.T, s.C, s.NH, s.NKV, fs.get());
  ops.attention_tiled_backward(dqkv.get(), ddout.get(), dq.get(), out.get(), lse.get(), s.B, s.T,
                               s.C, s.NH, s.NKV, bs.get());
  Result r{widen_vec(out.download()), lse.download(), widen_vec(dqkv.download())};
  const VecF fa = fs.download(), ba = bs.download();
  for (size_t i = nf; i < fa.size(); ++i)
    EXPECT_EQ(fa[i], kGuardValue) << "forward scratch overrun";
  for (size_t i = nb; i < ba.size(); ++i)
    EXPECT_EQ(ba[i], kGuardValue) << "backward scratch overrun";
  // Both passes again: the same bits.
  out.upload(std::vector<T>(s.n_out(), nan));
  dqkv.upload(std::vector<T>(s.n_qkv(), nan));
  ops.attention_tiled_forward(out.get(), lse.get(), dq.get(), s.B, s.T, s.C, s.NH, s.NKV, fs.get());
  ops.attention_tiled_backward(dqkv.get(), ddout.get(), dq.get(), out.get(), lse.get(), s.B, s.T,
                               s.C, s.NH, s.NKV, bs.get());
  expect_same_bits(widen_vec(out.download()), r.out, "a second forward's out");
  expect_same_bits(lse.download(), r.lse, "a second forward's lse");
  expect_same_bits(widen_vec(dqkv.download()), r.dqkv, "a second backward's dqkv");
  return r;
}

// fp32 against fp32 in another summation order (GPU tiles and reduction trees against the CPU's
// blocks): 1e-5 at |out| <= 1; dqkv sums up to G T products of order one, 5e-5.
constexpr double kOutAtol = 1e-5, kOutRtol = 1e-4, kGradAtol = 5e-5, kGradRtol = 1e-4;

TEST(CudaAttention, PlainMatchesCpu) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const VecF qkv = rand_vec(s.n_qkv(), 1), dout = rand_vec(s.n_out(), 2);
    const Result want = cpu_plain(s, qkv, dout);
    const Result got = cuda_plain(*ops, s, qkv, dout);
    expect_close(got.out, want.out, kOutAtol, kOutRtol, "out");
    expect_close(got.lse, want.lse, kOutAtol, kOutRtol, "att");
    expect_close(got.dqkv, want.dqkv, kGradAtol, kGradRtol, "dqkv");
  }
}

TEST(CudaAttention, TiledFp32MatchesCpuAndPlain) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (const Shape& s : tiled_shapes()) {
    SCOPED_TRACE(s.str());
    const VecF qkv = rand_vec(s.n_qkv(), 3), dout = rand_vec(s.n_out(), 4);
    const Result want = cpu_tiled<float>(s, qkv, dout);
    const Result got = cuda_tiled<float>(*ops, s, qkv, dout);
    expect_close(got.out, want.out, kOutAtol, kOutRtol, "out");
    expect_close(got.lse, want.lse, kOutAtol, kOutRtol, "lse");
    expect_close(got.dqkv, want.dqkv, kGradAtol, kGradRtol, "dqkv");
    // Tiled and plain on the device: the same mathematics.
    const Result plain = cuda_plain(*ops, s, qkv, dout);
    expect_close(got.out, plain.out, kOutAtol, kOutRtol, "tiled out vs plain");
    expect_close(got.dqkv, plain.dqkv, kGradAtol, kGradRtol, "tiled dqkv vs plain");
  }
}

// 16-bit storage, against the CPU's fp32 op on the same (exactly representable) inputs, its
// backward given the device's rounded out and its lse, and against the CPU's op in T.
// The fp32 tiles widen on load, compute in fp32 and round each output once: within one rounding
// of T (relative 2^-8 bf16, 2^-11 f16) of fp32, plus fp32 noise. The tensor-core tiles round P
// and dS to T before their products, as the CPU's bf16 tile products do (fused_kernels.h): within
// their bounds, 1/128 on out and G/32 on dqkv for bf16 (the CPU's own tests'), a quarter of those
// for f16 (four times bf16's precision). Against the CPU's op in T, the sum of both sides' bounds
// (the CPU's bf16 may take tile products; its f16 widens).
class KernelScope {
 public:
  explicit KernelScope(backend::cuda::TiledAttentionKernel k) {
    backend::cuda::set_tiled_attention_kernel(k);
  }
  ~KernelScope() {
    backend::cuda::set_tiled_attention_kernel(backend::cuda::TiledAttentionKernel::kAuto);
  }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;
};

template <typename T>
void check_16bit(backend::cuda::TiledAttentionKernel kernel) {
  HR_CUDA_OPS_OR_SKIP(ops);
  KernelScope scope(kernel);
  ASSERT_EQ(backend::cuda::tiled_attention_kernel(), kernel);
  const bool bf16 = std::is_same_v<T, bf16_t>;
  const bool tc = kernel == backend::cuda::TiledAttentionKernel::kTensorCores;
  const double round = bf16 ? 1.0 / 256 : 1.0 / 2048;
  const double out_tc = bf16 ? 1.0 / 128 : 1.0 / 512, grad_tc = bf16 ? 1.0 / 32 : 1.0 / 128;
  for (const Shape& s : tiled_shapes()) {
    SCOPED_TRACE(s.str());
    const VecF qkv = exact_rand<T>(s.n_qkv(), 5), dout = exact_rand<T>(s.n_out(), 6);
    const Result got = cuda_tiled<T>(*ops, s, qkv, dout);
    const Result f32 = cpu_tiled<float>(s, qkv, dout, &got.out, &got.lse);
    const double out_atol = tc ? out_tc : kOutAtol, grad_atol = tc ? s.G() * grad_tc : kGradAtol;
    expect_close(got.out, f32.out, out_atol, round, "out vs fp32");
    expect_close(got.lse, f32.lse, kOutAtol, kOutRtol, "lse vs fp32");
    expect_close(got.dqkv, f32.dqkv, grad_atol, round, "dqkv vs fp32");
    const Result same = cpu_tiled<T>(s, qkv, dout);
    const double cpu_out = bf16 ? 1.0 / 128 : kOutAtol, cpu_grad = bf16 ? s.G() / 32.0 : kGradAtol;
    expect_close(got.out, same.out, out_atol + cpu_out, 2 * round, "out vs cpu");
    expect_close(got.dqkv, same.dqkv, grad_atol + cpu_grad, 2 * round, "dqkv vs cpu");
    expect_close(got.lse, same.lse, bf16 ? 1.0 / 128 : kOutAtol, kOutRtol, "lse vs cpu");
  }
}
TEST(CudaAttention, TiledBf16TensorCoresMatchCpu) {
  check_16bit<bf16_t>(backend::cuda::TiledAttentionKernel::kTensorCores);
}
TEST(CudaAttention, TiledF16TensorCoresMatchCpu) {
  check_16bit<f16_t>(backend::cuda::TiledAttentionKernel::kTensorCores);
}
TEST(CudaAttention, TiledBf16Fp32TilesMatchCpu) {
  check_16bit<bf16_t>(backend::cuda::TiledAttentionKernel::kFp32Tiles);
}
TEST(CudaAttention, TiledF16Fp32TilesMatchCpu) {
  check_16bit<f16_t>(backend::cuda::TiledAttentionKernel::kFp32Tiles);
}

// Generation: a prefill of `prefill` rows, then single-row steps, on the CPU's and the device's
// caches from the same start; out after every call and the caches at the end. The caches are
// copies (the same bits); out is fp32 in another order.
TEST(CudaAttention, CachedMatchesCpuOverPrefillAndSteps) {
  HR_CUDA_OPS_OR_SKIP(ops);
  struct Case {
    int NH, NKV, HS, prefill, steps;
  };
  const Case cases[] = {
      {4, 4, 64, 17, 4}, {8, 2, 128, 200, 3}, {4, 1, 64, 1, 5}, {2, 1, 24, 130, 2}};
  const backend::Ops& cpu = backend::cpu_ops();
  for (const Case& c : cases) {
    SCOPED_TRACE("NH=" + std::to_string(c.NH) + " NKV=" + std::to_string(c.NKV) +
                 " HS=" + std::to_string(c.HS) + " prefill=" + std::to_string(c.prefill));
    const int context = c.prefill + c.steps + 3;  // positions past the last stay untouched
    const int64_t W = int64_t(c.NH + 2 * c.NKV) * c.HS;
    const size_t ncache = size_t(c.NKV) * context * c.HS;
    const VecF start = rand_vec(ncache, 7);  // what the cache held before (overwritten or kept)
    VecF kc = start, vc = start;
    DeviceBuffer<float> dk(start), dv(start);
    int pos = 0;
    for (int call = 0; call <= c.steps; ++call) {
      const int rows = call == 0 ? c.prefill : 1;
      SCOPED_TRACE("pos0=" + std::to_string(pos) + " rows=" + std::to_string(rows));
      const VecF qkv = rand_vec(size_t(rows) * W, 100 + call);
      VecF out(size_t(rows) * c.NH * c.HS, NAN);
      cpu.attention_cached_forward(out.data(), kc.data(), vc.data(), qkv.data(), rows, pos, context,
                                   c.NH, c.NKV, c.HS);
      DeviceBuffer<float> dqkv(qkv), dout(VecF(out.size(), NAN));
      ops->attention_cached_forward(dout.get(), dk.get(), dv.get(), dqkv.get(), rows, pos, context,
                                    c.NH, c.NKV, c.HS);
      expect_close(dout.download(), out, kOutAtol, kOutRtol, "out");
      pos += rows;
    }
    expect_same_bits(dk.download(), kc, "k cache");
    expect_same_bits(dv.download(), vc, "v cache");
  }
  EXPECT_EQ(ops->max_cached_head_size(), cpu.max_cached_head_size());
}

// The planner's sizes: the tiled forward takes no scratch, the backwards D (B NH T floats).
TEST(CudaAttention, ScratchSizes) {
  HR_CUDA_OPS_OR_SKIP(ops);
  for (DType st : {DType::kF32, DType::kBF16, DType::kF16}) {
    EXPECT_EQ(ops->attention_tiled_scratch_floats(2, 300, 1024, 8, 2, st), 0u);
    EXPECT_EQ(ops->attention_tiled_backward_scratch_floats(2, 300, 1024, 8, 2, st),
              size_t{2} * 8 * 300);
  }
  EXPECT_EQ(ops->attention_backward_scratch_floats(2, 300, 8, 2), size_t{2} * 8 * 300);
}

// A head the tiled kernels do not take is refused before any launch, naming its size.
TEST(CudaAttentionDeathTest, TiledRefusesHeadsAbove128) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  HR_CUDA_OPS_OR_SKIP(ops);
  EXPECT_DEATH(ops->attention_tiled_forward(static_cast<float*>(nullptr), nullptr, nullptr, 1, 16,
                                            512, 2, 2, nullptr),
               "head size 256 is above the tiled kernels' 128");
}

}  // namespace
}  // namespace headroom
