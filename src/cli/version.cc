// `headroom --version` and `headroom version [--json]`.
#include "cli/common.h"

#include <cstdio>

#include <fmt/format.h>

#include "backend/cpu/build_info.h"
#ifdef HEADROOM_HAVE_CUDA
#include "backend/cuda/build_info.h"
#endif
#include "core/data_dir.h"
#include "core/utf8.h"

#ifndef HEADROOM_VERSION
#define HEADROOM_VERSION "0.1.0"
#endif
#ifndef HEADROOM_BUILD_TYPE
#define HEADROOM_BUILD_TYPE "unknown"
#endif

namespace headroom::cli {

namespace {

// "cuda_details": null in a CPU-only build; else what it was built with and whether a device is
// usable here (and the runtime's reason when not). "cuda" stays the boolean "built in".
json cuda_json() {
#ifdef HEADROOM_HAVE_CUDA
  const backend::cuda::CudaBuildInfo c = backend::cuda::build_info();
  json j = {{"toolkit_version", c.toolkit_version},
            {"archs", c.archs},
            {"nccl_version", c.nccl_version},
            {"runtime_version", c.runtime_version},
            {"driver_version", c.driver_version.empty() ? json(nullptr) : json(c.driver_version)},
            {"device_usable", c.device_usable},
            {"device_count", c.device_count}};
  j["device"] = c.device_usable ? json(c.device_name) : json(nullptr);
  j["why_not"] = c.device_usable ? json(nullptr) : json(c.why_not);
  return j;
#else
  return nullptr;
#endif
}

std::string cuda_text(const json& c) {
  if (c.is_null()) return "no (a CPU-only build; `make build-cuda` builds it)";
  std::string archs;
  for (char ch : c["archs"].get<std::string>()) {
    archs += ch == ',' ? std::string(", sm_") : std::string(1, ch);
  }
  return fmt::format(
      "yes: toolkit {}, sm_{}, NCCL {}; {}", c["toolkit_version"].get<std::string>(), archs,
      c["nccl_version"].get<std::string>(),
      c["device_usable"].get<bool>()
          ? fmt::format("device usable here: {} of {}", c["device"].get<std::string>(),
                        c["device_count"].get<int>())
          : fmt::format("no device usable here: {}", c["why_not"].get<std::string>()));
}

}  // namespace

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
#ifdef HEADROOM_HAVE_CUDA
          {"cuda", true},
#else
          {"cuda", false},
#endif
          {"cuda_details", cuda_json()},
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
      j["openmp_threads"].get<int>(), yes("mpi"), cuda_text(j["cuda_details"]), where("gpt2_vocab"),
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
