// The datasheet table behind named_device(). Figures are dense (no 2:4 sparsity: NVIDIA's
// headline tensor numbers are doubled by it and no dense training GEMM sees them).
#include "plan/device_spec.h"

#include <array>
#include <cctype>
#include <string>
#include <utility>

namespace headroom::plan {
namespace {

constexpr double kT = 1e12;  // TFLOP/s or TB/s
constexpr double kG = 1e9;   // GB/s
constexpr uint64_t kMiBytes = 1024ull * 1024ull;

// Host link, one direction, theoretical: lanes x transfer rate x 128/130 encoding. Datasheets
// quote both directions added ("PCIe Gen4: 64GB/s"); an offload copy uses one direction at a
// time, and pinned copies reach about 80% of these.
constexpr double kPcie3x16 = 15.75 * kG;
constexpr double kPcie4x16 = 31.5 * kG;
constexpr double kPcie5x16 = 63.0 * kG;

// Interconnect between devices (DeviceSpec::interconnect_bandwidth): one direction of the link,
// times 0.8 for what a ring collective sustains (the share pinned copies reach, above; NCCL's
// all-reduce bus bandwidth on A100/H100 SXM systems is reported at about that share of the
// per-direction NVLink rate). SXM parts: NVLink, whose datasheet figure adds both directions
// (A100: 600 GB/s, NVLink 3; H100/H200: 900 GB/s, NVLink 4). PCIe cards without NVLink (L4, T4)
// talk peer to peer over PCIe. GeForce RTX 40 cards have no peer-to-peer: collectives are staged
// through host memory, so each byte crosses PCIe twice: half the PCIe figure.
constexpr double kRing = 0.8;
constexpr double kNvlink3 = 600.0 / 2 * kG * kRing;  // 240 GB/s
constexpr double kNvlink4 = 900.0 / 2 * kG * kRing;  // 360 GB/s

// gemm_efficiency: the share of the dense peak that the large GEMMs of transformer training
// sustain, GEMM-bound layers only (attention, norms and the optimizer are priced by bandwidth).
// Peaks assume boost clocks; sustained tensor-core load runs below them at the power limit,
// and cuBLAS reaches 70-85% of peak on large square shapes but less on the narrower shapes of
// small models (llm.c: ~59% MFU for GPT-2 124M on A100, REFERENCES.md). So: 0.70 where the power
// budget is generous (A100, RTX 4090), 0.65 for H100/H200 (700 W caps clocks below the 1.98 GHz
// the 989 TFLOP/s assume), 0.60 for the 70-72 W cards (L4, T4), whose clocks drop furthest.
//
// memory_bytes: the total the driver reports (nvidia-smi memory.total, in MiB), i.e. the label
// after the ECC/firmware reservation. The CUDA context is not subtracted here: it is counted in
// every plan as DeviceSpec::backend_fixed (context_estimate below).
const std::array<DeviceSpec, 7>& table() {
  static const std::array<DeviceSpec, 7> kTable = {{
      // NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4, 2021),
      // "A100 40GB SXM": FP32 19.5 TF, BF16/FP16 tensor 312 TF (624 sparse), HBM2 1,555 GB/s,
      // PCIe Gen4 64 GB/s (both directions). nvidia-smi: 40960 MiB.
      {"A100-40GB", "gpu", 40960 * kMiBytes, 19.5 * kT, 312 * kT, 312 * kT, 1555 * kG, kPcie4x16,
       0.70, "NVIDIA A100 datasheet (2021), A100 40GB SXM", kNvlink3},
      // Same datasheet, "A100 80GB SXM": HBM2e 2,039 GB/s; compute as above. nvidia-smi: 81920
      // MiB.
      {"A100-80GB", "gpu", 81920 * kMiBytes, 19.5 * kT, 312 * kT, 312 * kT, 2039 * kG, kPcie4x16,
       0.70, "NVIDIA A100 datasheet (2021), A100 80GB SXM", kNvlink3},
      // NVIDIA H100 Tensor Core GPU datasheet (2023), "H100 SXM": FP32 67 TF, BF16/FP16 tensor
      // 1,979 TF with sparsity = 989.4 dense (H100 architecture whitepaper), HBM3 3.35 TB/s,
      // PCIe Gen5 128 GB/s (both directions). nvidia-smi: 81559 MiB.
      {"H100-80GB", "gpu", 81559 * kMiBytes, 67 * kT, 989.4 * kT, 989.4 * kT, 3.35 * kT, kPcie5x16,
       0.65, "NVIDIA H100 datasheet (2023), H100 SXM", kNvlink4},
      // NVIDIA H200 Tensor Core GPU datasheet (2024), "H200 SXM": 141 GB HBM3e at 4.8 TB/s; FP32
      // 67 TF, BF16/FP16 tensor 1,979 TF with sparsity = 989.4 dense (the H100's GH100 die),
      // PCIe Gen5 128 GB/s (both directions). nvidia-smi: 143771 MiB.
      {"H200", "gpu", 143771 * kMiBytes, 67 * kT, 989.4 * kT, 989.4 * kT, 4.8 * kT, kPcie5x16, 0.65,
       "NVIDIA H200 datasheet (2024), H200 SXM", kNvlink4},
      // NVIDIA L4 Tensor Core GPU datasheet (2023): 24 GB GDDR6 at 300 GB/s, FP32 30.3 TF,
      // BF16/FP16 tensor 242 TF with sparsity = 121 dense, PCIe Gen4 x16 64 GB/s (both
      // directions), 72 W. nvidia-smi: 23034 MiB.
      {"L4", "gpu", 23034 * kMiBytes, 30.3 * kT, 121 * kT, 121 * kT, 300 * kG, kPcie4x16, 0.60,
       "NVIDIA L4 datasheet (2023)", kPcie4x16 * kRing},
      // NVIDIA Ada GPU architecture whitepaper (v2.1), appendix table for GeForce RTX 4090:
      // FP32 82.6 TF; tensor BF16 and FP16 with FP32 accumulate 165.2 TF dense (GeForce runs
      // FP32 accumulate at half the FP16-accumulate rate of 330.3; training accumulates in
      // FP32); 24 GB GDDR6X at 1,008 GB/s; PCIe Gen4 x16. nvidia-smi: 24564 MiB.
      {"RTX-4090", "gpu", 24564 * kMiBytes, 82.6 * kT, 165.2 * kT, 165.2 * kT, 1008 * kG, kPcie4x16,
       0.70, "NVIDIA Ada GPU architecture whitepaper v2.1, GeForce RTX 4090",
       kPcie4x16 * kRing / 2},
      // NVIDIA T4 Tensor Core GPU datasheet (2019): 16 GB GDDR6 at 320 GB/s, FP32 8.1 TF, mixed
      // FP16/FP32 tensor 65 TF, no BF16 (Turing), PCIe Gen3 x16 32 GB/s (both directions), 70 W.
      // nvidia-smi: 15360 MiB (ECC on, the default).
      {"T4", "gpu", 15360 * kMiBytes, 8.1 * kT, 0, 65 * kT, 320 * kG, kPcie3x16, 0.60,
       "NVIDIA T4 datasheet (2019)", kPcie3x16 * kRing},
  }};
  return kTable;
}

// The CUDA context's device bytes by GPU generation, before any allocation, with lazy module
// loading (CUDA_MODULE_LOADING=LAZY, the default on Linux since CUDA 12.2). No datasheet states
// them: these are estimates of the total - free that a fresh runtime context shows, rounded up
// (the driver's per-context reservations grow with the SM count: local memory, printf and the
// device heap, the kernels of the loaded modules). tests/cuda's ContextBytes test prints the
// measured figure (backend::cuda::context_bytes) on a machine with the GPU; scripts/gpu-check
// records it in its summary, so that the figure here can be replaced by a measurement.
std::pair<uint64_t, const char*> context_estimate(std::string_view name) {
  if (name.starts_with("H100") || name.starts_with("H200")) {
    return {512 * kMiBytes, "estimate for a Hopper context with lazy loading"};
  }
  if (name.starts_with("A100")) return {448 * kMiBytes, "estimate for an Ampere context"};
  if (name == "L4" || name == "RTX-4090") return {384 * kMiBytes, "estimate for an Ada context"};
  return {320 * kMiBytes, "estimate for a Turing context"};  // T4
}

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

double offload_link_bandwidth(const DeviceSpec& d) {
  if (d.offload_bandwidth > 0) return d.offload_bandwidth;
  return d.kind == "gpu" ? d.host_link_bandwidth * 0.8 : d.host_link_bandwidth;
}

Result<DeviceSpec> named_device(std::string_view name) {
  for (const DeviceSpec& spec : table()) {
    if (iequals(spec.name, name)) {
      DeviceSpec out = spec;
      if (out.host_memory_bandwidth <= 0) out.host_memory_bandwidth = kAssumedHostBandwidth;
      const auto [context, source] = context_estimate(out.name);
      out.backend_fixed = cuda_fixed_bytes(context, source);
      return out;
    }
  }
  std::string known;
  for (const std::string& n : named_device_names()) {
    if (!known.empty()) known += ", ";
    known += n;
  }
  return Status::not_found("unknown device '" + std::string(name) + "'; known devices: " + known +
                           " (or 'cpu' for this machine, measured by `headroom calibrate`)");
}

std::vector<std::string> named_device_names() {
  std::vector<std::string> names;
  for (const DeviceSpec& spec : table()) names.push_back(spec.name);
  return names;
}

}  // namespace headroom::plan
