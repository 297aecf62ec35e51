// Reads cores and memory from /proc and the cgroup (v2, then v1) files.
#include "backend/cpu/device.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/units.h"

namespace headroom::cpu {

namespace {
// Returns 0 when the file is missing or says "max".
uint64_t read_u64(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return 0;
  try {
    return std::stoull(s);
  } catch (...) {
    return 0;
  }
}

uint64_t meminfo_kib(const std::string& key) {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream ss(line.substr(key.size() + 1));
      uint64_t v = 0;
      ss >> v;
      return v;
    }
  }
  return 0;
}

int cgroup_cpus() {
  std::ifstream f("/sys/fs/cgroup/cpu.max");
  std::string quota, period;
  if (f >> quota >> period && quota != "max") {
    double q = std::stod(quota), p = std::stod(period);
    if (p > 0) return std::max(1, int(std::ceil(q / p)));
  }
  return 0;
}
}  // namespace

CpuDeviceInfo query_cpu_device() {
  CpuDeviceInfo info;
  cpu_set_t set;
  int cores = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = int(std::thread::hardware_concurrency());
  if (int cg = cgroup_cpus(); cg > 0) cores = std::min(cores, cg);
  info.cores = std::max(cores, 1);

  uint64_t total = meminfo_kib("MemTotal") * 1024;
  uint64_t avail = meminfo_kib("MemAvailable") * 1024;
  uint64_t limit = read_u64("/sys/fs/cgroup/memory.max");
  uint64_t usage = read_u64("/sys/fs/cgroup/memory.current");
  if (limit == 0) {
    limit = read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    usage = read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes");
    if (limit > (uint64_t(1) << 60)) limit = 0;  // v1 reports "unlimited" as a huge number
  }
  info.total_bytes = total;
  info.available_bytes = avail;
  std::string note;
  if (limit > 0 && limit < total) {
    info.total_bytes = limit;
    info.available_bytes = std::min(avail, limit > usage ? limit - usage : 0);
    note = " (cgroup limit " + format_bytes(limit) + ")";
  }
  info.description = std::to_string(info.cores) + " cores, " + format_bytes(info.available_bytes) +
                     " available" + note;
  return info;
}

uint64_t default_device_budget(const CpuDeviceInfo& info) {
  uint64_t margin = std::max<uint64_t>(info.available_bytes / 10, 512 * kMiB);
  return info.available_bytes > margin ? info.available_bytes - margin : 0;
}

}  // namespace headroom::cpu
