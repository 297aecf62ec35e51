// `headroom --version` and `headroom version [--json]`.
#include "cli/common.h"

#include <cstdio>

#include <fmt/format.h>

#include "backend/cpu/build_info.h"
#include "core/utf8.h"

#ifndef HEADROOM_VERSION
#define HEADROOM_VERSION "0.1.0"
#endif
#ifndef HEADROOM_BUILD_TYPE
#define HEADROOM_BUILD_TYPE "unknown"
#endif

namespace headroom::cli {

// `headroom --version` and `headroom version [--json]`: the version, what it was built with and
// what this machine offers of it (the first lines of a bug report).
json version_json() {
  const cpu::BuildInfo b = cpu::build_info();
#ifdef HEADROOM_HAVE_MPI
  const bool mpi = true;
#else
  const bool mpi = false;
#endif
  return {{"version", HEADROOM_VERSION},
          {"compiler", b.compiler},
          {"build_type", HEADROOM_BUILD_TYPE},
          {"avx512_kernels_compiled", b.avx512_kernels_compiled},
          {"avx512_detected", b.avx512_detected},
          {"avx512_bf16_detected", b.avx512_bf16_detected},
          {"amx_kernels_compiled", b.amx_kernels_compiled},
          {"amx_detected", b.amx_detected},
          {"onednn_version", b.onednn_version},
          {"openmp_version", b.openmp_version},
          {"openmp_threads", b.openmp_threads},
          {"mpi", mpi},
          {"cuda", false}};
}

std::string version_text() {
  const json j = version_json();
  auto yes = [&](const char* key) { return j[key].get<bool>() ? "yes" : "no"; };
  return fmt::format(
      "headroom {}\n"
      "  built with {} ({} build)\n"
      "  AVX-512 kernels: compiled {}, this CPU {} (AVX512-BF16 {})\n"
      "  AMX kernels: compiled {}, usable on this CPU {}\n"
      "  oneDNN {}\n"
      "  OpenMP {}, {} threads\n"
      "  MPI: {}\n"
      "  CUDA: {}",
      j["version"].get<std::string>(), j["compiler"].get<std::string>(),
      j["build_type"].get<std::string>(), yes("avx512_kernels_compiled"), yes("avx512_detected"),
      yes("avx512_bf16_detected"), yes("amx_kernels_compiled"), yes("amx_detected"),
      j["onednn_version"].get<std::string>(), j["openmp_version"].get<std::string>(),
      j["openmp_threads"].get<int>(), yes("mpi"), yes("cuda"));
}

int run_version(bool as_json) {
  if (as_json) {
    std::printf("%s\n", dump_json(version_json(), 2).c_str());
  } else {
    std::printf("%s\n", version_text().c_str());
  }
  return 0;
}

}  // namespace headroom::cli
