// Optimizer offload: the offload tier's regions and the optimizer step on them (offload.h).
#include "train/offload.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "backend/cpu/kernels.h"
#include "core/check.h"
#include "core/units.h"
#include "train/zero.h"

namespace headroom::train {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// A copy between the device and the offload tier: the table's. On the CPU backend both are host
// memory and the copy is one memcpy on one thread, like one copy engine, and like the copy
// `headroom calibrate` measures (DeviceSpec::host_link_bandwidth), so the cost model prices the
// copy that runs. On a GPU it is the copy over the host link.
void OptimizerOffload::to_offload(float* dst, const float* device_src, int64_t n) const {
  ops_->copy_to_host(dst, device_src, size_t(n) * sizeof(float));
}

void OptimizerOffload::to_device(float* device_dst, const float* src, int64_t n) const {
  ops_->copy_to_device(device_dst, src, size_t(n) * sizeof(float));
}

Result<std::unique_ptr<OptimizerOffload>> OptimizerOffload::create(
    const plan::MemoryPlan& plan, const OffloadTier& tier, dist::Communicator* comm, int stage,
    const dist::ShardLayout* layout, const backend::Ops& ops) {
  HR_CHECK_MSG(plan.policy.offload_optimizer, "OptimizerOffload: a plan without optimizer offload");
  if (stage < 0 || stage > 3) {
    return Status::invalid_argument(
        fmt::format("optimizer offload with ZeRO-{}: expected a stage of 0-3", stage));
  }
  // By name: the tier may hold the offloaded activations' region too.
  const memory::Arena* master = tier.arena(plan::kOffloadMasterRegion);
  const memory::Arena* moments = tier.arena(plan::kOffloadOptimizerRegion);
  const memory::Arena* grads = tier.arena(plan::kOffloadGradientsRegion);
  HR_CHECK_MSG(master && moments && grads,
               "OptimizerOffload: the offload tier has no optimizer offload regions");
  std::unique_ptr<OptimizerOffload> o(
      new OptimizerOffload(comm, &plan.params, stage, layout, &ops));
  o->master_ = master->f32(0);
  o->m_ = moments->f32(0);
  o->v_ = moments->f32(1);
  o->grads_ = grads->f32(0);
  o->shard_floats_ =
      plan::offload_region(plan, plan::kOffloadMasterRegion)->buffers.at(0).shape.numel();
  HR_CHECK_MSG(o->piece_floats() <= o->shard_floats_, "the plan's offload shard is too small");
  // The padding past this rank's piece stays zero: AdamW never touches it.
  cpu::zero(o->master(), o->shard_floats_);
  cpu::zero(o->m(), o->shard_floats_);
  cpu::zero(o->v(), o->shard_floats_);
  cpu::zero(o->grads(), o->shard_floats_);
  return o;
}

void OptimizerOffload::set_upload_chunk_floats(int64_t n) {
  HR_CHECK_MSG(n > 0 && n % 64 == 0, "upload chunk: a positive multiple of 64 floats");
  upload_chunk_ = n;
}

int64_t OptimizerOffload::upload_chunk_floats() const {
  if (upload_chunk_ > 0) return upload_chunk_;
  return ops_->host_addressable() ? 0 : kDefaultUploadChunkFloats;  // 0: one piece
}

int64_t OptimizerOffload::piece_floats() const {
  // Stage 3: the whole local shard (each unit's piece at its local offset, padding included).
  return stage_ == 0  ? table_->total_floats
         : stage_ < 3 ? layout_->piece(0).size()
                      : layout_->local_floats();
}

// Where this rank's piece starts in the device parameters the trainer passes: the full buffer
// (stages 0-2) or, at stage 3, the device's own shard (local coordinates).
int64_t OptimizerOffload::device_begin() const {
  return stage_ == 0 || stage_ == 3 ? 0 : layout_->piece(0).begin;
}

void OptimizerOffload::load_master(const float* device_params) {
  to_offload(master(), device_params + device_begin(), piece_floats());
}

Result<double> OptimizerOffload::step(float* params, float* grads, float* grad_shard,
                                      bf16_t* params_bf16, const AdamWConfig& config, float lr,
                                      int step, bool grads_reduced, float loss_scale) {
  HR_CHECK_MSG(params_bf16 == nullptr || stage_ < 3, "ZeRO-3 keeps no full bf16 copy");
  const int64_t P = table_->total_floats, n = piece_floats();
  double copy_ms = 0;
  // Pipelined (the class comment; pieces of upload_chunk_floats(), 0 on the CPU backend): the
  // norm on the device, then the gradients queued out piece by piece, each piece's update after
  // its gradients landed, each updated piece of the master queued back at once, in increasing
  // local order; the gaps between updated pieces (the shard's padding, zero in the master) too,
  // so the device gets the whole piece as before.
  const int64_t begin = device_begin();
  UpdateSink sink;
  sink.chunk = upload_chunk_floats();
  const bool pipelined = sink.chunk > 0;
  std::vector<uint64_t> in_tickets, out_tickets;
  std::vector<int64_t> out_ends;  // where each queued gradient piece ends (local floats)
  size_t out_waited = 0;
  int64_t uploaded = 0;  // the master's floats [0, uploaded) are queued to the device
  auto timed = [&copy_ms](auto&& f) {
    const auto t0 = Clock::now();
    f();
    copy_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  };
  auto upload = [&](int64_t local, int64_t count) {
    if (count <= 0) return;
    timed([&] {
      in_tickets.push_back(ops_->copy_to_device_async(params + begin + local, master() + local,
                                                      size_t(count) * sizeof(float)));
    });
  };
  auto queue_gradients_out = [&](const float* device_src) {
    timed([&] {
      for (int64_t off = 0; off < n; off += sink.chunk) {
        const int64_t c = std::min(sink.chunk, n - off);
        out_tickets.push_back(ops_->copy_to_host_async(this->grads() + off, device_src + off,
                                                       size_t(c) * sizeof(float)));
        out_ends.push_back(off + c);
      }
    });
  };
  // The gradient pieces that [0, end) needs, landed.
  auto wait_gradients = [&](int64_t end) {
    timed([&] {
      while (out_waited < out_tickets.size() &&
             (out_waited == 0 ? 0 : out_ends[out_waited - 1]) < end) {
        ops_->wait_copy(out_tickets[out_waited++]);
      }
    });
  };
  if (pipelined) {
    sink.before = [&](int64_t local, int64_t count) { wait_gradients(local + count); };
    sink.updated = [&](int64_t local, int64_t count) {
      HR_CHECK_MSG(local >= uploaded, "optimizer offload: the update's pieces out of order");
      upload(uploaded, local - uploaded);  // a gap: padding
      upload(local, count);
      uploaded = local + count;
    };
  }
  double norm = 0;
  if (stage_ == 0) {
    // 1-2: the reduction stays on the device; the summed gradients go to the offload tier.
    if (!grads_reduced) HR_RETURN_IF_ERROR(comm_->all_reduce(grads, P));
    if (pipelined) {
      // 3: adamw_step's norm (the same sum on the same values, where they are), then its update
      // on the offload tier's buffers piece by piece as the gradients land.
      norm = grad_norm(*table_, grads, *ops_) / (loss_scale > 0 ? double(loss_scale) : 1.0);
      if (loss_scale > 0 && !std::isfinite(norm)) return norm;  // overflow: nothing moves
      queue_gradients_out(grads);
      adamw_apply(*table_, master(), this->grads(), m(), v(), config, lr, step, norm, loss_scale,
                  backend::cpu_ops(), &sink);
    } else {
      timed([&] { to_offload(this->grads(), grads, P); });
      // 3: adamw_step on the offload tier's buffers (the bf16 copy is cast on the device below).
      norm = adamw_step(*table_, master(), this->grads(), m(), v(), config, lr, step, nullptr,
                        loss_scale);
      if (loss_scale > 0 && !std::isfinite(norm)) return norm;  // overflow: nothing moves
    }
  } else {
    // Stages 1-3 as ZeroOptimizer::step: one unit (the flat layout) at stages 1-2, the model's
    // groups at stage 3; every unit's piece lies at its local offset in the shard buffers.
    const dist::ShardLayout& lay = *layout_;
    HR_CHECK(grad_shard != nullptr && (stage_ == 3 || lay.units().size() == 1));
    if (!grads_reduced) {
      HR_CHECK(grads != nullptr);
      HR_RETURN_IF_ERROR(reduce_scatter_units(comm_, lay, grads, grad_shard));
    }
    // 3: ZeroOptimizer::step's norm and update (the same calls on the same elements), the
    // update on the offload tier's copy of the shard; pipelined, the norm on the device's.
    if (pipelined) {
      HR_ASSIGN_OR_RETURN(norm, sharded_grad_norm(comm_, lay, grad_shard, loss_scale, *ops_));
      if (loss_scale > 0 && !std::isfinite(norm)) return norm;  // overflow: every rank skips
      queue_gradients_out(grad_shard);
    } else {
      timed([&] { to_offload(this->grads(), grad_shard, n); });
      HR_ASSIGN_OR_RETURN(norm, sharded_grad_norm(comm_, lay, this->grads(), loss_scale));
      if (loss_scale > 0 && !std::isfinite(norm)) return norm;  // overflow: every rank skips
    }
    sharded_adamw(lay, *table_, master(), /*params_full=*/false, this->grads(), m(), v(), config,
                  lr, step, norm, loss_scale, backend::cpu_ops(), &sink);
  }
  // 4: the rest of the piece (padding after the last update), then every copy waited for: the
  // updated weights on the device, gathered across ranks, and the bf16 copy cast from them with
  // adamw_update's rounding (nearest even), as ZeroOptimizer does. Stage 3: into the device's
  // shard, which the forward gathers unit by unit (no full buffer, no bf16 copy).
  if (pipelined) {
    upload(uploaded, n - uploaded);
    wait_gradients(n);  // the pieces no update read (padding past the last): the tier's again
    timed([&] {
      for (uint64_t t : in_tickets) ops_->wait_copy(t);
    });
  } else {
    timed([&] { to_device(params + begin, master(), n); });
  }
  if (stage_ == 1 || stage_ == 2) {
    HR_RETURN_IF_ERROR(comm_->all_gather(params + begin, params, layout_->counts(0)));
  }
  if (params_bf16) ops_->cast_to_bf16(params_bf16, params, P);  // where the weights are
  last_copy_ms_ = copy_ms;
  return norm;
}

}  // namespace headroom::train
