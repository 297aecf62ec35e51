// What this build of the CPU backend was compiled with and what the CPU it runs on offers, for
// `headroom --version` and `headroom version --json` (a bug report's first lines).
#pragma once

#include <string>

namespace headroom::cpu {

struct BuildInfo {
  std::string compiler;                  // "GCC 12.2.0", "clang 14.0.6"
  bool avx512_kernels_compiled = false;  // the AVX-512 kernels (HR_AVX512_KERNELS: -march)
  bool avx512_detected = false;          // AVX-512 F/BW/VL/DQ on this CPU
  bool avx512_bf16_detected = false;     // AVX512-BF16 on this CPU (bf16 GEMMs, attention)
  bool amx_kernels_compiled = false;     // the AMX-BF16 GEMM and attention kernels (x86-64)
  bool amx_detected = false;             // AMX usable here (CPU and the kernel's permission)
  std::string onednn_version;            // the loaded library's: "2.7.3 (OpenMP runtime)"
  std::string openmp_version;            // the compiler's OpenMP: "4.5 (201511)"
  int openmp_threads = 0;                // omp_get_max_threads() now
};

// Reads the CPU (CPUID, once) and the loaded oneDNN; cheap.
BuildInfo build_info();

}  // namespace headroom::cpu
