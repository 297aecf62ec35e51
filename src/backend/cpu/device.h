// What the CPU "device" offers: cores and memory, cgroup limits respected. On the CPU backend the
// device memory is host memory under a budget (DESIGN.md principle 5).
#pragma once

#include <cstdint>
#include <string>

namespace headroom::cpu {

struct CpuDeviceInfo {
  int cores = 1;                 // usable cores (affinity mask and cgroup cpu.max)
  uint64_t total_bytes = 0;      // physical memory or the cgroup's memory.max, the smaller
  uint64_t available_bytes = 0;  // MemAvailable or the cgroup's headroom, the smaller
  std::string description;       // "2 cores, 23.4 GiB available (cgroup limit 24.0 GiB)"
};

CpuDeviceInfo query_cpu_device();

// The default --device-memory: what is available now, less a margin for the process itself
// (code, libraries, the data loader's file mappings): 10% or 512 MiB, the larger.
uint64_t default_device_budget(const CpuDeviceInfo& info);

}  // namespace headroom::cpu
