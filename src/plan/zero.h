// ZeRO's per-rank memory and per-step communication volume, as pure functions of byte counts,
// for the planner's search over sharding stages (see docs/notes/zero.md).
#pragma once

#include <cstdint>

namespace headroom::plan {

struct ZeroSpec {
  int stage = 0;  // 0-3
  int ranks = 1;
  // The flat parameter buffer (ParamTable::total_floats, padding included).
  int64_t param_floats = 0;
  // The largest rank's shard (dist::ShardLayout::max_local_floats()); 0 = the flat one-unit
  // layout's ceil(param_floats / ranks) rounded up to 16 floats.
  int64_t shard_floats = 0;
  // Bytes per element of the working parameters and gradients (4 fp32, 2 bf16/fp16).
  int param_bytes = 4;
  int grad_bytes = 4;
  // Mixed precision keeps an fp32 master copy (full in stage 0, a shard in stages 1-3).
  bool master = false;
  // The working gradient buffer backward writes (floats). 0 = the whole buffer, which stages 0
  // and 1 always need (the accumulation buffer) and which the current executor uses for 2-3;
  // a per-bucket window makes it smaller for stages 2-3 after integration (and then each
  // micro-batch reduce-scatters its gradients: zero_traffic counts micro_batches of them).
  int64_t grad_window_floats = 0;
  // Stage 3: floats of gathered units live at once: the current unit plus the prefetched one
  // (twice the largest unit) once the model reads per-unit windows; the whole buffer with the
  // current executor, which binds one full-size parameter buffer. Ignored for stages 0-2.
  int64_t gather_window_floats = 0;
  // Micro-batches per optimizer step (stage 3 gathers the parameters in each micro-batch's
  // forward and backward).
  int micro_batches = 1;
  // Optimizer offload (docs/notes/offload.md): the fp32 master weights, m and v of this rank's
  // shard, and a copy of its reduced gradient that the host update reads, live in the offload
  // tier (16 bytes a shard float); the device keeps the working parameters and the gradients.
  bool offload_optimizer = false;
  // Bytes per float of the updated weights copied back to the device after the host update: the
  // working copy's dtype (4 for fp32, and for the CPU executor's bf16, which keeps fp32 working
  // weights and casts its bf16 copy on the device; 2 where the device holds bf16 weights only).
  int offload_return_bytes = 4;
};

// Bytes per rank by category (the plan's weights, master, grads, optimizer).
struct ZeroMemory {
  int64_t params = 0;      // working parameters: full (0-2), or the shard plus gather window (3)
  int64_t master = 0;      // fp32 master weights (mixed precision only)
  int64_t grads = 0;       // the working gradient buffer
  int64_t grad_shard = 0;  // the reduced fp32 gradient shard (stages 1-3)
  int64_t optimizer = 0;   // AdamW m and v, fp32
  // With offload_optimizer: bytes in the offload tier (not on the device, not in total()):
  // master 4 S, m and v 8 S, the gradient copy 4 S; master and optimizer above are then 0.
  int64_t offloaded = 0;
  int64_t total() const { return params + master + grads + grad_shard + optimizer; }
};
ZeroMemory zero_memory(const ZeroSpec& spec);

// Bytes each rank sends per optimizer step, by collective, with the bandwidth-optimal (ring)
// algorithms: all-reduce of N bytes sends 2(R-1)/R x N, reduce-scatter and all-gather
// (R-1)/R x N each. The gradient-norm all-reduce (8 bytes) and agree() are left out.
struct ZeroTraffic {
  int64_t all_reduce = 0;
  int64_t reduce_scatter = 0;
  int64_t all_gather = 0;
  int64_t total() const { return all_reduce + reduce_scatter + all_gather; }
};
ZeroTraffic zero_traffic(const ZeroSpec& spec);

// Seconds of communication per step at `bytes_per_s` per rank (a calibrated all-reduce bus
// bandwidth), without overlap. 0 for one rank.
double zero_comm_seconds(const ZeroSpec& spec, double bytes_per_s);

// Optimizer offload's traffic over the host link per optimizer step, per rank: the reduced
// gradient shard to the offload tier (4 S) and the updated weights back (offload_return_bytes
// x S). 0 without offload.
int64_t offload_link_bytes(const ZeroSpec& spec);

}  // namespace headroom::plan
