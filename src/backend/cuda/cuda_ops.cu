// The CUDA op table's creation (backend/cuda/cuda_ops.h): the process's device, its four streams,
// the cuBLASLt handle and the fixed workspaces, made once per process on first use.
#include <mutex>
#include <string>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_ops_impl.h"
#include "backend/cuda/device_memory.h"

namespace headroom::backend::cuda {

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why) *why = std::string("CUDA runtime: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error of the failed query
    return false;
  }
  if (count == 0) {
    if (why) *why = "CUDA runtime: no CUDA-capable device is detected";
    return false;
  }
  return true;
}

CudaOps::~CudaOps() {
  // The table lives until the process exits, when the driver may already be unloading: the
  // resources go with the context, so nothing is released here.
}

void CudaOps::synchronize() const { HR_CUDA_CHECK(cudaStreamSynchronize(ctx_.compute)); }

namespace {

// The calling thread on `device` for a scope (events are made on, and recorded to streams of,
// the current device; the offload copy thread starts on device 0), restored after.
class OnDevice {
 public:
  explicit OnDevice(int device) {
    HR_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) HR_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~OnDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace

cudaEvent_t CudaOps::take_event_locked() const {
  if (!free_events_.empty()) {
    cudaEvent_t e = free_events_.back();
    free_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  HR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

// Note [Asynchronous copies]: the copy stream waits for an event recorded on the compute stream
// now, so the copy reads (d2h) or overwrites (h2d) what the ops queued before it left there;
// the ops queued after it overlap it. A stream waits on the record made before the wait call,
// so the compute event goes back to the free list at once. wait_copy synchronizes the event
// recorded after the copy (the host side is the caller's again) and makes the compute stream
// wait on it (the ops queued after the wait read the landed bytes, or may overwrite the copied
// source). Pageable host memory makes the runtime stage the copy, and the call returns only
// once it is done; pinned memory (PinnedHostResource) lets it run behind the call.
uint64_t CudaOps::copy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                             cudaStream_t copy_stream) const {
  if (bytes == 0) return 0;
  OnDevice on(ctx_.device);
  std::lock_guard<std::mutex> lock(copy_mu_);
  cudaEvent_t after_compute = take_event_locked();
  cudaEvent_t done = take_event_locked();
  HR_CUDA_CHECK(cudaEventRecord(after_compute, ctx_.compute));
  HR_CUDA_CHECK(cudaStreamWaitEvent(copy_stream, after_compute, 0));
  free_events_.push_back(after_compute);
  HR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, copy_stream));
  HR_CUDA_CHECK(cudaEventRecord(done, copy_stream));
  const uint64_t ticket = next_copy_ticket_++;
  pending_copies_.emplace(ticket, done);
  return ticket;
}

uint64_t CudaOps::copy_to_host_async(void* dst, const void* src, size_t bytes) const {
  return copy_async(dst, src, bytes, cudaMemcpyDeviceToHost, ctx_.d2h);
}

uint64_t CudaOps::copy_to_device_async(void* dst, const void* src, size_t bytes) const {
  return copy_async(dst, src, bytes, cudaMemcpyHostToDevice, ctx_.h2d);
}

void CudaOps::wait_copy(uint64_t ticket) const {
  if (ticket == 0) return;
  OnDevice on(ctx_.device);
  cudaEvent_t done = nullptr;
  {
    std::lock_guard<std::mutex> lock(copy_mu_);
    auto it = pending_copies_.find(ticket);
    HR_CHECK_MSG(it != pending_copies_.end(), "wait_copy: an unknown or already waited ticket");
    done = it->second;
    pending_copies_.erase(it);
  }
  HR_CUDA_CHECK(cudaEventSynchronize(done));
  HR_CUDA_CHECK(cudaStreamWaitEvent(ctx_.compute, done, 0));
  std::lock_guard<std::mutex> lock(copy_mu_);
  free_events_.push_back(done);
}

namespace {

Context make_context() {
  Context c;
  // The process's device (local rank % devices: one GPU per rank of a node), and the context's
  // own bytes measured before the workspaces below are allocated (device_memory.h).
  Result<int> dev = process_device();
  if (!dev.is_ok())
    cuda_fail("process_device()", dev.status().message().c_str(), __FILE__, __LINE__);
  c.device = *dev;
  HR_CUDA_CHECK(cudaSetDevice(c.device));
  if (Result<uint64_t> ctx = context_bytes(); !ctx.is_ok()) {
    cuda_fail("context_bytes()", ctx.status().message().c_str(), __FILE__, __LINE__);
  }
  HR_CUDA_CHECK(cudaGetDeviceProperties(&c.props, c.device));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.compute, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.h2d, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.d2h, cudaStreamNonBlocking));
  HR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.comm, cudaStreamNonBlocking));
  HR_CUBLAS_CHECK(cublasLtCreate(&c.lt));
  c.lt_workspace_bytes = kCublasLtWorkspaceBytes;
  HR_CUDA_CHECK(cudaMalloc(&c.lt_workspace, c.lt_workspace_bytes));
  c.op_workspace_bytes = kOpWorkspaceBytes;
  HR_CUDA_CHECK(cudaMalloc(&c.op_workspace, c.op_workspace_bytes));
  return c;
}

}  // namespace

const Ops* cuda_ops(std::string* why) {
  static std::once_flag once;
  static const CudaOps* ops = nullptr;
  static std::string reason;
  std::call_once(once, [] {
    if (device_available(&reason)) ops = new CudaOps(make_context());
  });
  if (!ops && why) *why = reason;
  return ops;
}

FixedDeviceBytes fixed_device_bytes() {
  return {.cublaslt_workspace = kCublasLtWorkspaceBytes, .op_workspace = kOpWorkspaceBytes};
}

}  // namespace headroom::backend::cuda
