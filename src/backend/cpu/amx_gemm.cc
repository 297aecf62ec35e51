// bf16 GEMM on AMX tiles (amx_gemm.h; measured in docs/gemm.md, "Our own AMX GEMM").
//
// C is computed in blocks of 32 x 32 (2 x 2 tiles of 16 x 16 fp32 accumulators, tmm0-3), from
// two A tiles of 16 rows x 32 bf16 (tmm4-5), loaded straight from A's rows with their stride, and
// two B tiles of 16 pairs of rows x 16 columns (tmm6-7) from a packed copy of B: the tile unit
// takes B's elements pair-interleaved (VNNI: row p holds B[2p][n], B[2p+1][n] for 16 n), which
// neither of B's layouts is. B is packed a chunk of whole 32-column blocks at a time (1 MiB, the
// threads packing their shares together), into one of two buffers so that the next chunk can be
// packed while a slower thread still computes from the last; each thread then runs its share of
// C's 32-row blocks against every column block of the chunk, so its A rows stay in L1/L2 while
// the chunk's columns stream from L2.
#include "backend/cpu/amx_gemm.h"

#include <immintrin.h>
#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/fast_math.h"
#include "backend/cpu/transpose.h"
#include "core/check.h"
#include "memory/host_resource.h"

// GCC 12 warns of its own intrinsics' undefined vectors (-Wmaybe-uninitialized) when they are
// inlined into a function with a target attribute: a false positive (as in attention_tiled.cc).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace headroom::cpu {

bool cpu_has_avx512bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

