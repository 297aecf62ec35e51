// What the CUDA backend was built with and what this machine offers of it, for `headroom
// --version` and `headroom version --json` (no CUDA headers here: the CLI includes it).
// Compiled only with -DHEADROOM_CUDA=ON (HEADROOM_HAVE_CUDA).
#pragma once

#include <string>

namespace headroom::backend::cuda {

struct CudaBuildInfo {
  std::string toolkit_version;  // the toolkit compiled against: "13.0" (CUDART_VERSION)
  std::string archs;            // the architectures compiled: "80,90" (CMAKE_CUDA_ARCHITECTURES)
  std::string nccl_version;     // the NCCL linked: "2.28.9" (ncclGetVersion)
  std::string runtime_version;  // cudaRuntimeGetVersion: "13.0"
  std::string driver_version;   // the CUDA version the driver supports ("" without a driver)
  bool device_usable = false;   // device_available()
  std::string why_not;          // the runtime's reason when not usable
  std::string device_name;      // the process's device when usable: "NVIDIA H200"
  int device_count = 0;
};

// Reads the runtime and the driver; initialises the runtime (not a context) when a device is
// present. Cheap.
CudaBuildInfo build_info();

}  // namespace headroom::backend::cuda
