// The CUDA backend's entry points, for code that must not include CUDA's headers (the CLI, the
// trainer, the tests' skip checks). Compiled only with -DHEADROOM_CUDA=ON (HEADROOM_HAVE_CUDA).
#pragma once

#include <cstddef>
#include <string>

#include "backend/ops.h"

namespace headroom::backend::cuda {

// Whether a CUDA device can be used by this process; when not, *why says what the runtime said
// ("no CUDA-capable device is detected", "CUDA driver version is insufficient", ...).
bool device_available(std::string* why = nullptr);

// The CUDA op table of device 0 (created on the first call: streams, the cuBLASLt handle and the
// fixed workspaces), or null with *why when no device can be used.
const Ops* cuda_ops(std::string* why = nullptr);

// Whether fp32 GEMMs may round their operands to TF32 on tensor cores (process-wide; default
// false: fp32 GEMMs compute in fp32, as the CPU's). f16 GEMMs take TF32 whatever this says.
void set_allow_tf32(bool allow);
bool allow_tf32();

// The bytes the backend holds on the device outside the plan's arenas, for the planner and the
// startup table: the cuBLASLt workspace and the ops' fixed reduction workspace. (The CUDA
// context's own bytes are measured at start-up: context_bytes.)
struct FixedDeviceBytes {
  size_t cublaslt_workspace = 0;
  size_t op_workspace = 0;
};
FixedDeviceBytes fixed_device_bytes();

}  // namespace headroom::backend::cuda
