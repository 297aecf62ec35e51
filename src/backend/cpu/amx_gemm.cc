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
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>

#include "backend/cpu/fast_math.h"
#include "core/check.h"

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

namespace {

constexpr int kBlock = 32;                       // C block: 32 x 32, K step: 32
constexpr size_t kUnitElems = 1024;              // one 32 x 32 block of packed B: 2 tiles
constexpr size_t kChunkBytes = size_t{1} << 20;  // one packed chunk of B
constexpr int kMaxKBf16Out = 4096;               // bf16 C: the sums stay in tiles over all of K
constexpr int kKChunkFp32 = 2048;                // fp32 C: K in chunks, C's tiles reloaded

bool onednn_asked() {
  const char* v = std::getenv("HEADROOM_BF16_GEMM");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return false;
  if (std::strcmp(v, "onednn") == 0) return true;
  throw std::invalid_argument(std::string("HEADROOM_BF16_GEMM=") + v +
                              ": expected auto (our AMX kernel where it applies) or onednn");
}

struct AlignedFree {
  void operator()(uint16_t* p) const { ::operator delete[](p, std::align_val_t(4096)); }
};

// The two packing buffers, allocated and touched once (huge pages where the kernel gives them).
class PackBuffers {
 public:
  static PackBuffers& get() {
    static PackBuffers b;
    return b;
  }
  std::mutex mu;  // amx_gemm calls are serialised, as gemm_ex's oneDNN calls are
  uint16_t* buffer(int i) {
    if (!mem_) {
      auto* p = static_cast<uint16_t*>(::operator new[](2 * kChunkBytes, std::align_val_t(4096)));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
      madvise(p, 2 * kChunkBytes, MADV_HUGEPAGE);
#endif
      std::memset(p, 0, 2 * kChunkBytes);
      mem_.reset(p);
    }
    return mem_.get() + size_t(i) * (kChunkBytes / sizeof(uint16_t));
  }
  size_t bytes() const { return mem_ ? 2 * kChunkBytes : 0; }

 private:
  std::unique_ptr<uint16_t[], AlignedFree> mem_;
};

#if HR_AVX512_HELPERS
#define HR_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

HR_AMX_TARGET void tiles_begin() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // see amx_begin in attention_tiled.cc
  _tile_loadconfig(&cfg);
}

// One 32 x 32 block of packed B from B [K, N] stored by rows (element (k, n) at B[k * ldb + n]):
// rows k0 .. k0+31, columns n0 .. n0+31. Tile h (columns n0 + 16h ..) row p holds the pairs
// (B[k0 + 2p][n], B[k0 + 2p + 1][n]): two rows interleaved by 16-bit unpacks, then the 128-bit
// lanes' halves put in column order.
HR_AMX_TARGET inline void pack_unit_rows(uint16_t* dst, const uint16_t* B, int64_t ldb, int64_t k0,
                                         int64_t n0) {
  const __m512i lo_cols = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i hi_cols = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int p = 0; p < 16; ++p) {
    const uint16_t* r = B + (k0 + 2 * p) * ldb + n0;
    const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + ldb);
    const __m512i lo = _mm512_unpacklo_epi16(r0, r1), hi = _mm512_unpackhi_epi16(r0, r1);
    _mm512_store_si512(dst + p * 32, _mm512_permutex2var_epi64(lo, lo_cols, hi));
    _mm512_store_si512(dst + 512 + p * 32, _mm512_permutex2var_epi64(lo, hi_cols, hi));
  }
}

// The same block from B stored transposed ([N, K] by rows: element (k, n) at B[n * ldb + k]):
// each column's 32 values of k are 16 pairs already, so a tile is the 16 x 16 transpose of the
// 32-bit pairs of 16 rows.
HR_AMX_TARGET inline void pack_unit_cols(uint16_t* dst, const uint16_t* B, int64_t ldb, int64_t k0,
                                         int64_t n0) {
  for (int h = 0; h < 2; ++h) {
    __m512 r[16];
    for (int c = 0; c < 16; ++c) {
      r[c] = _mm512_loadu_ps(reinterpret_cast<const float*>(B + (n0 + 16 * h + c) * ldb + k0));
    }
    transpose16x16(r);
    for (int p = 0; p < 16; ++p)
      _mm512_store_ps(reinterpret_cast<float*>(dst + h * 512 + p * 32), r[p]);
  }
}

