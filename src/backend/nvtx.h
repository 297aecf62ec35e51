// NVTX ranges (Nsight Systems' timeline rows) for the executor's ops, phases, micro-batches and
// steps: a push/pop pair of the calling thread's range stack when the build has CUDA, nothing
// at all when it does not (the CPU build keeps no NVTX dependency and pays nothing).
// Without a tool attached, nvtxRangePushA costs a branch on an uninitialised function pointer.
#pragma once

#if defined(HEADROOM_HAVE_CUDA)
#include <nvtx3/nvToolsExt.h>
#endif

namespace headroom::backend::nvtx {

#if defined(HEADROOM_HAVE_CUDA)
inline constexpr bool kEnabled = true;
inline void push(const char* name) { nvtxRangePushA(name); }
inline void pop() { nvtxRangePop(); }
#else
inline constexpr bool kEnabled = false;
inline void push(const char*) {}
inline void pop() {}
#endif

// A range for the scope: "step 12", "micro-batch 3", "optimizer". REQUIRES: it ends on the thread
// that began it (NVTX's push/pop ranges are per thread), which a scope guarantees.
class Range {
 public:
  explicit Range(const char* name) { push(name); }
  ~Range() { pop(); }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;
};

}  // namespace headroom::backend::nvtx
