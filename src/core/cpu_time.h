// CPU time of this process (all its threads), for breakdowns that should not count the time the
// threads waited to be scheduled: on a shared host wall time moves by 1.4-2x within minutes
// while the work done does not (docs/calibration.md).
#pragma once

#include <ctime>

namespace headroom {

// Milliseconds of CPU time this process's threads have used (CLOCK_PROCESS_CPUTIME_ID); 0 if the
// clock cannot be read. Differences only: the origin is the process start.
inline double process_cpu_ms() {
  timespec t{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t) != 0) return 0.0;
  return double(t.tv_sec) * 1e3 + double(t.tv_nsec) * 1e-6;
}

}  // namespace headroom