// C block [32, 32] (+)= A rows [32, 32 * kb] x packed B units [kb]. fp32 C: `load` starts from C's
// values (accumulation, or a later K chunk), else from zero; without a bias the tiles are stored
// straight into C. Otherwise (bf16 C, or a bias) through a 4 KiB fp32 staging block: + bias,
// + C's old values (bf16 C with accumulate), rounded to C's type.
template <bool kBf16Out>
HR_AMX_TARGET inline void block(int kb, const uint16_t* a, int64_t lda, const uint16_t* b, void* c,
                                int64_t ldc, bool load, const float* bias) {
  float* cf = static_cast<float*>(c);
  const int64_t a_stride = lda * 2, c_stride = ldc * 4;
  if (!kBf16Out && load) {
    _tile_loadd(0, cf, c_stride);
    _tile_loadd(1, cf + 16, c_stride);
    _tile_loadd(2, cf + 16 * ldc, c_stride);
    _tile_loadd(3, cf + 16 * ldc + 16, c_stride);
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
  if (!kBf16Out && bias == nullptr) {
    _tile_stored(0, cf, c_stride);
    _tile_stored(1, cf + 16, c_stride);
    _tile_stored(2, cf + 16 * ldc, c_stride);
    _tile_stored(3, cf + 16 * ldc + 16, c_stride);
    return;
  }
  alignas(64) float s[kBlock * kBlock];
  _tile_stored(0, s, kBlock * 4);
  _tile_stored(1, s + 16, kBlock * 4);
  _tile_stored(2, s + 16 * kBlock, kBlock * 4);
  _tile_stored(3, s + 16 * kBlock + 16, kBlock * 4);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < kBlock; ++r) {
    __m512 v0 = _mm512_add_ps(_mm512_load_ps(s + r * kBlock), b0);
    __m512 v1 = _mm512_add_ps(_mm512_load_ps(s + r * kBlock + 16), b1);
    if constexpr (kBf16Out) {
      uint16_t* cr = static_cast<uint16_t*>(c) + r * ldc;
      if (load) {  // C += ..., in fp32, rounded once
        const __m512i old = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)cr));
        const __m512i old1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(cr + 16)));
        v0 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old, 16)), v0);
        v1 = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old1, 16)), v1);
      }
      _mm512_storeu_si512(cr, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    } else {
      _mm512_storeu_ps(cf + r * ldc, v0);
      _mm512_storeu_ps(cf + r * ldc + 16, v1);
    }
  }
}

