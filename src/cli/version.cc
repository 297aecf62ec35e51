// `headroom --version` and `headroom version [--json]`.
#include "cli/common.h"

#include <cstdio>

#include <fmt/format.h>

#include "backend/cpu/build_info.h"
#include "core/data_dir.h"
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
  // Where each data file was found (core/data_dir.h), or null with the places looked at.
  json data = json::object();
  for (auto [key, item] :
       {std::pair{"gpt2_vocab", DataItem::kGpt2Vocab}, std::pair{"chart_lib", DataItem::kChartLib},
        std::pair{"configs", DataItem::kConfigs}}) {
    Result<DataCandidate> found = find_data(item);
    json looked = json::array();
    for (const DataCandidate& c : data_candidates(item)) looked.push_back(c.path);
    data[key] = {{"path", found.is_ok() ? json(found->path) : json(nullptr)},
                 {"origin", found.is_ok() ? json(found->origin) : json(nullptr)},
                 {"looked_in", looked}};
  }
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
          {"cuda", false},
          {"data", data}};
}

std::string version_text() {
  const json j = version_json();
  auto yes = [&](const char* key) { return j[key].get<bool>() ? "yes" : "no"; };
  auto where = [&](const char* key) {
    const json& d = j["data"][key];
    return d["path"].is_null() ? std::string("not found (headroom version --json: where it looked)")
                               : fmt::format("{} ({})", d["path"].get<std::string>(),
                                             d["origin"].get<std::string>());
  };
  return fmt::format(
      "headroom {}\n"
      "  built with {} ({} build)\n"
      "  AVX-512 kernels: compiled {}, this CPU {} (AVX512-BF16 {})\n"
      "  AMX kernels: compiled {}, usable on this CPU {}\n"
      "  oneDNN {}\n"
      "  OpenMP {}, {} threads\n"
      "  MPI: {}\n"
      "  CUDA: {}\n"
      "  data: GPT-2 vocabulary {}, Chart.js {}",
      j["version"].get<std::string>(), j["compiler"].get<std::string>(),
      j["build_type"].get<std::string>(), yes("avx512_kernels_compiled"), yes("avx512_detected"),
      yes("avx512_bf16_detected"), yes("amx_kernels_compiled"), yes("amx_detected"),
      j["onednn_version"].get<std::string>(), j["openmp_version"].get<std::string>(),
      j["openmp_threads"].get<int>(), yes("mpi"), yes("cuda"), where("gpt2_vocab"),
      where("chart_lib"));
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
