// What a device can do, in the units the cost model prices with: bytes, FLOP/s, bytes/s. Named
// GPUs come from a table of public datasheets so that `headroom plan --device H100-80GB` works
// without the GPU; the CPU's figures are measured (plan/calibrate.h, cpu_device_spec()).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "plan/cost_terms.h"
#include "plan/fixed_bytes.h"

namespace headroom::plan {

// A plain value type. Every rate is a peak (datasheet) or a measured sustained figure; the cost
// model multiplies datasheet peaks by gemm_efficiency to get what a large GEMM sustains.
// A FLOP/s field of 0 means the device has no kernels for that precision (e.g. bf16 on a T4, fp16
// on the CPU backend): the planner must not choose it.
struct DeviceSpec {
  std::string name;                // "H100-80GB", "cpu"
  std::string kind;                // "cpu" or "gpu"
  uint64_t memory_bytes = 0;       // device memory as labelled (GPU: label in GiB; CPU: the budget)
  double flops_fp32 = 0;           // FLOP/s, dense fp32 (CUDA cores on a GPU; no TF32)
  double flops_bf16 = 0;           // FLOP/s, dense bf16 tensor-core math with fp32 accumulate
  double flops_fp16 = 0;           // FLOP/s, dense fp16 tensor-core math with fp32 accumulate
  double mem_bandwidth = 0;        // bytes/s, device memory (HBM/GDDR; CPU: STREAM triad)
  double host_link_bandwidth = 0;  // bytes/s, one direction device<->host (PCIe/NVLink-C2C);
                                   // CPU: memcpy between two host pools
  double gemm_efficiency = 1;      // fraction of the FLOP/s above that a large transformer GEMM
                                   // sustains; 1 for measured CPU figures (already sustained)
  std::string source;              // "measured YYYY-MM-DD" or the datasheet it comes from
  // bytes/s, per rank, that a ring collective between devices of this kind sustains (NCCL's "bus
  // bandwidth": one direction of the link). The planner prices ZeRO's traffic with it. 0: no
  // figure (the planner refuses --devices above 1).
  double interconnect_bandwidth = 0;
  // bytes/s, the host memory bandwidth this device's share of the host sustains (STREAM triad):
  // what optimizer offload's AdamW pass on the host runs at (docs/notes/offload.md). CPU: the
  // measured triad (mem_bandwidth). Named GPUs: kAssumedHostBandwidth unless set.
  double host_memory_bandwidth = 0;
  // bytes/s, one direction, that offload copies (device <-> offload tier) sustain, when known
  // better than offload_link_bandwidth() derives it from the host link (tests, a measurement).
  // 0: derived.
  double offload_bandwidth = 0;
  // FLOP/s of the best GEMM this device runs (a large square one): what MFU is quoted against.
  // 0: the flops_* figures are the peak (the datasheet figures of a named GPU).
  double peak_flops_fp32 = 0;
  double peak_flops_bf16 = 0;
  // The measured terms of each kind of op (plan/cost_terms.h; `headroom calibrate`). When fitted,
  // the cost model prices a CPU step with them instead of the rates above.
  CostTerms terms = {};
  // A run's measurement of itself (self-correction), applied on top of either model.
  CostCorrection correction = {};
  // What the backend holds on the device outside the plan's arenas (plan/fixed_bytes.h): for a
  // named GPU the CUDA context, the cuBLASLt and op workspaces; none on the CPU backend. Every
  // plan for the device counts them (Policy::backend_fixed).
  BackendFixedBytes backend_fixed = {};
};

// The host memory bandwidth assumed for a named GPU's share of its server (no datasheet gives
// it): a two-socket server's triad of about 2 x 150 GB/s shared by 4-8 GPUs, about 50 GB/s each.
constexpr double kAssumedHostBandwidth = 50e9;

// The bandwidth an offload copy (device <-> offload tier) moves at: the host link's one-direction
// figure, times 0.8 on a GPU for what pinned copies sustain (cudaMemcpyAsync over PCIe reaches
// 80-90% of the link); on the CPU the measured memcpy bandwidth itself. DeviceSpec::
// offload_bandwidth, when set, instead. 0: offload cannot be priced (the planner never chooses it).
// Both kinds of offload (optimizer state, activations) are priced with it.
double offload_link_bandwidth(const DeviceSpec& device);

// The spec of a named GPU from the datasheet table. Case-insensitive ("h100-80gb" works).
// Returns NotFound, with every known name in the message, for a name not in the table.
Result<DeviceSpec> named_device(std::string_view name);

// The names in the table, in table order (for --help and error messages).
std::vector<std::string> named_device_names();

}  // namespace headroom::plan
