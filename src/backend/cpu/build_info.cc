// The build's and the CPU's features for `headroom --version` (backend/cpu/build_info.h).
#include "backend/cpu/build_info.h"

#include <fmt/format.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.h>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/fast_math.h"

namespace headroom::cpu {

BuildInfo build_info() {
  BuildInfo b;
#if defined(__clang__)
  b.compiler =
      fmt::format("clang {}.{}.{}", __clang_major__, __clang_minor__, __clang_patchlevel__);
#elif defined(__GNUC__)
  b.compiler = fmt::format("GCC {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#else
  b.compiler = "unknown";
#endif
  b.avx512_kernels_compiled = HR_AVX512_KERNELS != 0;
#if defined(__x86_64__) && defined(__GNUC__)
  b.avx512_detected = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  b.amx_kernels_compiled = true;  // compiled with target attributes, chosen at run time
#endif
  b.avx512_bf16_detected = cpu_has_avx512bf16();
  b.amx_detected = amx_usable();
  const dnnl_version_t* v = dnnl_version();
  const char* runtime = v->cpu_runtime == DNNL_RUNTIME_OMP   ? "OpenMP runtime"
                        : v->cpu_runtime == DNNL_RUNTIME_TBB ? "TBB runtime"
                        : v->cpu_runtime == DNNL_RUNTIME_SEQ ? "sequential"
                                                             : "other runtime";
  b.onednn_version = fmt::format("{}.{}.{} ({})", v->major, v->minor, v->patch, runtime);
#ifdef _OPENMP
  const int date = _OPENMP;
  const char* spec = date >= 202111   ? "5.2"
                     : date >= 202011 ? "5.1"
                     : date >= 201811 ? "5.0"
                     : date >= 201511 ? "4.5"
                     : date >= 201307 ? "4.0"
                                      : "3.x";
  b.openmp_version = fmt::format("{} ({})", spec, date);
#endif
  b.openmp_threads = omp_get_max_threads();
  return b;
}

}  // namespace headroom::cpu