bool amx_usable() {
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
  static const bool ok = [] {
    // CPUID leaf 7, subleaf 0: EDX bit 24 is AMX-TILE, bit 22 AMX-BF16 (read directly: clang 14's
    // __builtin_cpu_supports does not know the AMX names).
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx512bf16() || __get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d >> 24 & 1u) == 0 || (d >> 22 & 1u) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

__attribute__((target("amx-tile"))) void amx_tiles_begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12 does not see ldtilecfg read the whole 64 bytes: where this is not inlined (a build
  // without -march=native) it dropped the colsb/rows stores as dead, and ldtilecfg faulted on the
  // all-zero configuration. An empty asm that may read cfg keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}
__attribute__((target("amx-tile"))) void amx_tiles_end() { _tile_release(); }
#else
void amx_tiles_begin() {}
void amx_tiles_end() {}
#endif

namespace {

constexpr int kBlock = 32;                       // C block: 32 x 32, K step: 32
constexpr size_t kUnitElems = 1024;              // one 32 x 32 block of packed B: 2 tiles
constexpr size_t kChunkBytes = size_t{1} << 20;  // one packed chunk of B
constexpr int kMaxKBf16Out = 4096;               // bf16 C: the sums stay in tiles over all of K
constexpr int kKChunkFp32 = 2048;                // fp32 C: K in chunks, C's tiles reloaded
constexpr size_t kPanelElems = size_t{kBlock} * kMaxKBf16Out;  // one staged panel of op(A)

bool onednn_asked() {
  const char* v = std::getenv("HEADROOM_BF16_GEMM");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return false;
  if (std::strcmp(v, "onednn") == 0) return true;
  throw std::invalid_argument(std::string("HEADROOM_BF16_GEMM=") + v +
                              ": expected auto (our AMX kernel where it applies) or onednn");
}

// The two chunk buffers of packed B and the per-thread panels of staged op(A), each allocated at
// its first use and kept, from the host resource the arenas use (huge pages, touched once).
// Outside the memory plan, as oneDNN's scratchpad is (docs/notes/memory-plan.md).
class PackBuffers {
 public:
  static PackBuffers& get() {
    static PackBuffers b;
    return b;
  }
  std::mutex mu;  // amx_gemm calls are serialised, as gemm_ex's oneDNN calls are
  uint16_t* buffer(int i) {
    // 2 MiB: mmap'ed, so page-aligned (the packing's aligned 64-byte stores).
    if (chunks_.empty()) chunks_.resize(2 * kChunkBytes / sizeof(uint16_t));
    return chunks_.data() + size_t(i) * (kChunkBytes / sizeof(uint16_t));
  }
  // The staging panels of op(A), one per thread (grown when a call has more threads).
  uint16_t* panels(int threads) {
    if (size_t(threads) * kPanelElems > panels_.size()) {
      panels_ = Buffer(size_t(threads) * kPanelElems);
    }
    return panels_.data();
  }
  size_t bytes() const { return (chunks_.size() + panels_.size()) * sizeof(uint16_t); }

 private:
  using Buffer = std::vector<uint16_t, memory::HostAllocator<uint16_t>>;
  Buffer chunks_, panels_;
};

#if HR_AVX512_HELPERS
#define HR_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

// The first n of 32 16-bit lanes (0 <= n <= 32).
inline __mmask32 lanes32(int n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }

// One 32 x 32 block of packed B from B [K, N] stored by rows (element (k, n) at B[k * ldb + n]):
// rows k0 .. k0+31, columns n0 .. n0+31, of which the first kv rows and nv columns exist (the
// rest packed as zeros). Tile h (columns n0 + 16h ..) row p holds the pairs (B[k0 + 2p][n],
// B[k0 + 2p + 1][n]): two rows interleaved by 16-bit unpacks, then the 128-bit lanes' halves put
// in column order.
HR_AMX_TARGET inline void pack_unit_rows(uint16_t* dst, const uint16_t* B, int64_t ldb, int64_t k0,
                                         int64_t n0, int kv, int nv) {
  const __m512i lo_cols = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i hi_cols = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const __mmask32 cols = lanes32(nv);
  for (int p = 0; p < 16; ++p) {
    const uint16_t* r = B + (k0 + 2 * p) * ldb + n0;
    __m512i r0, r1;
    if (kv == kBlock && nv == kBlock) {
      r0 = _mm512_loadu_si512(r);
      r1 = _mm512_loadu_si512(r + ldb);
    } else {
      r0 = _mm512_maskz_loadu_epi16(2 * p < kv ? cols : 0, r);
      r1 = _mm512_maskz_loadu_epi16(2 * p + 1 < kv ? cols : 0, r + ldb);
    }
    const __m512i lo = _mm512_unpacklo_epi16(r0, r1), hi = _mm512_unpackhi_epi16(r0, r1);
    _mm512_store_si512(dst + p * 32, _mm512_permutex2var_epi64(lo, lo_cols, hi));
    _mm512_store_si512(dst + 512 + p * 32, _mm512_permutex2var_epi64(lo, hi_cols, hi));
  }
}

// The same block from B stored transposed ([N, K] by rows: element (k, n) at B[n * ldb + k]):
// each column's 32 values of k are 16 pairs already, so a tile is the 16 x 16 transpose of the
// 32-bit pairs of 16 rows.
HR_AMX_TARGET inline void pack_unit_cols(uint16_t* dst, const uint16_t* B, int64_t ldb, int64_t k0,
                                         int64_t n0, int kv, int nv) {
  const __mmask32 ks = lanes32(kv);
  for (int h = 0; h < 2; ++h) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c) {
      const uint16_t* src = B + (n0 + 16 * h + c) * ldb + k0;
      if (kv == kBlock && nv == kBlock) {
        r[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(src));
      } else {
        r[c] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(16 * h + c < nv ? ks : 0, src));
      }
    }
    transpose16x16(r);
    for (int p = 0; p < 16; ++p) {
      _mm512_store_ps(reinterpret_cast<float*>(dst + h * 512 + p * 32), r[p]);
    }
  }
}

