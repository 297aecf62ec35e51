// ZeRO memory and traffic arithmetic. Kept free of dist/ (a sibling layer): the shard size is
// passed in, or recomputed with the same rule as dist::shard_floats.
#include "plan/zero.h"

#include "core/check.h"

namespace headroom::plan {
namespace {

int64_t shard_of(const ZeroSpec& s) {
  if (s.shard_floats > 0) return s.shard_floats;
  const int64_t per = (s.param_floats + s.ranks - 1) / s.ranks;
  return (per + 15) / 16 * 16;  // dist::kShardAlign
}

// Bytes one rank sends in a ring collective over `bytes` (the whole buffer).
int64_t ring_share(int64_t bytes, int ranks) { return bytes * (ranks - 1) / ranks; }

}  // namespace

ZeroMemory zero_memory(const ZeroSpec& s) {
  HR_CHECK(s.stage >= 0 && s.stage <= 3 && s.ranks >= 1 && s.param_floats >= 0);
  const int64_t P = s.param_floats;
  const int64_t S = s.stage == 0 ? P : shard_of(s);
  const int64_t grad_window = s.grad_window_floats > 0 ? s.grad_window_floats : P;
  ZeroMemory m;
  m.params = s.stage < 3 ? P * s.param_bytes : (S + s.gather_window_floats) * s.param_bytes;
  m.master = s.master ? S * 4 : 0;
  m.grads = (s.stage <= 1 ? P : grad_window) * s.grad_bytes;
  m.grad_shard = s.stage == 0 ? 0 : S * 4;
  m.optimizer = 2 * S * 4;
  if (s.offload_optimizer) {
    // Master, m, v and the gradient copy the host update reads: 16 bytes a shard float.
    m.offloaded = 16 * S;
    m.master = 0;
    m.optimizer = 0;
  }
  return m;
}

int64_t offload_link_bytes(const ZeroSpec& s) {
  if (!s.offload_optimizer) return 0;
  const int64_t S = s.stage == 0 ? s.param_floats : shard_of(s);
  return S * 4 + S * s.offload_return_bytes;
}

ZeroTraffic zero_traffic(const ZeroSpec& s) {
  HR_CHECK(s.stage >= 0 && s.stage <= 3 && s.ranks >= 1 && s.micro_batches >= 1);
  ZeroTraffic t;
  if (s.ranks == 1) return t;
  const int64_t grads = s.param_floats * s.grad_bytes;
  const int64_t params = s.param_floats * s.param_bytes;
  // With a gradient window smaller than the buffer (stages 2-3 after integration), gradients
  // cannot accumulate over micro-batches locally: each micro-batch reduce-scatters its own.
  const int64_t rs_times = s.stage >= 2 && s.grad_window_floats > 0 ? s.micro_batches : 1;
  switch (s.stage) {
    case 0:
      t.all_reduce = 2 * ring_share(grads, s.ranks);
      break;
    case 1:
    case 2:
      t.reduce_scatter = rs_times * ring_share(grads, s.ranks);
      t.all_gather = ring_share(params, s.ranks);
      break;
    default:  // forward and backward each gather every unit, once per micro-batch
      t.reduce_scatter = rs_times * ring_share(grads, s.ranks);
      t.all_gather = 2 * int64_t(s.micro_batches) * ring_share(params, s.ranks);
      break;
  }
  return t;
}

double zero_comm_seconds(const ZeroSpec& spec, double bytes_per_s) {
  HR_CHECK(bytes_per_s > 0);
  return double(zero_traffic(spec).total()) / bytes_per_s;
}

}  // namespace headroom::plan