struct Problem {
  bool trans_b;
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

// Thread t of nt (nt > 1: inside the parallel region that runs this for every t).
HR_AMX_TARGET void run(const Problem& p, int t, int nt, uint16_t* buf0, uint16_t* buf1) {
  // K in equal chunks of at most kKChunkFp32 (fp32 C), in whole blocks of 32; the last may be
  // shorter. bf16 C: one chunk.
  const int k_blocks = p.K / kBlock;
  const int chunks = p.bf16_out ? 1 : (p.K + kKChunkFp32 - 1) / kKChunkFp32;
  const int kcb = (k_blocks + chunks - 1) / chunks;
  const int kc = kcb * kBlock;
  const int nb = p.N / kBlock;
  const int per_chunk = std::max<int>(1, std::min<int64_t>(nb, kChunkBytes / (size_t(kc) * 64)));
  int64_t m0, m1;
  share(p.M / kBlock, t, nt, &m0, &m1);
  tiles_begin();
  int chunk = 0;
  for (int j0 = 0; j0 < nb; j0 += per_chunk) {
    const int jn = std::min(nb - j0, per_chunk);
    for (int k0 = 0; k0 < p.K; k0 += kc, ++chunk) {
      const int kb = std::min(kcb, (p.K - k0) / kBlock);  // this chunk's K blocks
      uint16_t* buf = (chunk & 1) ? buf1 : buf0;
      int64_t u0, u1;  // this thread's units of the chunk, (column block, k block) in order
      share(int64_t(jn) * kb, t, nt, &u0, &u1);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t j = u / kb, k = u % kb;
        uint16_t* dst = buf + u * kUnitElems;
        const int64_t kk = k0 + k * kBlock, nn = (j0 + j) * kBlock;
        if (p.trans_b) {
          pack_unit_cols(dst, p.B, p.ldb, kk, nn);
        } else {
          pack_unit_rows(dst, p.B, p.ldb, kk, nn);
        }
      }
      if (nt > 1) {
#pragma omp barrier
      }
      const bool last_k = k0 + kc >= p.K;
      const bool load = p.accumulate || k0 > 0;
      const float* bias = last_k ? p.bias : nullptr;
      for (int64_t i = m0; i < m1; ++i) {
        const uint16_t* a = p.A + i * kBlock * p.lda + k0;
        for (int j = 0; j < jn; ++j) {
          if (i + 1 < m1) {  // the next 32 rows of A into L2, a share of them before each block
            const uint16_t* next = a + kBlock * p.lda;
            for (int r = kBlock * j / jn; r < kBlock * (j + 1) / jn; ++r) {
              for (int k = 0; k < kb; ++k) {
                _mm_prefetch(reinterpret_cast<const char*>(next + r * p.lda + k * kBlock),
                             _MM_HINT_T1);
              }
            }
          }
          const int64_t col = int64_t(j0 + j) * kBlock;
          const uint16_t* b = buf + size_t(j) * kb * kUnitElems;
          const float* bj = bias ? bias + col : nullptr;
          if (p.bf16_out) {
            void* c = static_cast<uint16_t*>(p.C) + i * kBlock * p.ldc + col;
            block<true>(kb, a, p.lda, b, c, p.ldc, p.accumulate, bj);
          } else {
            void* c = static_cast<float*>(p.C) + i * kBlock * p.ldc + col;
            block<false>(kb, a, p.lda, b, c, p.ldc, load, bj);
          }
        }
      }
    }
  }
  _tile_release();
}
#endif  // HR_AVX512_HELPERS

}  // namespace

bool amx_gemm_takes(bool trans_a, int M, int N, int K, DType c_type) {
  if (onednn_asked() || !amx_usable() || trans_a) return false;
  if (M <= 0 || N <= 0 || K <= 0 || M % kBlock || N % kBlock || K % kBlock) return false;
  return c_type == DType::kF32 || (c_type == DType::kBF16 && K <= kMaxKBf16Out);
}

void amx_gemm(bool trans_a, bool trans_b, int M, int N, int K, const bf16_t* A, int lda,
              const bf16_t* B, int ldb, DType c_type, void* C, int ldc, const float* bias,
              bool accumulate) {
  HR_CHECK_MSG(amx_gemm_takes(trans_a, M, N, K, c_type),
               "amx_gemm: a shape or CPU it does not take (check amx_gemm_takes first)");
  HR_CHECK(lda >= K && ldb >= (trans_b ? K : N) && ldc >= N);
#if HR_AVX512_HELPERS
  const Problem p{trans_b,
                  M,
                  N,
                  K,
                  reinterpret_cast<const uint16_t*>(A),
                  lda,
                  reinterpret_cast<const uint16_t*>(B),
                  ldb,
                  c_type == DType::kBF16,
                  C,
                  ldc,
                  bias,
                  accumulate};
  PackBuffers& pb = PackBuffers::get();
  std::lock_guard<std::mutex> lock(pb.mu);
  uint16_t* b0 = pb.buffer(0);
  uint16_t* b1 = pb.buffer(1);
  if (omp_in_parallel() || omp_get_max_threads() == 1) {
    run(p, 0, 1, b0, b1);
    return;
  }
#pragma omp parallel
  run(p, omp_get_thread_num(), omp_get_num_threads(), b0, b1);
#else
  (void)trans_b, (void)A, (void)B, (void)C, (void)bias, (void)accumulate;
#endif
}

size_t amx_gemm_buffer_bytes() { return PackBuffers::get().bytes(); }

}  // namespace headroom::cpu

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