// The 32 x 32 * kb panel of op(A) for C's rows m0 .. m0+31 and K's k0 .. k0 + 32 * kb - 1, with
// rows from mv on and columns from kv on zero, into dst [32, 32 * kb]: for A transposed (stored
// [K, M]: element (m, k) at A[k * lda + m]), a partial row block, or a K not a multiple of 32.
HR_AMX_TARGET void stage_a(uint16_t* dst, const uint16_t* A, int64_t lda, bool trans_a, int64_t m0,
                           int64_t k0, int mv, int kv, int kb) {
  const int64_t ld = int64_t(kb) * kBlock;
  std::memset(dst, 0, size_t(kBlock) * ld * sizeof(uint16_t));
  if (trans_a) {
    transpose_16bit(dst, ld, A + k0 * lda + m0, lda, kv, mv);
    return;
  }
  for (int r = 0; r < mv; ++r) std::memcpy(dst + r * ld, A + (m0 + r) * lda + k0, size_t(kv) * 2);
}

// C block [32, 32] (+)= A rows [32, 32 * kb] x packed B units [kb], of which the first `rows`
// rows and `cols` columns exist in C. fp32 C: `load` starts from C's values (accumulation, or a
// later K chunk), else from zero; a whole block without a bias has its tiles stored straight into
// C. Otherwise through a 4 KiB fp32 staging block: + bias, + C's old values (bf16 C with
// accumulate), rounded to C's type, stored to the rows and columns that exist.
template <bool kBf16Out>
HR_AMX_TARGET inline void block(int kb, const uint16_t* a, int64_t lda, const uint16_t* b, void* c,
                                int64_t ldc, bool load, const float* bias, int rows, int cols) {
  float* cf = static_cast<float*>(c);
  const int64_t a_stride = lda * 2, c_stride = ldc * 4;
  const bool whole = rows == kBlock && cols == kBlock;
  alignas(64) float s[kBlock * kBlock];
  const __mmask16 m0 = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32   ? __mmask16(0xFFFF)
                       : cols <= 16 ? __mmask16(0)
                                    : __mmask16((1u << (cols - 16)) - 1);
  if (!kBf16Out && load && whole) {
    _tile_loadd(0, cf, c_stride);
    _tile_loadd(1, cf + 16, c_stride);
    _tile_loadd(2, cf + 16 * ldc, c_stride);
    _tile_loadd(3, cf + 16 * ldc + 16, c_stride);
  } else if (!kBf16Out && load) {  // the rows and columns that exist, zeros around them
    for (int r = 0; r < kBlock; ++r) {
      const bool in = r < rows;
      _mm512_store_ps(s + r * kBlock, _mm512_maskz_loadu_ps(in ? m0 : 0, cf + r * ldc));
      _mm512_store_ps(s + r * kBlock + 16, _mm512_maskz_loadu_ps(in ? m1 : 0, cf + r * ldc + 16));
    }
    _tile_loadd(0, s, kBlock * 4);
    _tile_loadd(1, s + 16, kBlock * 4);
    _tile_loadd(2, s + 16 * kBlock, kBlock * 4);
    _tile_loadd(3, s + 16 * kBlock + 16, kBlock * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* a1 = a + 16 * lda;
  for (int k = 0; k < kb; ++k) {
    _tile_loadd(4, a + k * kBlock, a_stride);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 512, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * kBlock, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    b += kUnitElems;
  }
  if (!kBf16Out && bias == nullptr && whole) {
    _tile_stored(0, cf, c_stride);
    _tile_stored(1, cf + 16, c_stride);
    _tile_stored(2, cf + 16 * ldc, c_stride);
    _tile_stored(3, cf + 16 * ldc + 16, c_stride);
    return;
  }
  _tile_stored(0, s, kBlock * 4);
  _tile_stored(1, s + 16, kBlock * 4);
  _tile_stored(2, s + 16 * kBlock, kBlock * 4);
  _tile_stored(3, s + 16 * kBlock + 16, kBlock * 4);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v0 = _mm512_add_ps(_mm512_load_ps(s + r * kBlock), b0);
    __m512 v1 = _mm512_add_ps(_mm512_load_ps(s + r * kBlock + 16), b1);
    if constexpr (kBf16Out) {
      uint16_t* cr = static_cast<uint16_t*>(c) + r * ldc;
      const __mmask32 mc = lanes32(cols);
      if (load) {  // C += ..., in fp32, rounded once
        const __m512i old = _mm512_maskz_loadu_epi16(mc, cr);
        const __m512i old0 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(old));
        const __m512i old1 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(old, 1));
        v0 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old0, 16)), v0);
        v1 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old1, 16)), v1);
      }
      _mm512_mask_storeu_epi16(cr, mc, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    } else {
      _mm512_mask_storeu_ps(cf + r * ldc, m0, v0);
      _mm512_mask_storeu_ps(cf + r * ldc + 16, m1, v1);
    }
  }
}

struct Problem {
  bool trans_a, trans_b;
  int M, N, K;
  const uint16_t* A;
  int64_t lda;
  const uint16_t* B;
  int64_t ldb;
  bool bf16_out;
  void* C;
  int64_t ldc;
  const float* bias;
  bool accumulate;
};

// The share [*b, *e) of n items for thread t of nt, in one contiguous range.
inline void share(int64_t n, int t, int nt, int64_t* b, int64_t* e) {
  *b = n * t / nt;
  *e = n * (t + 1) / nt;
}

// Thread t of nt (nt > 1: inside the parallel region that runs this for every t); `panel` is the
// thread's staging for op(A)'s panels (kPanelElems).
HR_AMX_TARGET void run(const Problem& p, int t, int nt, uint16_t* buf0, uint16_t* buf1,
                       uint16_t* panel) {
  // K in equal chunks of at most kKChunkFp32 (fp32 C), in whole blocks of 32; the last may be
  // shorter. bf16 C: one chunk.
  const int k_blocks = (p.K + kBlock - 1) / kBlock;
  const int chunks =
      p.bf16_out ? 1 : (k_blocks + kKChunkFp32 / kBlock - 1) / (kKChunkFp32 / kBlock);
  const int kcb = (k_blocks + chunks - 1) / chunks;
  const int kc = kcb * kBlock;
  const int nb = (p.N + kBlock - 1) / kBlock, mb = (p.M + kBlock - 1) / kBlock;
  // Column blocks per packed chunk: as many as fit, spread evenly over the chunks (24 blocks in
  // chunks of 21 and 3 left the second chunk's barrier for little work).
  const int fit = std::max<int>(1, std::min<int64_t>(nb, kChunkBytes / (size_t(kc) * 64)));
  const int n_chunks = (nb + fit - 1) / fit;
  const int per_chunk = (nb + n_chunks - 1) / n_chunks;
  // op(A) is staged a panel at a time where the tiles cannot read it in place.
  const bool stage_all = p.trans_a || p.K % kBlock != 0;
  int64_t m0, m1;
  share(mb, t, nt, &m0, &m1);
  amx_tiles_begin();
  int chunk = 0;
  for (int j0 = 0; j0 < nb; j0 += per_chunk) {
    const int jn = std::min(nb - j0, per_chunk);
    for (int k0 = 0; k0 < p.K; k0 += kc, ++chunk) {
      const int kv = std::min(kc, p.K - k0);      // this chunk's K
      const int kb = (kv + kBlock - 1) / kBlock;  // in blocks
      uint16_t* buf = (chunk & 1) ? buf1 : buf0;
      int64_t u0, u1;  // this thread's units of the chunk, (column block, k block) in order
      share(int64_t(jn) * kb, t, nt, &u0, &u1);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t j = u / kb, k = u % kb;
        uint16_t* dst = buf + u * kUnitElems;
        const int64_t kk = k0 + k * kBlock, nn = (j0 + j) * kBlock;
        const int kvu = int(std::min<int64_t>(kBlock, k0 + kv - kk));
        const int nvu = int(std::min<int64_t>(kBlock, p.N - nn));
        if (p.trans_b) {
          pack_unit_cols(dst, p.B, p.ldb, kk, nn, kvu, nvu);
        } else {
          pack_unit_rows(dst, p.B, p.ldb, kk, nn, kvu, nvu);
        }
      }
      if (nt > 1) {
#pragma omp barrier
      }
      const bool load = p.accumulate || k0 > 0;
      const float* bias = k0 + kv >= p.K ? p.bias : nullptr;
      for (int64_t i = m0; i < m1; ++i) {
        const int rows = int(std::min<int64_t>(kBlock, p.M - i * kBlock));
        const uint16_t* a;
        int64_t lda;
        if (stage_all || rows < kBlock) {
          stage_a(panel, p.A, p.lda, p.trans_a, i * kBlock, k0, rows, kv, kb);
          a = panel;
          lda = int64_t(kb) * kBlock;
        } else {
          a = p.A + i * kBlock * p.lda + k0;
          lda = p.lda;
        }
        for (int j = 0; j < jn; ++j) {
          if (!stage_all && i + 1 < m1 && (i + 2) * kBlock <= p.M) {
            // the next 32 rows of A into L2, a share of them before each block
            const uint16_t* next = p.A + (i + 1) * kBlock * p.lda + k0;
            for (int r = kBlock * j / jn; r < kBlock * (j + 1) / jn; ++r) {
              for (int k = 0; k < kb; ++k) {
                _mm_prefetch(reinterpret_cast<const char*>(next + r * p.lda + k * kBlock),
                             _MM_HINT_T1);
              }
            }
          }
          const int64_t col = int64_t(j0 + j) * kBlock;
          const int cols = int(std::min<int64_t>(kBlock, p.N - col));
          const uint16_t* b = buf + size_t(j) * kb * kUnitElems;
          const float* bj = bias ? bias + col : nullptr;
          if (p.bf16_out) {
            void* c = static_cast<uint16_t*>(p.C) + i * kBlock * p.ldc + col;
            block<true>(kb, a, lda, b, c, p.ldc, p.accumulate, bj, rows, cols);
          } else {
            void* c = static_cast<float*>(p.C) + i * kBlock * p.ldc + col;
            block<false>(kb, a, lda, b, c, p.ldc, load, bj, rows, cols);
          }
        }
      }
    }
  }
  amx_tiles_end();
}
#endif  // HR_AVX512_HELPERS

}  // namespace

bool amx_gemm_takes(int K, DType c_type) {
  if (onednn_asked() || !amx_usable() || K <= 0) return false;
  return c_type == DType::kF32 || (c_type == DType::kBF16 && K <= kMaxKBf16Out);
}

void amx_gemm(bool trans_a, bool trans_b, int M, int N, int K, const bf16_t* A, int lda,
              const bf16_t* B, int ldb, DType c_type, void* C, int ldc, const float* bias,
              bool accumulate) {
  HR_CHECK_MSG(amx_gemm_takes(K, c_type),
               "amx_gemm: a shape or CPU it does not take (check amx_gemm_takes first)");
  HR_CHECK(M > 0 && N > 0);
  HR_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N);
#if HR_AVX512_HELPERS
  const Problem p{trans_a, trans_b,
                  M,       N,
                  K,       reinterpret_cast<const uint16_t*>(A),
                  lda,     reinterpret_cast<const uint16_t*>(B),
                  ldb,     c_type == DType::kBF16,
                  C,       ldc,
                  bias,    accumulate};
  PackBuffers& pb = PackBuffers::get();
  std::lock_guard<std::mutex> lock(pb.mu);
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  uint16_t* b0 = pb.buffer(0);
  uint16_t* b1 = pb.buffer(1);
  uint16_t* panels = pb.panels(threads);
  if (threads == 1) {
    run(p, 0, 1, b0, b1, panels);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    run(p, t, omp_get_num_threads(), b0, b1, panels + size_t(t) * kPanelElems);
  }
#else
  (void)trans_b, (void)A, (void)B, (void)C, (void)bias, (void)accumulate;
#endif
}

size_t amx_gemm_buffer_bytes() { return PackBuffers::get().bytes(); }

}  // namespace headroom::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
