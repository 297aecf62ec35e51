// The training loop (see trainer.h).
#include "train/trainer.h"

#include <omp.h>

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <optional>

#include <sys/statvfs.h>
#include <unistd.h>

#include "backend/cpu/device.h"
#include "backend/cpu/kernels.h"
#include "backend/nvtx.h"
#include "core/cpu_time.h"
#include "core/log.h"
#include "core/units.h"
#include "data/batcher.h"
#include "data/prefetcher.h"
#include "data/token_file.h"
#include "dist/nccl/nccl_communicator.h"
#include "dist/staging_communicator.h"
#include "memory/arena.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/prune.h"
#include "model/weights.h"
#include "plan/cost_model.h"
#include "plan/cost_terms.h"
#include "plan/memory_plan.h"
#include "train/checkpoint.h"
#include "train/elastic.h"
#include "train/offload.h"
#include "train/offload_tier.h"
#include "train/shape_plans.h"
#include "train/step_events.h"
#include "train/time_budget.h"
#include "train/zero.h"
#include "train/zero_windows.h"

namespace headroom::train {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

Status check_options(const TrainOptions& o) {
  const model::Gpt2Config& c = o.config;
  if (o.seq <= 0 || o.seq > c.n_positions) {
    return Status::invalid_argument(fmt::format(
        "--seq {} must be between 1 and the model's n_positions ({})", o.seq, c.n_positions));
  }
  HR_RETURN_IF_ERROR(c.check_seq(o.seq));
  if (o.micro_batch <= 0) {
    return Status::invalid_argument(fmt::format("--batch {} must be positive", o.micro_batch));
  }
  if (o.accumulation <= 0) {
    return Status::invalid_argument(
        fmt::format("accumulation {} must be positive", o.accumulation));
  }
  if (o.steps <= 0)
    return Status::invalid_argument(fmt::format("--steps {} must be positive", o.steps));
  if (!(o.minutes >= 0) || !std::isfinite(o.minutes)) {
    return Status::invalid_argument(
        fmt::format("--minutes {} must be a positive number of minutes", o.minutes));
  }
  if (o.minutes > 0 && o.warmup_steps < kMinutesDecisionStep) {
    return Status::invalid_argument(fmt::format(
        "--minutes fixes the step count at the end of the warmup, from its steps' times, so it "
        "needs --warmup {} or more (it is {}), or give --steps instead",
        kMinutesDecisionStep, o.warmup_steps));
  }
  if (int64_t(o.micro_batch) * o.seq > (int64_t(1) << 24)) {
    return Status::invalid_argument(fmt::format(
        "--batch {} x --seq {} tokens per micro-batch is too large", o.micro_batch, o.seq));
  }
  if (!(o.adamw.lr > 0) || !std::isfinite(o.adamw.lr)) {
    return Status::invalid_argument(fmt::format("--lr {} must be positive", o.adamw.lr));
  }
  if (o.zero_stage < 0 || o.zero_stage > 3) {
    return Status::invalid_argument(fmt::format("--zero {}: use 0, 1, 2 or 3", o.zero_stage));
  }
  if (o.batching == data::Batching::kBucketed && o.bucket <= 0) {
    return Status::invalid_argument(
        fmt::format("--bucket {} must be positive (bucket lengths are its multiples)", o.bucket));
  }
  return Status::ok();
}

// A backend whose memory the host cannot address (a GPU) runs every option the CPU runs
// (docs/notes/device-trainer.md); it needs the leaf its memory comes from.
Status check_device_options(const TrainOptions& o, std::string_view backend) {
  if (o.device_leaf == nullptr) {
    return Status::invalid_argument(fmt::format(
        "the {} backend's memory is not the host's: the run needs its device memory leaf "
        "(TrainOptions::device_leaf)",
        backend));
  }
  return Status::ok();
}

// The communicator for the trainer's collectives on `ops`' memory; null: `world` itself (the CPU,
// or a communicator that takes device memory). A CUDA build with NCCL uses NCCL between the
// ranks' GPUs (made over `world`: a collective); otherwise device buffers are staged through
// host memory for `world` (dist/staging_communicator.h), also on one rank, whose local
// communicator copies on the host.
Result<std::unique_ptr<dist::Communicator>> device_communicator(dist::Communicator& world,
                                                                const backend::Ops& ops) {
  if (ops.host_addressable() || world.takes_device_memory()) {
    return std::unique_ptr<dist::Communicator>();
  }
#if defined(HEADROOM_HAVE_NCCL)
  if (ops.name() == "cuda" && world.size() > 1) return dist::make_nccl_communicator(world);
#endif
  return std::unique_ptr<dist::Communicator>(new dist::StagingCommunicator(&world, &ops));
}

// Pre-flight: the output directory exists (or can be made), takes a file, and has room for
// `bytes` (a checkpoint and the final model), so that a run does not train for hours and then
// fail to save.
Status check_output_dir(const std::string& dir, uint64_t bytes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return Status::io_error(
        fmt::format("--out {}: cannot create the output directory: {}", dir, ec.message()));
  }
  const std::string probe = fmt::format("{}/.headroom-write-test-{}", dir, getpid());
  {
    std::ofstream f(probe, std::ios::trunc);
    f << "x";
    if (!f.good()) {
      return Status::io_error(fmt::format("--out {}: the output directory is not writable: {}", dir,
                                          std::strerror(errno)));
    }
  }
  std::filesystem::remove(probe, ec);
  struct statvfs fs;
  if (statvfs(dir.c_str(), &fs) == 0) {
    const uint64_t avail = uint64_t(fs.f_bavail) * uint64_t(fs.f_frsize);
    if (avail < bytes) {
      return Status::io_error(fmt::format(
          "--out {}: {} free on its file system, and a checkpoint with the final model needs "
          "about {}; free some space or choose another --out",
          dir, format_bytes(avail), format_bytes(bytes)));
    }
  }
  return Status::ok();
}

}  // namespace

std::string describe_ranks(int ranks, int zero_stage) {
  const std::string head =
      fmt::format("{} rank{}, ZeRO-{}", ranks, ranks == 1 ? "" : "s", zero_stage);
  switch (zero_stage) {
    case 0:
      return head + ": gradients all-reduced; every rank holds the full optimizer state";
    case 1:
      return head + fmt::format(
                        ": optimizer state (AdamW m, v) sharded, 1/{} per rank; gradients "
                        "reduce-scattered, updated parameters all-gathered",
                        ranks);
    case 2:
      return head + fmt::format(
                        ": optimizer state sharded 1/{} per rank; backward writes each layer's "
                        "gradients into a window reduce-scattered while backward continues (no "
                        "full gradient buffer)",
                        ranks);
    default:
      return head + fmt::format(
                        ": parameters, gradients and optimizer state sharded 1/{} per rank; each "
                        "layer's parameters gathered just before use (the next one prefetched) and "
                        "released after; gradients as ZeRO-2",
                        ranks);
  }
}

namespace {

// The training run proper. Every rank runs it; `setup_agreed` is set once all ranks have agreed
// that set-up succeeded (the first collective), so that run_training knows whether a failing
// rank still owes the others that agreement.
Result<TrainResult> run_ranks(const TrainOptions& o, const TrainCallbacks& cb,
                              dist::Communicator& world, bool* setup_agreed) {
  HR_RETURN_IF_ERROR(check_options(o));
  const int R = world.size(), rank = world.rank();
  // The backend (docs/notes/device-trainer.md): on one the host cannot address, every touch of
  // the planned regions is an op or a copy of the table.
  const backend::Ops& ops = o.ops ? *o.ops : backend::cpu_ops();
  const bool on_device = !ops.host_addressable();
  if (on_device) {
    HR_RETURN_IF_ERROR(check_device_options(o, ops.name()));
  }
  // The trainer's collectives take device buffers (gradient buckets, ZeRO windows and shards,
  // the parameters): on a device, a communicator that takes them (docs/notes/device-trainer.md).
  HR_ASSIGN_OR_RETURN(const std::unique_ptr<dist::Communicator> device_comm,
                      device_communicator(world, ops));
  dist::Communicator& comm = device_comm ? *device_comm : world;
  // NCCL's buffers: outside the arenas, as the context is; the planner counted an estimate
  // (plan/fixed_bytes.h), and the budget follows the device's free memory from here on.
  const uint64_t comm_device_bytes = device_comm ? device_comm->device_bytes_held() : 0;
  if (comm_device_bytes > 0 && rank == 0) {
    log_info("{}: {} of device memory outside the plan (measured as it connected)",
             device_comm->name(), format_bytes(comm_device_bytes));
  }
  // This rank's budget file: `{rank}` in the path replaced (one file for all without it).
  const std::string budget_file =
      o.device_memory_file.empty() ? "" : budget_file_for_rank(o.device_memory_file, rank);
  if (!budget_file.empty()) {
    // Before step one a bad budget file is an error; later, a warning (see follow_budget).
    HR_RETURN_IF_ERROR(read_budget_file(budget_file).status());
  }
  const model::Gpt2Config& cfg = o.config;
  const int B = o.micro_batch, T = o.seq, K = o.accumulation;  // per rank

  // ---- data ----
  HR_ASSIGN_OR_RETURN(data::TokenFile file, data::TokenFile::open(o.data));
  if (file.vocab_size() > cfg.vocab_size) {
    return Status::invalid_argument(fmt::format(
        "{}: the token file's vocabulary ({}) is larger than the model's vocab_size ({}); train a "
        "model whose vocabulary holds it ({}), or prepare the text with the model's tokenizer",
        o.data, file.vocab_size(), cfg.vocab_size,
        file.vocab_size() == 50257 ? "--model gpt2-tiny, for GPT-2's tokens" : "--model"));
  }
  // Not a structured binding: a lambda below captures val_range, which clang 14 cannot do.
  const auto split = data::split_train_val(file, o.val_fraction, T + 1);
  data::TokenRange train_range = split.first, val_range = split.second;
  // Training windows in a shuffled order (seed, epoch); validation reads its windows in order,
  // the same ones every time. See docs/notes/first-run.md.
  const auto train_order =
      o.shuffle ? data::PackedBatcher::Order::kShuffled : data::PackedBatcher::Order::kSequential;
  uint64_t data_seed = o.seed;  // the shuffle's seed: a resumed run keeps its checkpoint's
  HR_ASSIGN_OR_RETURN(data::PackedBatcher train_batches,
                      data::PackedBatcher::create(file, train_range, B, T, train_order, o.seed));
  std::optional<data::PackedBatcher> val_batches;
  if (val_range.size() >= T + 1) {
    HR_ASSIGN_OR_RETURN(data::PackedBatcher vb, data::PackedBatcher::create(file, val_range, B, T));
    val_batches.emplace(std::move(vb));
  }
  // Bucketed batching: one batch of documents per optimizer step, G x T tokens at most (the
  // same documents whatever the micro-batch); validation stays on packed windows, so that its
  // loss compares across batching modes. See docs/notes/batching.md.
  const bool bucketed = o.batching == data::Batching::kBucketed;
  std::optional<data::DocumentBatcher> docs;
  if (bucketed) {
    HR_ASSIGN_OR_RETURN(data::DocumentBatcher d,
                        data::DocumentBatcher::create(file, train_range, T, o.bucket,
                                                      int64_t(B) * K * R * T, o.seed));
    docs.emplace(std::move(d));
  }

  // ---- memory: leaf, budget, tracking; every buffer from an arena made from the plan ----
  plan::Policy policy;
  policy.micro_batch = B;
  policy.accumulation = K;
  policy.seq = T;
  policy.exec = o.exec;
  policy.precision = std::string(model::precision_name(o.exec.precision));
  policy.ranks = R;
  policy.zero_stage = o.zero_stage;
  policy.offload_optimizer = o.offload_optimizer;
  policy.sparsity_mask = !o.sparsity_mask.empty() || o.prune.at_step > 0;
  policy.ops = &ops;  // the backend's scratch sizes and row strides
  if (!o.sparsity_mask.empty() && o.prune.at_step > 0) {
    return Status::invalid_argument(
        "--sparsity-mask and --prune-at both set the mask: give one (--sparsity-mask keeps a "
        "pruned model's zeros, --prune-at prunes during this run)");
  }
  if (o.prune.at_step > 0 && o.prune.at_step >= o.steps) {
    return Status::invalid_argument(fmt::format(
        "--prune-at {}: the run has {} steps; prune at a step before the last (or raise --steps)",
        o.prune.at_step, o.steps));
  }
  HR_ASSIGN_OR_RETURN(const plan::MemoryPlan mp, plan::plan_training_memory(cfg, policy));
  if (mp.peak_bytes > o.device_memory) {
    return Status::out_of_memory(fmt::format(
        "model {} with micro-batch {} x seq {} needs {} but the device budget is {}:\n{}"
        "try a smaller --batch or --seq, or a larger --device-memory{}{}",
        o.model_name, B, T, format_bytes(mp.peak_bytes), format_bytes(o.device_memory),
        plan::category_table(mp, o.device_memory),
        R > 1 && o.zero_stage == 0 ? " (or --zero 1 to shard the optimizer state)" : "",
        o.offload_optimizer
            ? ""
            : " (or --offload-optimizer on to move the optimizer state off the device)"));
  }
  // Bucketed: the step region is planned per micro-batch shape that occurs; the worst one must
  // fit next to the persistent regions (validation runs the plan's own b x T shape).
  // (Packed runs use it for validation pieces smaller than the micro-batch, see evaluate.)
  std::optional<ShapePlans> shapes;
  shapes.emplace(cfg, mp.policy);
  std::vector<std::pair<int, int>> mb_shapes;
  ShapePlans::Largest largest_shape;
  if (bucketed) {
    mb_shapes = micro_batch_shapes(docs->batch_shapes(), B, T);
    HR_ASSIGN_OR_RETURN(largest_shape, shapes->largest(mb_shapes));
    if (mp.persistent_bytes + largest_shape.step_bytes > o.device_memory) {
      return Status::out_of_memory(fmt::format(
          "--batching bucketed: the micro-batch shape {} x {} (rows x length, under the token "
          "budget {} x {}) needs a step region of {}, {} with the persistent regions, but the "
          "device budget is {}; try a smaller --batch or a larger --device-memory",
          largest_shape.shape.first, largest_shape.shape.second, B, T,
          format_bytes(largest_shape.step_bytes),
          format_bytes(mp.persistent_bytes + largest_shape.step_bytes),
          format_bytes(o.device_memory)));
    }
  }
  // The leaf of the device budget: host memory on the CPU, the backend's device memory else.
  memory::HostResource host;
  memory::MemoryResource* const leaf = on_device ? o.device_leaf : &host;
  memory::LimitResource limit(leaf, o.device_memory);
  memory::TrackingResource tracking(&limit);
  // Host memory outside the device budget, on a device the host cannot address: the loader's
  // token slots (page-locked on a GPU, TrainOptions::slot_leaf, so that their copies run on the
  // host-to-device stream behind the loader's call) and the final weights' copy.
  memory::HostResource host_io;
  memory::MemoryResource* const slot_leaf = o.slot_leaf ? o.slot_leaf : &host_io;
  const model::ParamTable& table = mp.params;
  auto make = [&](const plan::Region& r) -> Result<memory::Arena> {
    if (r.layout.size == 0) return memory::Arena();  // the optimizer region, when offloaded
    return memory::Arena::create(&tracking, r.buffers, r.layout, r.category);
  };
  HR_ASSIGN_OR_RETURN(memory::Arena params_arena, make(mp.persistent[0]));
  HR_ASSIGN_OR_RETURN(memory::Arena grads_arena, make(mp.persistent[1]));
  HR_ASSIGN_OR_RETURN(memory::Arena opt_arena, make(mp.persistent[2]));
  HR_ASSIGN_OR_RETURN(memory::Arena staging, make(mp.persistent[3]));
  // The loader writes token slots on the host: the staging region itself on the CPU; on a
  // device, a host copy of its layout, each training slot copied over by the loader thread as
  // soon as it is filled (asynchronously: the step waits for its slot's copies), the validation
  // slot before validation reads it.
  memory::Arena host_staging_copy;
  if (on_device) {
    const plan::Region& r = mp.persistent[3];
    HR_ASSIGN_OR_RETURN(host_staging_copy,
                        memory::Arena::create(slot_leaf, r.buffers, r.layout, r.category));
  }
  memory::Arena& host_staging = on_device ? host_staging_copy : staging;
  // Copies host_staging's buffers [first, first + n) to the device's staging (nothing on the CPU).
  auto upload_staging = [&](size_t first, size_t n) {
    if (!on_device) return;
    for (size_t i = first; i < first + n; i++) {
      ops.copy_to_device(staging.data(i), host_staging.data(i),
                         mp.persistent[3].buffers[i].bytes());
    }
  };
  // The same, queued on the host-to-device stream; the tickets to wait for before the slot's
  // step reads it (none on the CPU).
  auto upload_staging_async = [&](size_t first, size_t n) {
    std::array<uint64_t, 2> tickets = {0, 0};
    if (!on_device) return tickets;
    HR_CHECK(n <= tickets.size());
    for (size_t i = first; i < first + n; i++) {
      tickets[i - first] = ops.copy_to_device_async(staging.data(i), host_staging.data(i),
                                                    mp.persistent[3].buffers[i].bytes());
    }
    return tickets;
  };  // Mixed precision: the bf16 copy of the weights that the GEMMs read (refreshed by AdamW).
  memory::Arena bf16_arena;
  if (mp.persistent.size() > plan::MemoryPlan::kBf16WeightsRegion &&
      mp.persistent[plan::MemoryPlan::kBf16WeightsRegion].name == "bf16 weights") {
    HR_ASSIGN_OR_RETURN(bf16_arena, make(mp.persistent[plan::MemoryPlan::kBf16WeightsRegion]));
  }
  // The sparsity mask (docs/notes/pruning.md): one byte per parameter float, the last region.
  memory::Arena mask_arena;
  if (mp.policy.sparsity_mask) {
    HR_CHECK(mp.persistent.back().name == plan::kSparsityMaskRegion);
    HR_ASSIGN_OR_RETURN(mask_arena, make(mp.persistent.back()));
  }
  uint8_t* const mask = mask_arena.size() > 0 ? static_cast<uint8_t*>(mask_arena.data(0)) : nullptr;
  bool mask_active = false;  // false until --prune-at's step with a mask planned for later
  // The step region comes from a pool, once per micro-batch (see elastic.h): an allocation
  // failure surfaces before the micro-batch computes, and re-plans change only this region.
  ElasticStep::Setup es;
  es.config = cfg;
  es.device = o.device;
  es.seq = T;
  es.global_batch = B * K;
  es.max_micro_batch = B;
  es.head_chunk = o.exec.head_chunk > 0 ? o.exec.head_chunk : 256;
  es.fail_acquisitions = o.fail_step_allocations;
  ElasticStep elastic(std::move(es), &tracking, mp);
  // Note [Self-correction]: a correction this machine measured on an earlier run of this model.
  const TrainOptions::SelfCorrection& sc = o.self_correct;
  const std::string correction_key = plan::correction_model_key(cfg, mp.policy.precision);
  std::string correction_note;  // reported with the first step
  if (sc.enabled && sc.load && !sc.cache_path.empty()) {
    Result<plan::CostCorrection> cached =
        plan::load_correction(sc.cache_path, sc.machine_key, correction_key);
    if (cached.is_ok()) {
      plan::DeviceSpec dev = elastic.device();
      dev.correction = *cached;
      const double before = elastic.predicted_step_ms();
      elastic.set_device(dev);
      correction_note = fmt::format(
          "cost model: the correction measured by an earlier run on this machine ({}, {}) "
          "applied: predicted {:.0f} -> {:.0f} ms/step",
          sc.machine_key, correction_key, before, elastic.predicted_step_ms());
    } else if (cached.status().code() != StatusCode::kNotFound) {
      correction_note = "cost model: " + cached.status().message() + " -- not used";
    }
  }
  // Fault the region's pages in now, not inside step one; the pool keeps them. Bucketed: the
  // largest shape's region first, so that every smaller one is carved from it (the measured
  // peak is the largest shape's plan).
  auto warm_up = [&]() -> Status {
    if (bucketed && largest_shape.step_bytes > elastic.plan().step_bytes) {
      HR_ASSIGN_OR_RETURN(memory::Arena warm, elastic.acquire_shape(*largest_shape.plan, false));
    } else {
      HR_ASSIGN_OR_RETURN(memory::Arena warm, elastic.acquire_uninjected());
    }
    return Status::ok();
  };
  HR_RETURN_IF_ERROR(warm_up());
  // The planned peak: the persistent regions and the largest step region that occurs.
  auto planned_peak = [&] {
    return bucketed ? std::max(elastic.planned_peak(),
                               elastic.persistent_bytes() + largest_shape.step_bytes)
                    : elastic.planned_peak();
  };
  if (!o.out_dir.empty() && rank == 0) {
    // Room for a checkpoint (weights and two moments) and the final model, and some slack.
    HR_RETURN_IF_ERROR(
        check_output_dir(o.out_dir, uint64_t(table.total_floats) * 4 * 4 + 16 * kMiB));
  }

  const int64_t P = table.total_floats;
  const int stage = o.zero_stage;
  // Stages 0-2: the full parameters. Stage 3: this rank's shard, and six windows of gathered
  // units (plan_training_memory's order, train/zero_windows.h).
  float* params = stage < 3 ? params_arena.f32(0) : nullptr;
  float* param_shard = stage == 3 ? params_arena.f32(0) : nullptr;
  // Stages 0-1: the full gradient (accumulation) buffer. Stages 2-3: six gradient windows.
  float* grads = stage < 2 ? grads_arena.f32(0) : nullptr;
  ZeroWindowPtrs grad_windows{}, param_windows{};
  for (size_t w = 0; w < grad_windows.size() && stage >= 2; w++) {
    grad_windows[w] = grads_arena.f32(w);
    if (stage == 3) param_windows[w] = params_arena.f32(1 + w);
  }
  const int64_t staging_floats =
      stage >= 2 ? int64_t(mp.persistent[1].buffers[0].bytes() / sizeof(float)) : 0;
  // ZeRO-1-3: this rank's piece of the reduced gradient, m and v (docs/notes/zero.md).
  float* grad_shard = stage > 0 ? grads_arena.f32(stage < 2 ? 1 : grad_windows.size()) : nullptr;
  // The optimizer's collectives, recorded as ops of its step when profiling (step_events.h).
  TracedCommunicator zcomm(&comm);
  ZeroOptimizer zopt(&zcomm, &table, stage, {}, ops);
  // The offload tier: its own host resource under one budget, holding every offload region of
  // the plan (optimizer state, offloaded activations, or both), and the copy thread (made
  // before the model, so that it outlives every forward and backward).
  const uint64_t offload_budget =
      o.offload_memory > 0 ? o.offload_memory : cpu::query_cpu_device().available_bytes;
  // The offload tier's plan: mp's, except that bucketed batching's offloaded activations take the
  // region of the shape that needs the most (every shape's buffers are laid out inside it in
  // turn: OffloadTier::bind), as the step region is the largest shape's.
  // The largest offloaded-activations region among the bucketed shapes' plans (and `mp`'s).
  auto largest_offload_region = [&]() -> Result<const plan::Region*> {
    const plan::Region* largest = plan::offload_region(mp, plan::kOffloadedActivationsRegion);
    for (const auto& [rows, len] : mb_shapes) {
      HR_ASSIGN_OR_RETURN(const plan::MemoryPlan* sp, shapes->get(rows, len));
      const plan::Region* r = plan::offload_region(*sp, plan::kOffloadedActivationsRegion);
      if (r && (!largest || r->layout.size > largest->layout.size)) largest = r;
    }
    return largest;
  };
  plan::MemoryPlan tier_plan_storage;
  const plan::MemoryPlan* tier_plan = &mp;
  if (bucketed && !mp.activations.offloaded.empty()) {
    HR_ASSIGN_OR_RETURN(const plan::Region* largest, largest_offload_region());
    tier_plan_storage = mp;
    for (plan::Region& r : tier_plan_storage.offload) {
      if (r.name != plan::kOffloadedActivationsRegion) continue;
      tier_plan_storage.offload_bytes += largest->layout.size - r.layout.size;
      r = *largest;
    }
    tier_plan = &tier_plan_storage;
  }
  HR_ASSIGN_OR_RETURN(
      std::unique_ptr<OffloadTier> offload_tier,
      OffloadTier::create(*tier_plan, offload_budget, o.offload_copier, &ops, o.offload_leaf));
  // Optimizer offload: m and v (and the master weights) live in the offload tier.
  std::unique_ptr<OptimizerOffload> offload;
  if (mp.policy.offload_optimizer) {
    HR_ASSIGN_OR_RETURN(
        offload, OptimizerOffload::create(mp, *offload_tier, &comm, stage, &zopt.layout(), ops));
    if (o.optimizer_upload_chunk > 0) {
      if (o.optimizer_upload_chunk % 64 != 0) {
        return Status::invalid_argument(
            fmt::format("optimizer_upload_chunk {}: a positive multiple of 64 floats",
                        o.optimizer_upload_chunk));
      }
      offload->set_upload_chunk_floats(o.optimizer_upload_chunk);
    }
  }
  float* m = offload ? offload->m() : opt_arena.f32(0);
  float* v = offload ? offload->v() : opt_arena.f32(1);
  const int64_t moment_floats = offload
                                    ? offload->shard_floats()
                                    : int64_t(mp.persistent[2].buffers[0].bytes() / sizeof(float));
  HR_CHECK_MSG(zopt.sizes().m <= moment_floats, "the plan's optimizer shard is too small");
  // The initial weights into host memory at `dst`: drawn from the seed (which also zeroes the
  // padding between tensors), then --model DIR's weights over them when it has some. A
  // --sparsity-mask directory's weights win over both (DIR is not read then).
  auto initial_weights = [&](float* dst) -> Status {
    model::gpt2_init_params(cfg, table, dst, o.seed);
    // --sparsity-mask DIR: start from DIR's weights (a pruned model), its zeros the mask.
    if (!o.sparsity_mask.empty()) {
      HR_ASSIGN_OR_RETURN(const model::Gpt2Config from,
                          model::load_config_file(o.sparsity_mask + "/config.json"));
      if (from.to_json() != cfg.to_json()) {
        return Status::invalid_argument(fmt::format(
            "--sparsity-mask {}: its config.json is not --model {}'s; train with --model {} (the "
            "pruned model's own config)",
            o.sparsity_mask, o.model_name, o.sparsity_mask));
      }
      return model::load_pretrained(o.sparsity_mask, table, dst);
    }
    if (o.init_from.empty()) return Status::ok();
    return model::load_pretrained(o.init_from, table, dst);
  };
  if (stage < 3 && on_device) {
    // Made in host memory (zeros between the tensors, as a fresh arena's), then copied over.
    std::vector<float> init(static_cast<size_t>(P));
    HR_RETURN_IF_ERROR(initial_weights(init.data()));
    ops.copy_to_device(params, init.data(), size_t(P) * sizeof(float));
  } else if (stage < 3) {
    HR_RETURN_IF_ERROR(initial_weights(params));
  } else {
    // The initialisation draws every tensor from one generator: made whole in host memory (as a
    // checkpoint is read), then each rank keeps its pieces.
    std::vector<float> full(static_cast<size_t>(P));
    HR_RETURN_IF_ERROR(initial_weights(full.data()));
    zopt.scatter_params(full.data(), param_shard);
  }
  // ZeRO-2/3's executor hooks and the communication thread they submit to (docs/notes/zero.md).
  std::optional<dist::CommQueue> comm_queue;
  std::optional<ZeroWindows> zw;
  if (stage >= 2) {
    comm_queue.emplace();
    zw.emplace(stage, &*comm_queue, &comm, &table, &zopt.layout(),
               stage == 3 ? param_shard : params, grad_shard, grad_windows,
               stage == 3 ? std::optional<ZeroWindowPtrs>(param_windows) : std::nullopt, ops);
    zw->set_record(o.record_zero_events);
  }
  // Stages 0-1 with several ranks: the last micro-batch's gradients are reduced in buckets on the
  // communication thread as backward finishes them (BucketHooks), not after backward.
  std::optional<dist::BucketReducer> reducer;
  std::optional<BucketHooks> bucket_hooks;
  // Bucketed batching gives ranks different numbers of micro-batches: the optimizer reduces.
  if (stage < 2 && R > 1 && !bucketed) {
    comm_queue.emplace();
    // DDP's default bucket: 25 MiB.
    constexpr int64_t kBucketFloats = 25 * kMiB / sizeof(float);
    reducer.emplace(&*comm_queue, &comm,
                    stage == 0 ? dist::BucketReducer::Mode::kAllReduce
                               : dist::BucketReducer::Mode::kReduceScatter,
                    grads, gpt2_zero_units(table),
                    dist::make_buckets(gpt2_backward_order(table), kBucketFloats),
                    stage == 1 ? &zopt.layout() : nullptr, grad_shard);
    bucket_hooks.emplace(&table, params, grads, &*reducer);
  }
  if (grads) ops.zero(grads, P);
  if (grad_shard) ops.zero(grad_shard, moment_floats);
  // The moments: the backend's when on the device, the offload tier's (host) otherwise.
  const backend::Ops& moment_ops = offload ? backend::cpu_ops() : ops;
  moment_ops.zero(m, moment_floats);
  moment_ops.zero(v, moment_floats);
  int start_step = 0;
  // The schedule's steps: --steps, or (with --minutes) the count fixed after the warmup's last
  // step, or a checkpoint's where that count was fixed before it.
  int total_steps = o.steps;
  bool steps_fixed = o.minutes <= 0;
  // fp16: loss scaling (Note [Loss scaling] in docs/notes/mixed-precision.md); its state is
  // restored from the checkpoint when resuming. `applied` counts the updates AdamW made (its
  // bias-correction step): the steps done less the skipped ones.
  std::optional<LossScaler> scaler;
  if (o.exec.precision == model::Precision::kFp16) scaler.emplace(o.loss_scale);
  if (!o.resume.empty()) {
    HR_ASSIGN_OR_RETURN(LoadedCheckpoint ck, find_checkpoint(o.resume));
    const TrainerState& st = ck.state;
    if (ck.config.to_json() != cfg.to_json()) {
      return Status::invalid_argument(
          fmt::format("{}: the checkpoint's model (config.json) differs from --model {}", ck.dir,
                      o.model_name));
    }
    // The checkpoint's accumulation counts every rank's micro-batches (global batch / micro-
    // batch), so a run on another number of ranks with the same global batch continues it.
    // The global batch and seq fix the data of every step; the micro-batch only how a step is
    // cut, which changes nothing but rounding (principle 2), so another one may continue it.
    if (int64_t(st.micro_batch) * st.accumulation != int64_t(B) * K * R || st.seq != T) {
      return Status::invalid_argument(fmt::format(
          "{}: the checkpoint ran global batch {} ({} x {}) at seq {}, this run {} at seq {}; "
          "resume with --global-batch {} --seq {} to continue it",
          ck.dir, st.micro_batch * st.accumulation, st.micro_batch, st.accumulation, st.seq,
          B * K * R, T, st.micro_batch * st.accumulation, st.seq));
    }
    if (st.batching != data::batching_name(o.batching) || (bucketed && st.bucket != o.bucket)) {
      return Status::invalid_argument(fmt::format(
          "{}: the checkpoint was trained with --batching {}{}, this run with --batching {}{}; "
          "resume with the checkpoint's batching (its data position means nothing to another)",
          ck.dir, st.batching,
          st.batching == "bucketed" ? fmt::format(" --bucket {}", st.bucket) : "",
          data::batching_name(o.batching), bucketed ? fmt::format(" --bucket {}", o.bucket) : ""));
    }
    if (st.micro_batch != B && rank == 0) {
      log_info(
          "{}: the checkpoint ran micro-batch {} x {}; continuing at {} x {} (the same "
          "global batch: equal up to floating-point rounding)",
          ck.dir, st.micro_batch, st.accumulation, B, K * R);
    }
    if (!bucketed &&
        ((st.data_order == "shuffled") != o.shuffle || (o.shuffle && st.seed != o.seed))) {
      // The checkpoint's order continues: a checkpoint from before the shuffle reads on in file
      // order, a shuffled one with its own seed's permutation (the data position means nothing
      // in another order).
      HR_ASSIGN_OR_RETURN(train_batches,
                          data::PackedBatcher::create(file, train_range, B, T,
                                                      st.data_order == "shuffled"
                                                          ? data::PackedBatcher::Order::kShuffled
                                                          : data::PackedBatcher::Order::kSequential,
                                                      st.seed));
      data_seed = st.seed;
      if (rank == 0) {
        log_info("{}: continuing the checkpoint's {} data order{}", ck.dir, st.data_order,
                 st.data_order == "shuffled" ? fmt::format(" (seed {})", st.seed) : "");
      }
    }
    if (bucketed ? !docs->valid_position(st.data_position)
                 : !train_batches.valid_position(st.data_position)) {
      return Status::corrupt(fmt::format("{}: data_position {} is outside the training data of {}",
                                         ck.dir, st.data_position, o.data));
    }
    if (o.minutes > 0 && st.step >= o.warmup_steps) {
      // The budget's count was fixed before this checkpoint: the run continues to it.
      total_steps = std::min(st.total_steps, o.steps);
      steps_fixed = true;
      if (rank == 0) {
        log_info("{}: --minutes: continuing to the {} steps the run chose at step {}", ck.dir,
                 total_steps, o.warmup_steps);
      }
    }
    if (st.step >= total_steps) {
      return Status::invalid_argument(
          fmt::format("{} is at step {}, and --steps is {}: nothing left to do (raise --steps)",
                      ck.dir, st.step, total_steps));
    }
    if (rank == 0 && steps_fixed &&
        (st.total_steps != total_steps || st.lr != o.adamw.lr ||
         st.warmup_steps != o.warmup_steps)) {
      log_warn(
          "{}: the learning-rate schedule differs from the checkpointed run's ({} steps, lr {}, "
          "warmup {} now; {}, {}, {} then): the continuation follows the new schedule",
          ck.dir, total_steps, o.adamw.lr, o.warmup_steps, st.total_steps, st.lr, st.warmup_steps);
    }
    if (stage == 0 && on_device) {
      // Read into host memory (as a GPU run reads a file), then copied over; offloaded moments
      // are the tier's host memory already.
      std::vector<float> hp(static_cast<size_t>(P)), hm(static_cast<size_t>(offload ? 0 : P)),
          hv(static_cast<size_t>(offload ? 0 : P));
      HR_RETURN_IF_ERROR(
          load_checkpoint(ck, table, hp.data(), offload ? m : hm.data(), offload ? v : hv.data()));
      ops.copy_to_device(params, hp.data(), size_t(P) * sizeof(float));
      if (!offload) {
        ops.copy_to_device(m, hm.data(), size_t(P) * sizeof(float));
        ops.copy_to_device(v, hv.data(), size_t(P) * sizeof(float));
      }
    } else if (stage == 0) {
      HR_RETURN_IF_ERROR(load_checkpoint(ck, table, params, m, v));
    } else if (stage >= 2 || on_device) {
      // No full device buffer to read the moments (stage 3: the parameters) through: host
      // copies, as a GPU run reads a file; every rank keeps its pieces. On a device (stages
      // 1-3) the parameters too, copied over.
      const bool host_p = stage == 3 || on_device;
      std::vector<float> full_p(static_cast<size_t>(host_p ? P : 0));
      std::vector<float> full_m(static_cast<size_t>(P)), full_v(static_cast<size_t>(P));
      HR_RETURN_IF_ERROR(load_checkpoint(ck, table, host_p ? full_p.data() : params, full_m.data(),
                                         full_v.data()));
      if (stage == 3) zopt.scatter_params(full_p.data(), param_shard);
      if (stage < 3 && on_device) {
        ops.copy_to_device(params, full_p.data(), size_t(P) * sizeof(float));
      }
      zopt.scatter_params(full_m.data(), m);
      zopt.scatter_params(full_v.data(), v);
    } else {
      // Checkpoints hold the full moments: every rank reads them (m through the gradient buffer,
      // free before step one; v through a host copy, as a GPU run reads a file) and keeps its
      // piece. With several machines --resume must be on a file system they share.
      std::vector<float> full_v(static_cast<size_t>(P));
      HR_RETURN_IF_ERROR(load_checkpoint(ck, table, params, grads, full_v.data()));
      zopt.scatter_params(grads, m);
      zopt.scatter_params(full_v.data(), v);
      ops.zero(grads, P);
    }
    if (bucketed) {
      docs->set_position(st.data_position);
    } else {
      train_batches.set_position(st.data_position);
    }
    start_step = st.step;
    if (scaler && st.loss_scale) scaler->restore(*st.loss_scale);
    if (!scaler && st.loss_scale && rank == 0) {
      log_warn("{}: the checkpoint trained in fp16 (loss scale {:g}); this run is {} and unscaled",
               ck.dir, double(st.loss_scale->scale), model::precision_name(o.exec.precision));
    }
    if (rank == 0) log_info("resumed from {} at step {}", ck.dir, st.step);
  }
  // The mask is the zeros of the starting weights: the pruned model's, or a checkpoint's taken
  // after --prune-at (pruned weights stay exact zeros, so the mask needs no file of its own).
  // On a device the mask is made from a host copy of the weights and copied in; on the CPU from
  // the weights themselves (the CPU's copy_to_device is a memcpy).
  auto host_weights = [&](std::vector<float>* copy) -> const float* {
    if (!on_device) return params;
    copy->resize(static_cast<size_t>(P));
    ops.copy_to_host(copy->data(), params, size_t(P) * sizeof(float));
    return copy->data();
  };
  if (mask && (!o.sparsity_mask.empty() || start_step >= o.prune.at_step)) {
    std::vector<float> copy;
    const model::SparsityMask m0 = model::mask_from_zeros(table, host_weights(&copy));
    ops.copy_to_device(mask, m0.data(), m0.size());
    mask_active = true;
  }
  // A collective: every rank calls it; rank 0 writes (the path is returned there, "" elsewhere)
  // and every rank gets rank 0's status. The checkpoint holds the full m and v, so it resumes on
  // any number of ranks: with ZeRO-1/2 they are gathered, m into the gradient buffer (free at a
  // step boundary, and the run stops after a checkpoint taken mid-step) and copied to host
  // memory on rank 0, then v into the gradient buffer; the host copy is the checkpoint's I/O
  // staging, outside the device budget, as on a GPU.
  auto checkpoint = [&](int steps_done, int64_t data_position) -> Result<std::string> {
    if (o.out_dir.empty()) {
      return Status::invalid_argument("--save-every needs an output directory (--out)");
    }
    TrainerState st{steps_done,
                    data_position,
                    total_steps,
                    o.warmup_steps,
                    o.adamw.lr,
                    o.min_lr_ratio,
                    elastic.micro_batch(),
                    elastic.accumulation() * R,
                    T,
                    o.seed,
                    o.data,
                    data::batching_name(o.batching),
                    bucketed ? o.bucket : 0,
                    scaler ? std::optional<LossScaleState>(scaler->state()) : std::nullopt};
    if (!bucketed) st.seed = data_seed;
    st.data_order =
        train_batches.order() == data::PackedBatcher::Order::kShuffled ? "shuffled" : "sequential";
    const float* full_p = params;
    const float* full_m = m;
    const float* full_v = v;
    std::vector<float> host_p, host_m, host_v;
    if (zw) zw->quiesce();  // a checkpoint taken mid-step: the windows' reductions are done
    // On a device, the full buffers of stages 0-2 read into host copies on rank 0.
    auto to_host = [&](const float* device, std::vector<float>* host) -> const float* {
      if (rank != 0) return nullptr;
      host->resize(static_cast<size_t>(P));
      ops.copy_to_host(host->data(), device, size_t(P) * sizeof(float));
      return host->data();
    };
    if (on_device && stage == 0) {  // host copies, the checkpoint's I/O staging
      host_p.resize(static_cast<size_t>(P));
      ops.copy_to_host(host_p.data(), params, size_t(P) * sizeof(float));
      full_p = host_p.data();
      if (!offload) {  // offloaded moments are the tier's host memory
        host_m.resize(static_cast<size_t>(P));
        host_v.resize(static_cast<size_t>(P));
        ops.copy_to_host(host_m.data(), m, size_t(P) * sizeof(float));
        ops.copy_to_host(host_v.data(), v, size_t(P) * sizeof(float));
        full_m = host_m.data();
        full_v = host_v.data();
      }
    } else if (stage >= 2) {
      // Gathered unit by unit through the embedding's gradient window (free at a step boundary,
      // or once quiesced) into host copies on rank 0: the checkpoint's I/O staging.
      auto gather = [&](const float* shard, std::vector<float>* host) -> Status {
        if (rank == 0) host->resize(static_cast<size_t>(P));
        return gather_through(&comm, zopt.layout(), shard, grad_windows[0], staging_floats,
                              rank == 0 ? host->data() : nullptr, ops);
      };
      if (stage == 3) {
        HR_RETURN_IF_ERROR(gather(param_shard, &host_p));
        full_p = host_p.data();
      } else if (on_device) {
        full_p = to_host(params, &host_p);
      }
      HR_RETURN_IF_ERROR(gather(m, &host_m));
      HR_RETURN_IF_ERROR(gather(v, &host_v));
      full_m = host_m.data();
      full_v = host_v.data();
    } else if (stage == 1) {
      HR_RETURN_IF_ERROR(zopt.gather_params(m, grads));
      full_m = to_host(grads, &host_m);
      HR_RETURN_IF_ERROR(zopt.gather_params(v, grads));
      full_v = on_device ? to_host(grads, &host_v) : grads;
      if (on_device) full_p = to_host(params, &host_p);
    }
    Result<std::string> written = std::string();
    if (rank == 0) {
      written = save_checkpoint(o.out_dir + "/checkpoints",
                                {&cfg, &table, full_p, full_m, full_v, st}, o.keep_checkpoints);
    }
    if (stage == 1) ops.zero(grads, P);
    HR_RETURN_IF_ERROR(dist::agree(comm, written.status()));
    return written;
  };

  // After initialisation or the checkpoint; stage 3 from the device's shard.
  if (offload) offload->load_master(stage == 3 ? param_shard : params);
  bf16_t* params_bf16 = bf16_arena.size() > 0 ? static_cast<bf16_t*>(bf16_arena.data(0)) : nullptr;

  if (params_bf16) ops.cast_to_bf16(params_bf16, params, table.total_floats);
  model::Gpt2 net(cfg, &table, ops);
  net.bind_params(params, grads, params_bf16);
  // Distillation (docs/notes/distillation.md): the teacher's fp32 weights in their planned
  // region (category teacher), read from its model directory; it runs forward only, in the
  // step region's teacher part, before each micro-batch's forward.
  memory::Arena teacher_arena;
  model::ParamTable teacher_table;
  std::optional<model::Gpt2> teacher_net;
  if (const std::optional<model::Distill>& d = mp.policy.exec.distill) {
    const plan::Region* r = plan::persistent_region(mp, plan::kTeacherWeightsRegion);
    HR_CHECK(r != nullptr);
    HR_ASSIGN_OR_RETURN(teacher_arena, make(*r));
    teacher_table = model::gpt2_param_table(d->teacher);
    // Padding floats between tensors are never read, but are defined. On a device: read into
    // host memory (as a GPU run reads a file), then copied over.
    std::vector<float> host_teacher;
    float* teacher_dst = teacher_arena.f32(0);
    if (on_device) {
      host_teacher.assign(r->layout.size / sizeof(float), 0.0f);
      teacher_dst = host_teacher.data();
    } else {
      std::memset(teacher_dst, 0, r->layout.size);
    }
    if (Status s = model::load_pretrained(o.teacher_dir, teacher_table, teacher_dst); !s.is_ok()) {
      return Status(s.code(), fmt::format("--teacher {}: {}", o.teacher_dir, s.message()));
    }
    if (on_device) {
      ops.copy_to_device(teacher_arena.f32(0), host_teacher.data(),
                         host_teacher.size() * sizeof(float));
    }
    teacher_net.emplace(d->teacher, &teacher_table, ops);
    teacher_net->bind_params(teacher_arena.f32(0), nullptr);
  }
  // ZeRO-2/3: backward writes gradient windows that the communication thread reduce-scatters
  // while backward continues; stage 3 gathers each block's parameters just before use.
  if (zw) net.set_block_hooks(&*zw);
  if (bucket_hooks) net.set_block_hooks(&*bucket_hooks);
  model::OpTimes op_times;
  const Clock::time_point run_start = Clock::now();
  std::optional<ProfileRecord> rec;
  if (o.profile) {
    rec.emplace();
    if (offload_tier->copier()) offload_tier->copier()->set_record(true);
    rec->plan = mp;
    op_times.record = true;
    op_times.origin = run_start;
    record_plan(mp, &rec->events);  // persistent allocations at 0; the step's schedule
    op_times.events = &rec->events;
    // The step region's pool: its block per micro-batch, its reserved chunks.
    elastic.set_pool_observer(
        pool_observer(&rec->events, mp.step.name, run_start, elastic.pool_stats(), 0));
    if (start_step > 0) {
      note_replan(&rec->events, ReplanCause::kResume, false,
                  fmt::format("resumed at step {}: micro-batch {} x {}, the checkpoint's",
                              start_step, B, K),
                  start_step, 0);
    }
  }
  const bool keep_op_times = o.breakdown || o.profile;
  if (keep_op_times || sc.enabled) net.set_op_times(&op_times);
  // The self-correction's measurement: per kind and for the whole step, summed over its steps.
  std::array<double, plan::kCostKinds> sc_measured{};
  double sc_step_seconds = 0;
  int sc_steps = 0;
  int sc_micro_batch = 0;
  std::string sc_exec;
  auto us_since_start = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - run_start).count();
  };
  auto record = [&](const char* name, const char* kind, Clock::time_point t0, int step, int mb) {
    if (rec) {
      rec->spans.push_back({name, kind, us_since_start(t0),
                            us_since_start(Clock::now()) - us_since_start(t0), step, mb});
    }
  };
  // An op outside the schedule (data, optimizer) as op_begin/op_end events.
  auto record_op = [&](const char* name, EventPhase phase, Clock::time_point t0,
                       Clock::time_point t1, int step, uint8_t thread = kEventThreadTraining) {
    if (rec) {
      train::record_op(&rec->events, name, phase, step, us_since_start(t0), us_since_start(t1),
                       thread);
    }
  };
  const int depth = mp.policy.prefetch_depth;
  // Validation's slot: read on the host, computed from the backend's copy.
  int32_t* host_val_inputs = static_cast<int32_t*>(host_staging.data(size_t(2 * depth)));
  int32_t* host_val_targets = static_cast<int32_t*>(host_staging.data(size_t(2 * depth + 1)));
  const int32_t* val_inputs = static_cast<const int32_t*>(staging.data(size_t(2 * depth)));
  const int32_t* val_targets = static_cast<const int32_t*>(staging.data(size_t(2 * depth + 1)));
  auto next_val_batch = [&] {
    val_batches->next(host_val_inputs, host_val_targets);
    upload_staging(size_t(2 * depth), 2);
  };
  // Sequences per optimizer step, all ranks: invariant (DESIGN.md principle 2). This rank
  // computes `share` of them, from sequence `first` of the step on.
  const int G = B * K * R;
  const int share = B * K, first = rank * share;

  if (cb.on_setup) {
    SetupInfo info;
    info.num_parameters = table.num_parameters;
    info.planned_bytes = mp.peak_bytes;
    info.memory_table = plan::category_table(mp, o.device_memory);
    if (mp.offload_bytes > 0) {
      info.offload_table = plan::offload_table(*tier_plan, offload_tier->budget());
      info.offload_bytes = tier_plan->offload_bytes;
      info.offload_budget = offload_tier->budget();
      info.offload_optimizer = mp.policy.offload_optimizer;
      info.offloaded_blocks = int(mp.activations.offloaded.size());
    }
    info.train_tokens = train_range.size();
    info.val_tokens = val_range.size();
    info.predicted_step_ms = elastic.predicted_step_ms();
    info.device_source = o.device.source.empty() ? nominal_cpu_spec().source : o.device.source;
    if (bucketed) {
      std::string list;
      for (const auto& [r, l] : mb_shapes)
        list += fmt::format("{}{}x{}", list.empty() ? "" : " ", r, l);
      info.batching = fmt::format(
          "bucketed: {} pieces of documents (at most {} tokens each) in buckets of {} tokens, "
          "{} steps per epoch of at most {} x {} tokens, padding {:.1f}%; micro-batches of at "
          "most {} x {} tokens, shapes (rows x length) {}; the largest, {} x {}, plans a step "
          "region of {}",
          docs->pieces().size(), T, o.bucket, docs->batches_per_epoch(), G, T,
          100.0 * docs->padding_fraction(), B, T, list, largest_shape.shape.first,
          largest_shape.shape.second, format_bytes(largest_shape.step_bytes));
      info.planned_bytes = planned_peak();
    }
    cb.on_setup(info);
  }

  // ---- elastic re-planning and out-of-memory recovery (docs/notes/elastic.md) ----
  int steps_done = start_step;  // optimizer steps completed
  int64_t done_position = bucketed ? docs->position() : train_batches.position();
  uint64_t ceiling = o.device_memory;  // what plans may use: the budget, lowered after a failure
  std::string last_file_error;
  StepStats cur;  // this step's events and counts, moved into its StepStats at the end
  TrainResult result;
  result.communicator_device_bytes = comm_device_bytes;
  // Stops the run: checkpoints the last completed step first (principle 4: lose nothing).
  auto fail_out_of_memory = [&](std::string msg) -> Status {
    if (o.out_dir.empty()) {
      msg += "\nno checkpoint saved: the run has no output directory (--out)";
    } else if (steps_done == start_step) {
      msg += "\nno step completed in this run: nothing new to checkpoint";
    } else {
      Result<std::string> ck = checkpoint(steps_done, done_position);
      msg += ck.is_ok() ? fmt::format(
                              "\ncheckpoint of the last completed step ({}) saved to {}; "
                              "continue with --resume {} under a larger --device-memory",
                              steps_done, *ck, *ck)
                        : "\nsaving a checkpoint failed too: " + ck.status().message();
    }
    return Status::out_of_memory(msg);
  };
  auto save_report = [&](int step, const std::string& report) -> std::string {
    if (o.out_dir.empty()) return "";
    std::error_code ec;  // rank 0 made it before step one; another machine's rank may not have
    std::filesystem::create_directories(o.out_dir, ec);
    // Several ranks share --out: each failing rank writes its own report.
    const std::string path =
        R == 1 ? fmt::format("{}/oom-report-step-{:06d}.txt", o.out_dir, step)
               : fmt::format("{}/oom-report-step-{:06d}-rank-{}.txt", o.out_dir, step, rank);
    std::ofstream f(path, std::ios::app);  // a step's later failures are appended
    f << report << "\n";
    return f.good() ? path : "";
  };
  // Bucketed: a re-plan changes the micro-batch (the token budget) or the techniques, so the
  // shapes are planned again and the largest one's region faulted in first (see warm_up).
  auto after_replan = [&]() -> Status {
    shapes->reset(elastic.plan().policy);
    if (!bucketed) return Status::ok();
    mb_shapes = micro_batch_shapes(docs->batch_shapes(), elastic.micro_batch(), T);
    HR_ASSIGN_OR_RETURN(largest_shape, shapes->largest(mb_shapes));
    // The offload tier was made for the first plan's shapes: the new shapes must fit its region.
    HR_ASSIGN_OR_RETURN(const plan::Region* need, largest_offload_region());
    const uint64_t tier_acts = plan::offloaded_activation_bytes(*tier_plan);
    if (need && need->layout.size > tier_acts) {
      return Status::out_of_memory(fmt::format(
          "after the re-plan, a micro-batch shape offloads {} of activations, more than the {} "
          "the offload tier was made with; restart the run with the new budget",
          format_bytes(need->layout.size), format_bytes(tier_acts)));
    }
    elastic.release_unused();
    return warm_up();
  };
  // ---- several ranks re-plan together (docs/notes/elastic.md, "Several ranks") ----
  // A collective of the training thread inside a step: through the communication queue when
  // there is one, after what is queued there (ZeRO-2/3's reductions and gathers), so that every
  // rank issues its collectives in the same order.
  auto in_order = [&](const std::function<Status()>& op) -> Status {
    if (!comm_queue) return op();
    Status st;
    comm_queue->wait(comm_queue->submit([&]() {
      st = op();
      return Status::ok();
    }));
    return st;
  };
  // This rank's room for the step region: its ceiling less its persistent regions (ZeRO shards
  // make those differ a little between ranks; the room is what the plans compete for).
  auto room_of = [&](uint64_t c) -> uint64_t {
    return c > elastic.persistent_bytes() ? c - elastic.persistent_bytes() : 0;
  };
  int budget_rank = 0;  // the rank whose room bounds the agreed plan
  // Set when every rank already holds the agreed failure of the step (settle agrees no more).
  bool failure_agreed = false;
  // The smallest room over the ranks and the (lowest) rank that has it, from values[r] = room_r.
  auto smallest_room = [&](const std::vector<double>& rooms, int stride, int at) {
    int bind = 0;
    for (int r = 1; r < R; r++) {
      if (rooms[size_t(r * stride + at)] < rooms[size_t(bind * stride + at)]) bind = r;
    }
    return std::pair<uint64_t, int>(uint64_t(rooms[size_t(bind * stride + at)]), bind);
  };
  // After every rank re-planned for the same room: the same micro-batch and step region on all
  // (the choice is deterministic; a difference would unmatch the collectives, so it is checked).
  auto check_same_plan = [&]() -> Status {
    const int64_t b = elastic.micro_batch(), bytes = int64_t(elastic.plan().step_bytes);
    int64_t v[4] = {b, -b, bytes, -bytes};
    HR_RETURN_IF_ERROR(in_order([&] { return comm.all_reduce_min(v, 4); }));
    if (v[0] != -v[1] || v[2] != -v[3]) {
      return Status::internal(fmt::format(
          "the ranks re-planned differently (micro-batch {} to {}, step region {} to {} bytes); "
          "this is a bug: please report it",
          v[0], -v[1], v[2], -v[3]));
    }
    return Status::ok();
  };
  // The agreement at a micro-batch boundary (several ranks). OK with *a untouched when every
  // rank's acquisition succeeded; OK with *a an error after every rank re-planned (acquire
  // again); an error when the step cannot go on: every rank returns one (a failure other than
  // out of memory, or nothing fits the smallest room), and settle() stops all, checkpointing.
  auto recover_together = [&](int step, const std::string& where, int remaining,
                              Result<memory::Arena>* a) -> Status {
    const bool oom = !a->is_ok() && a->status().code() == StatusCode::kOutOfMemory;
    // Out of memory: as on one process, this rank's plans may use less than the plan that failed.
    if (oom) ceiling = std::min<uint64_t>(limit.budget(), planned_peak() - 1);
    // Per rank: 1 acquired, 0 out of memory, -1 another failure; its room.
    std::vector<double> v(size_t(2 * R), 0.0);
    v[size_t(2 * rank)] = a->is_ok() ? 1 : oom ? 0 : -1;
    v[size_t(2 * rank + 1)] = double(room_of(ceiling));
    HR_RETURN_IF_ERROR(in_order([&] { return comm.all_reduce(v.data(), 2 * R); }));
    int failed = -1;
    bool other = false;
    for (int r = R - 1; r >= 0; r--) {
      if (v[size_t(2 * r)] < 1) failed = r;
      other = other || v[size_t(2 * r)] < 0;
    }
    if (failed < 0) return Status::ok();
    // Every rank stops with the failing rank's status (the lowest one's), said by that rank.
    auto stop_all = [&](const Status& local) -> Status {
      Status agreed = in_order([&] { return dist::agree(comm, local); });
      failure_agreed = true;
      return agreed.is_ok() ? Status::internal("the ranks disagree on a failure") : agreed;
    };
    if (other) return stop_all(a->is_ok() ? Status::ok() : a->status());
    const Status cause = a->is_ok() ? Status::ok() : a->status();
    *a = Status::out_of_memory("released for the re-plan");  // every rank's region back to the pool
    const auto [room, bind] = smallest_room(v, 2, 1);
    budget_rank = bind;
    // Where the (lowest) failing rank was, in its own sequence numbers: said by that rank.
    const Status said = in_order([&] {
      return dist::agree(comm, rank == failed ? Status::out_of_memory(where) : Status::ok());
    });
    const std::string prefix = fmt::format("rank {}: ", failed);
    const std::string failed_where =
        said.message().rfind(prefix, 0) == 0 ? said.message().substr(prefix.size()) : where;
    std::string report =
        oom ? elastic.oom_report(cause, fmt::format("at step {}, {}", step + 1, where),
                                 limit.budget(), tracking.stats())
            : fmt::format("out of memory on rank {} at step {}, {}; rank {} re-plans with it\n",
                          failed, step + 1, failed_where, rank);
    const std::string bound = fmt::format(
        "rank {}'s room of {} for the step region bounds the plan", bind, format_bytes(room));
    Result<ElasticStep::Replan> rp = elastic.replan(elastic.persistent_bytes() + room, remaining);
    if (!rp.is_ok()) {
      // The same on every rank (the same room, the same search): all stop here.
      report += fmt::format("  re-planning under {} ({}) found nothing that fits: {}\n",
                            format_bytes(elastic.persistent_bytes() + room), bound,
                            rp.status().message());
      if (oom) save_report(step + 1, report);
      return stop_all(oom ? Status::out_of_memory(report) : Status::ok());
    }
    HR_RETURN_IF_ERROR(check_same_plan());
    report += fmt::format("  alternatives computed by the planner (under {}; {}):\n{}",
                          format_bytes(elastic.persistent_bytes() + room), bound, rp->alternatives);
    if (Status st = after_replan(); !st.is_ok())
      return Status::out_of_memory(report + st.message());
    const std::string path = oom ? save_report(step + 1, report) : "";
    cur.events.push_back(fmt::format(
        "step {}: out of memory on rank {} {}: {}: re-planned {} on every rank; redoing it{}",
        step + 1, failed, failed_where, bound, rp->change,
        path.empty() ? "" : " (report: " + path + ")"));
    if (rec) {
      note_replan(&rec->events, ReplanCause::kOutOfMemory, true, cur.events.back(), step,
                  us_since_start(Clock::now()));
    }
    if (oom) cur.oom_reports.push_back(report);
    cur.oom_recoveries++;
    cur.replans++;
    return Status::ok();
  };
  // The step region for the next micro-batch (or validation). An allocation failure is recovered
  // here, before any compute of that micro-batch: plans are chosen again under less memory (the
  // micro-batch must divide the `remaining` sequences of the step) and the acquisition retried.
  // Bucketed (`length` > 0): the region of the micro-batch shape (rows, length) with
  // rows = min(rows_per_micro_batch, `rows_left`) for the plan's micro-batch, its plan in *shape.
  // Several ranks: every rank calls it at every micro-batch boundary (`participate` true for a
  // micro-batch of another rank, bucketed: no region, only the agreement); the ranks agree
  // whether any acquisition failed, and if one did, every rank drops its region, re-plans for
  // the smallest room and acquires again, so that all redo the micro-batch with one plan.
  auto acquire = [&](int step, const std::string& where, int remaining, int length = 0,
                     int rows_left = 0, const plan::MemoryPlan** shape = nullptr,
                     bool participate = false) -> Result<memory::Arena> {
    auto try_acquire = [&]() -> Result<memory::Arena> {
      if (length == 0) return elastic.acquire();
      const int rows = std::min(rows_per_micro_batch(elastic.micro_batch(), T, length), rows_left);
      HR_ASSIGN_OR_RETURN(*shape, shapes->get(rows, length));
      return elastic.acquire_shape(**shape);
    };
    while (true) {
      Result<memory::Arena> a =
          participate ? Result<memory::Arena>(memory::Arena()) : try_acquire();
      if (R > 1) {
        HR_RETURN_IF_ERROR(recover_together(step, where, remaining, &a));
        if (a.is_ok()) return a;
        continue;  // every rank re-planned: acquire again
      }
      if (a.is_ok() || a.status().code() != StatusCode::kOutOfMemory) return a;
      const std::string at = fmt::format("at step {}, {}", step + 1, where);
      std::string report = elastic.oom_report(a.status(), at, limit.budget(), tracking.stats());
      ceiling = std::min<uint64_t>(limit.budget(), planned_peak() - 1);
      Result<ElasticStep::Replan> rp = elastic.replan(ceiling, remaining);
      if (!rp.is_ok()) {
        report += fmt::format("  re-planning under {} found nothing that fits: {}\n",
                              format_bytes(ceiling), rp.status().message());
        save_report(step + 1, report);
        return fail_out_of_memory(report);
      }
      report += fmt::format("  alternatives computed by the planner (under {}):\n{}",
                            format_bytes(ceiling), rp->alternatives);
      if (Status st = after_replan(); !st.is_ok()) return fail_out_of_memory(report + st.message());
      const std::string path = save_report(step + 1, report);
      cur.events.push_back(fmt::format("step {}: out of memory {}: re-planned {}; redoing it{}",
                                       step + 1, where, rp->change,
                                       path.empty() ? "" : " (report: " + path + ")"));
      if (rec) {
        note_replan(&rec->events, ReplanCause::kOutOfMemory, true, cur.events.back(), step,
                    us_since_start(Clock::now()));
      }
      cur.oom_reports.push_back(report);
      cur.oom_recoveries++;
      cur.replans++;
    }
  };
  // Several ranks, before each step: every rank's budget (`now`, from its file), agreed; when one
  // changed, every rank re-plans for the smallest room, the whole step.
  // A budget re-plan's record (the event line, the trace's replan, the bound buffers), on one
  // process or every rank alike.
  auto finish_budget_replan = [&](const std::string& head, const ElasticStep::Replan& rp,
                                  int step) -> Status {
    cur.events.push_back(
        fmt::format("{}: {} {}", head, rp.changed ? "re-planned" : "plan kept,", rp.change));
    if (rec) {
      note_replan(&rec->events, ReplanCause::kBudget, rp.changed, cur.events.back(), step,
                  us_since_start(Clock::now()));
    }
    if (Status st = after_replan(); !st.is_ok())
      return fail_out_of_memory(head + ": " + st.message());
    cur.replans += rp.changed;
    return Status::ok();
  };
  auto follow_budgets = [&](int step, uint64_t now) -> Status {
    const uint64_t old = limit.budget();
    if (now != old) {
      limit.set_budget(now);
      ceiling = now;
    }
    // Per rank: the budget before, now, and the room for the step region.
    std::vector<double> v(size_t(3 * R), 0.0);
    v[size_t(3 * rank)] = double(old);
    v[size_t(3 * rank + 1)] = double(now);
    v[size_t(3 * rank + 2)] = double(room_of(ceiling));
    HR_RETURN_IF_ERROR(in_order([&] { return comm.all_reduce(v.data(), 3 * R); }));
    std::string changes;
    for (int r = 0; r < R; r++) {
      if (v[size_t(3 * r)] == v[size_t(3 * r + 1)]) continue;
      changes += fmt::format("{}budget {} -> {} on rank {}", changes.empty() ? "" : ", ",
                             format_bytes(uint64_t(v[size_t(3 * r)])),
                             format_bytes(uint64_t(v[size_t(3 * r + 1)])), r);
    }
    if (changes.empty()) return Status::ok();
    const auto [room, bind] = smallest_room(v, 3, 2);
    budget_rank = bind;
    const std::string head = fmt::format(
        "step {}: {} (rank {}'s budget {}, room {} for the step region, bounds the plan of {} "
        "ranks)",
        step + 1, changes, bind, format_bytes(uint64_t(v[size_t(3 * bind + 1)])),
        format_bytes(room), R);
    Result<ElasticStep::Replan> rp = elastic.replan(elastic.persistent_bytes() + room, share);
    // The same outcome on every rank (the same room, the same search).
    if (!rp.is_ok()) return fail_out_of_memory(head + ": no plan fits: " + rp.status().message());
    HR_RETURN_IF_ERROR(check_same_plan());
    return finish_budget_replan(head, *rp, step);
  };
  // Before each step, on a device that says what it has free (TrainOptions::
  // device_budget_probe): the budget is what this run holds plus the device's free memory less a
  // margin. Free memory moves a little at every step (the driver, a library's lazy workspace, a
  // neighbour process), so only a move that matters re-plans: a budget the current plan no longer
  // fits under (the step must shrink), or one 5% above the current budget (room to grow).
  auto follow_probe = [&](int step) -> Status {
    Result<uint64_t> probed = o.device_budget_probe(limit.in_use());
    const uint64_t old = limit.budget();
    uint64_t now = old;
    if (!probed.is_ok()) {
      if (probed.status().message() != last_file_error) {
        last_file_error = probed.status().message();
        cur.events.push_back(fmt::format("step {}: warning: {}{}; keeping the budget {}", step + 1,
                                         R > 1 ? fmt::format("rank {}: ", rank) : "",
                                         last_file_error, format_bytes(old)));
      }
    } else if (*probed < planned_peak() || *probed > old + old / 20) {
      now = *probed;
    }
    if (R > 1) return follow_budgets(step, now);
    if (now == old) return Status::ok();
    limit.set_budget(now);
    ceiling = now;
    Result<ElasticStep::Replan> rp = elastic.replan(ceiling, G);
    const std::string head = fmt::format("step {}: the device's free memory: budget {} -> {}",
                                         step + 1, format_bytes(old), format_bytes(now));
    if (!rp.is_ok()) {
      return fail_out_of_memory(head + ": no plan fits: " + rp.status().message());
    }
    return finish_budget_replan(head, *rp, step);
  };
  // Before each step: the budget file, read again; a change re-plans for the whole step.
  auto follow_budget = [&](int step) -> Status {
    if (o.device_memory_file.empty()) {
      return o.device_budget_probe ? follow_probe(step) : Status::ok();
    }
    Result<uint64_t> nb = read_budget_file(budget_file);
    if (!nb.is_ok()) {
      // Mid-run (an editor saving, a typo) the run goes on under the budget it has.
      if (nb.status().message() != last_file_error) {
        last_file_error = nb.status().message();
        cur.events.push_back(fmt::format("step {}: warning: {}{}; keeping the budget {}", step + 1,
                                         R > 1 ? fmt::format("rank {}: ", rank) : "",
                                         last_file_error, format_bytes(limit.budget())));
      }
      if (R == 1) return Status::ok();
    } else {
      last_file_error.clear();
    }
    const uint64_t old = limit.budget();
    if (R > 1) return follow_budgets(step, nb.is_ok() ? *nb : old);
    if (*nb == old) return Status::ok();
    limit.set_budget(*nb);
    ceiling = *nb;
    Result<ElasticStep::Replan> rp = elastic.replan(ceiling, G);
    const std::string head =
        fmt::format("step {}: budget {} -> {}", step + 1, format_bytes(old), format_bytes(*nb));
    if (!rp.is_ok()) {
      return fail_out_of_memory(head + ": no plan fits: " + rp.status().message());
    }
    return finish_budget_replan(head, *rp, step);
  };

  // Note [Self-correction]: after `skip_steps`, `measure_steps` steps of one plan are timed by
  // kind; then each kind of the model's prediction for that plan is scaled to what was measured,
  // the correction saved for the next run (rank 0), and with `replan` the micro-batch and
  // recomputation chosen again by the corrected model. sc_steps < 0: done.
  auto self_correct = [&](int step, StepStats& s) -> Status {
    const int index = step - start_step;
    if (index < sc.skip_steps) return Status::ok();
    const std::string exec = plan::describe_exec(elastic.plan().policy.exec);
    if (s.replans > 0 ||
        (sc_steps > 0 && (elastic.micro_batch() != sc_micro_batch || exec != sc_exec))) {
      sc_steps = 0;  // the plan changed under the measurement: start again
      sc_measured = {};
      sc_step_seconds = 0;
      if (s.replans > 0) return Status::ok();
    }
    sc_micro_batch = elastic.micro_batch();
    sc_exec = exec;
    for (size_t k = 0; k < size_t(model::OpKind::kCount); k++)
      sc_measured[k] += s.op_ms.ms[k] / 1e3;
    sc_measured[size_t(plan::CostKind::kOptimizer)] += s.optimizer_ms / 1e3;
    sc_step_seconds += s.step_ms / 1e3;
    if (++sc_steps < sc.measure_steps) return Status::ok();
    std::array<double, plan::kCostKinds> measured{};
    for (size_t k = 0; k < plan::kCostKinds; k++) measured[k] = sc_measured[k] / sc_steps;
    plan::DeviceSpec dev = elastic.device();
    plan::DeviceSpec base = dev;
    base.correction = plan::CostCorrection();
    const plan::StepCost cost = plan::estimate_step(cfg, elastic.plan(), base);
    const double tokens = double(elastic.micro_batch()) * T * elastic.accumulation();
    dev.correction =
        plan::correction_from(cost.uncorrected_by_kind, measured, sc_step_seconds / sc_steps,
                              tokens, sc_steps, cost.fused_head_gemm_seconds);
    const double before = elastic.predicted_step_ms();
    elastic.set_device(dev);
    std::string scales;
    for (size_t k = 0; k < plan::kCostKinds; k++) {
      scales += fmt::format("{}{} {:.2f}", k ? ", " : "", plan::cost_kind_name(plan::CostKind(k)),
                            dev.correction.scale[k]);
    }
    s.events.push_back(fmt::format(
        "step {}: cost model corrected from {} measured steps (mean {:.0f} ms): "
        "predicted {:.0f} -> {:.0f} ms/step; scales {}; outside the kinds {:.2f} us/token",
        step + 1, sc_steps, 1e3 * sc_step_seconds / sc_steps, before, elastic.predicted_step_ms(),
        scales, dev.correction.other_seconds_per_token * 1e6));
    if (rank == 0 && !sc.cache_path.empty()) {
      Status saved =
          plan::save_correction(sc.cache_path, sc.machine_key, correction_key, dev.correction);
      if (!saved.is_ok()) s.events.push_back("cost model: " + saved.message());
    }
    sc_steps = -1;
    if (!keep_op_times) net.set_op_times(nullptr);
    if (!sc.replan || R > 1 || step + 1 >= total_steps) return Status::ok();
    Result<ElasticStep::Replan> rp = elastic.replan(ceiling, G);
    if (!rp.is_ok()) return Status::ok();  // the current plan still fits: keep it
    if (rp->changed) {
      s.events.push_back(fmt::format("step {}: re-planned with the corrected cost model: {}",
                                     step + 1, rp->change));
      if (rec) {
        note_replan(&rec->events, ReplanCause::kCostModel, true, s.events.back(), step,
                    us_since_start(Clock::now()));
      }
      HR_RETURN_IF_ERROR(after_replan());
      s.replans++;
    }
    return Status::ok();
  };

  // Validation over the same sequences whatever the micro-batch: each batch of the validation
  // staging (the run's first micro-batch, B sequences) runs in pieces of the current micro-batch
  // b. When b does not divide B (a re-plan grew the micro-batch past B, or chose one that does
  // not divide it), the pieces of other sizes take their shape's plan (train/shape_plans.h),
  // each acquired on its own: never more than b x T tokens of step region.
  auto evaluate = [&](int step) -> Result<std::optional<double>> {
    if (!val_batches) return std::optional<double>();
    if (rec) rec->events.set_pool_context(step, -1);
    offload_tier->bind(net, elastic.plan());
    val_batches->set_position(val_range.begin);
    double sum = 0;
    int64_t count = 0;
    if (B % elastic.micro_batch() == 0) {
      const int b = elastic.micro_batch();
      Result<memory::Arena> arena = acquire(step, "for validation", share);
      if (!arena.is_ok()) {
        // ZeRO-3 gathers parameters in every forward: the others expect this rank's gathers.
        if (zw) {
          for (int i = 0; i < o.eval_batches * (B / b); i++) zw->skip_micro_batch(false);
          (void)zw->finish_step();
        }
        return arena.status();
      }
      net.bind_activations(&*arena, &elastic.plan().activations, b, T);
      for (int i = 0; i < o.eval_batches; i++) {
        next_val_batch();
        for (int q = 0; q < B; q += b) {
          int64_t valid = 0;
          if (zw) zw->begin_micro_batch(false);
          sum += net.forward(val_inputs + int64_t(q) * T, val_targets + int64_t(q) * T, &valid);
          count += valid;
        }
      }
    } else {
      // Only after a re-plan (several ranks re-plan together: the same pieces on every rank).
      for (int i = 0; i < o.eval_batches; i++) {
        next_val_batch();
        for (int q = 0; q < B;) {
          const plan::MemoryPlan* shape = nullptr;
          Result<memory::Arena> piece = acquire(step, "for validation", share, T, B - q, &shape);
          if (!piece.is_ok()) {
            // Every rank fails here together (agreed): what is queued finishes first.
            if (zw) (void)zw->finish_step();
            return piece.status();
          }
          memory::Arena arena = std::move(*piece);
          const int rows = shape->policy.micro_batch;
          net.bind_activations(&arena, &shape->activations, rows, T);
          offload_tier->bind(net, *shape);
          int64_t valid = 0;
          if (zw) zw->begin_micro_batch(false);
          sum += net.forward(val_inputs + int64_t(q) * T, val_targets + int64_t(q) * T, &valid);
          count += valid;
          q += rows;
        }
      }
    }
    if (zw) HR_RETURN_IF_ERROR(zw->finish_step());
    return count ? std::optional<double>(sum / double(count)) : std::optional<double>();
  };

  std::vector<double> tps;
  int64_t padded_slots = 0, real_tokens = 0;  // over the run's steps: the padding fraction
  // The loader thread fills the next steps' micro-batches into the staging slots while this
  // thread computes; the slot's tag is the data position after it (what a checkpoint saves).
  // Declared after the arenas, so it stops before they are released.
  // Bucketed: a slot holds one step batch, rows x length <= G x T tokens; its shape is kept
  // beside the slot (written by the loader thread before the slot is handed over).
  std::vector<data::DocumentBatcher::Shape> slot_shape(static_cast<size_t>(depth));
  // The fill's times per slot (for the profile's loader track): written by the loader thread
  // before the slot is handed over, read by this thread after acquire() and before release().
  std::vector<std::pair<Clock::time_point, Clock::time_point>> fill_times(
      static_cast<size_t>(depth));
  // A device's copies of each filled slot, queued by the loader thread after filling it (the
  // copy waits for the steps queued before it, which read the slot's previous tokens): written
  // before the slot is handed over, waited by this thread after acquire().
  std::vector<std::array<uint64_t, 2>> slot_copies(static_cast<size_t>(depth), {0, 0});
  data::Prefetcher loader(depth, [&](int slot) {
    const Clock::time_point tf = Clock::now();
    int32_t* in = static_cast<int32_t*>(host_staging.data(size_t(2 * slot)));
    int32_t* tg = static_cast<int32_t*>(host_staging.data(size_t(2 * slot + 1)));
    if (bucketed) {
      slot_shape[size_t(slot)] = docs->next(in, tg);
      slot_copies[size_t(slot)] = upload_staging_async(size_t(2 * slot), 2);
      fill_times[size_t(slot)] = {tf, Clock::now()};
      return docs->position();
    }
    for (int k = 0; k < K * R; k++)
      train_batches.next(in + int64_t(k) * B * T, tg + int64_t(k) * B * T);
    slot_copies[size_t(slot)] = upload_staging_async(size_t(2 * slot), 2);
    fill_times[size_t(slot)] = {tf, Clock::now()};
    return train_batches.position();
  });
  // A rank's failure inside a step (out of memory, validation) becomes every rank's: agreed at
  // the step boundary, before the step's collectives. One process recovers inside acquire()
  // (and checkpoints there when it cannot); several ranks stop here, checkpointing first.
  auto settle = [&](const Status& local) -> Status {
    Status agreed = failure_agreed ? local : dist::agree(comm, local);
    failure_agreed = false;
    if (agreed.is_ok() || R == 1) return agreed;
    if (agreed.code() == StatusCode::kOutOfMemory) return fail_out_of_memory(agreed.message());
    return agreed;
  };
  // Set-up succeeded on this rank; from here every rank reaches the same collectives.
  *setup_agreed = true;
  HR_RETURN_IF_ERROR(dist::agree(world, Status::ok()));  // run_training's failing rank: world's
  // --minutes: the budget counts from here (the first validation, then the steps).
  const Clock::time_point budget_start = Clock::now();
  double eval_at_start_s = 0;
  double budget_step_sum_s = 0;  // the timed steps (the first excepted), for their mean
  int budget_steps_timed = 0;
  if (o.eval_at_start) {
    // The validation loss before this run's first step: what the end's figure is measured from.
    auto tv = Clock::now();
    Result<std::optional<double>> val = evaluate(start_step);
    HR_RETURN_IF_ERROR(settle(val.status()));
    record("validation", "validation", tv, start_step, -1);
    eval_at_start_s = ms_since(tv) / 1e3;
    result.initial_val_loss = *val;
    if (*val && cb.on_initial_validation) cb.on_initial_validation(**val);
  }
  // --minutes: the count that fits the rest of the budget at the mean time of the steps so far
  // (the first excepted): estimated after step kMinutesDecisionStep, for the progress line, and
  // fixed after the warmup's last step, the last whose rate does not depend on the count; rank
  // 0's, so that every rank stops at the same step.
  int estimated_steps = 0;
  auto budget_steps = [&](int steps_now, bool fix, StepStats& s) -> Status {
    const double mean = budget_steps_timed ? budget_step_sum_s / budget_steps_timed : 0.0;
    TimeBudget b;
    b.budget_s = o.minutes * 60;
    b.steps_done = steps_now;
    b.step_s = o.minutes_assume_step_s > 0 ? o.minutes_assume_step_s : mean;
    b.elapsed_s = o.minutes_assume_step_s > 0 ? steps_now * o.minutes_assume_step_s
                                              : ms_since(budget_start) / 1e3;
    // A validation's time: measured before the first step, or taken as a step's (it runs
    // eval_batches forward passes where a step runs G / B forward and backward ones).
    b.eval_s = o.minutes_assume_step_s > 0 ? o.minutes_assume_step_s
               : eval_at_start_s > 0       ? eval_at_start_s
                                           : b.step_s;
    b.eval_every = o.eval_every;
    b.max_steps = o.steps;
    int64_t n = steps_within(b);
    if (R > 1) HR_RETURN_IF_ERROR(comm.broadcast(&n, int64_t(sizeof(n)), 0));
    const std::string capped =
        n == o.steps ? fmt::format(", capped by --steps {}", o.steps) : std::string();
    if (!fix) {
      estimated_steps = int(n);
      s.events.push_back(fmt::format(
          "--minutes {:g}: about {} steps (a step {:.0f} ms over steps 2-{}{}); the count is "
          "fixed after step {}, the warmup's last",
          o.minutes, n, b.step_s * 1e3, steps_now, capped, o.warmup_steps));
      if (n <= o.warmup_steps) {
        s.events.push_back(fmt::format(
            "--minutes {:g}: the budget ends inside the warmup of {} steps, which the run "
            "completes: give a shorter --warmup",
            o.minutes, o.warmup_steps));
      }
    } else {
      total_steps = int(n);
      steps_fixed = true;
      s.events.push_back(fmt::format(
          "--minutes {:g}: {} steps (a step {:.0f} ms, the mean of steps 2-{}; {:.1f} s of the "
          "budget spent{})",
          o.minutes, total_steps, b.step_s * 1e3, steps_now, b.elapsed_s, capped));
      if (total_steps < 2 * o.warmup_steps) {
        s.events.push_back(fmt::format(
            "--minutes {:g}: the warmup of {} steps is over half the run's {}: a shorter "
            "--warmup leaves more of it at the peak rate",
            o.minutes, o.warmup_steps, total_steps));
      }
    }
    s.steps = int(n);
    return Status::ok();
  };
  for (int step = start_step; step < total_steps; step++) {
    // Nsight Systems: the step, its data wait, micro-batches, forward, backward and optimizer.
    const backend::nvtx::Range nvtx_step(
        backend::nvtx::kEnabled ? fmt::format("step {}", step).c_str() : "");
    auto t0 = Clock::now();
    const double cpu0 = process_cpu_ms();
    cur = StepStats();
    const model::OffloadCopier::Stats copies0 = offload_tier->copy_stats();
    HR_RETURN_IF_ERROR(follow_budget(step));
    tracking.reset_peak();
    // The whole step's micro-batches are there before the first forward, so the loss is
    // normalised by the valid tokens of the whole optimizer step (not per micro-batch).
    auto td = Clock::now();
    const data::Prefetcher::Ready batch = [&] {
      const backend::nvtx::Range r("wait for data");
      return loader.acquire();
    }();
    const double data_ms = batch.waited_ms;
    record_op("wait for data", EventPhase::kData, td, Clock::now(), step);
    record_op("load batch", EventPhase::kData, fill_times[size_t(batch.slot)].first,
              fill_times[size_t(batch.slot)].second, step, kEventThreadLoader);
    // The slot's tokens on the backend (copied over from the loader's host slot on a device, by
    // the loader thread: waited for here, once; a retried step finds them there); the host's
    // copy for what the trainer itself reads (the valid-token count).
    for (uint64_t& ticket : slot_copies[size_t(batch.slot)]) {
      ops.wait_copy(ticket);
      ticket = 0;
    }
    const int32_t* inputs = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot)));
    const int32_t* targets = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot + 1)));
    const int32_t* host_targets =
        static_cast<const int32_t*>(host_staging.data(size_t(2 * batch.slot + 1)));
    // The step's shape: G x T when packed; one bucket's rows x length when bucketed.
    const int len = bucketed ? slot_shape[size_t(batch.slot)].length : T;
    const int step_rows = bucketed ? slot_shape[size_t(batch.slot)].rows : G;
    // This rank's rows of the step. Bucketed: every rank walks the step's micro-batches and runs
    // every R-th one from its rank on (a step's micro-batches vary in number and shape).
    const int my_rows = bucketed ? step_rows : share, row0 = bucketed ? 0 : first;
    // Every rank has the whole step's tokens: the loss is normalised by the global step's.
    int64_t step_valid = 0;
    for (int64_t i = 0; i < int64_t(step_rows) * len; i++) step_valid += host_targets[i] >= 0;
    // fp16 scales the loss gradient by S (exact for a power of two); fp32 and bf16 by 1.
    const float loss_scale = scaler ? scaler->scale() : 1.0f;
    float dloss = step_valid ? loss_scale / float(step_valid) : 0.0f;
    if (std::find(o.inject_overflow_steps.begin(), o.inject_overflow_steps.end(), step) !=
        o.inject_overflow_steps.end()) {
      // Test hook: an fp16 overflow in this rank's backward, before any reduction (the gradients
      // become inf/NaN however and whenever they are reduced: after backward, or overlapped).
      dloss = std::numeric_limits<float>::infinity();
    }
    double loss_sum = 0;
    // This rank's `share` sequences lie in the slot one after another; they are cut into
    // micro-batches of the current plan, which may change between two of them (a recovery).
    Status local;
    if (zw) zw->begin_step();
    int micro_batches = 0;
    int done = 0;
    for (int k = 0; done < my_rows; k++) {
      if (bucketed && k % R != rank) {  // another rank's micro-batch
        // Its acquisition is agreed by every rank (a failure there re-plans this rank too).
        Result<memory::Arena> none = acquire(step, fmt::format("at micro-batch {}", k + 1), G, len,
                                             my_rows - done, nullptr, /*participate=*/true);
        if (!none.is_ok()) {
          local = none.status();
          break;
        }
        done += rows_per_micro_batch(elastic.micro_batch(), T, len);
        // ZeRO-2/3 reduce gradient windows (and ZeRO-3 gathers parameters) in every micro-batch,
        // collectives of all ranks: this rank makes the hook calls with empty windows.
        if (zw) zw->skip_micro_batch(true);
        continue;
      }
      const plan::MemoryPlan* shape = nullptr;
      if (rec) rec->events.set_pool_context(step, k);
      Result<memory::Arena> arena = acquire(
          step,
          fmt::format("at micro-batch {} (sequence {} of {})", k + 1, row0 + done + 1, step_rows),
          bucketed ? G : share - done, bucketed ? len : 0, my_rows - done, &shape);
      if (!arena.is_ok()) {
        local = arena.status();
        break;
      }
      // Bucketed: rows of `len` tokens under the plan's token budget b x T (its shape's plan).
      const plan::MemoryPlan& mbp = shape ? *shape : elastic.plan();
      const int b = mbp.policy.micro_batch;
      net.bind_activations(&*arena, &mbp.activations, b, len);
      offload_tier->bind(net, mbp);
      const int32_t* in = inputs + int64_t(row0 + done) * len;
      const int32_t* tg = targets + int64_t(row0 + done) * len;
      const backend::nvtx::Range nvtx_mb(
          backend::nvtx::kEnabled ? fmt::format("micro-batch {}", k).c_str() : "");
      auto tm = Clock::now();
      if (rec) begin_micro_batch(&rec->events, mbp, step, k, us_since_start(tm));
      if (zw) zw->begin_micro_batch(true);
      if (bucket_hooks) bucket_hooks->set_active(done + b >= my_rows);
      // dloss is known before the forward: the loss and the logits' gradient in one pass
      // (Note [One-pass loss and gradient] in docs/notes/loss.md).
      // Distillation: the teacher's forward (no targets, no head) into its part of this step
      // region; the student's fused head then reads its final hidden states.
      backend::KdTeacher kd_teacher;
      if (teacher_net) {
        teacher_net->bind_activations(&*arena, mbp.activations.teacher.get(), b, len);
        teacher_net->forward(in, nullptr);
        kd_teacher = teacher_net->kd_teacher();
        net.set_teacher(&kd_teacher);
      }
      net.set_next_dloss(dloss);
      {
        const backend::nvtx::Range r("forward");
        loss_sum += net.forward(in, tg);
      }
      {
        const backend::nvtx::Range r("backward");
        net.backward(in, tg, dloss);
      }
      net.set_teacher(nullptr);
      record("micro-batch", "micro_batch", tm, step, k);
      // Activation offload's copies of this micro-batch, on the profile's copy track.
      if (model::OffloadCopier* copier = rec ? offload_tier->copier() : nullptr) {
        for (const model::OffloadCopier::Span& c : copier->take_spans()) {
          record_op("offload copy", EventPhase::kNone, c.start, c.end, step, kEventThreadCopy);
        }
      }
      done += b;
      micro_batches++;
    }
    loader.release(batch.slot);
    if (zw) {
      // A rank that could not compute still owes the others the collectives of the step's
      // remaining micro-batches (several ranks never re-plan, so the micro-batch is unchanged);
      // then the queue drains before agree(), a collective of the training thread.
      if (!local.is_ok()) {
        const int step_rows_each =
            bucketed ? rows_per_micro_batch(elastic.micro_batch(), T, len) : elastic.micro_batch();
        for (; done < my_rows; done += step_rows_each) zw->skip_micro_batch(true);
      }
      Status reduced = zw->finish_step();
      if (local.is_ok()) local = std::move(reduced);
    }
    if (reducer) {
      // A rank that could not compute launches every bucket the others are reducing.
      if (!local.is_ok()) reducer->flush();
      bucket_hooks->set_active(false);
      Status reduced = reducer->wait();
      if (local.is_ok()) local = std::move(reduced);
    }
    HR_RETURN_IF_ERROR(settle(local));
    HR_RETURN_IF_ERROR(comm.all_reduce(&loss_sum, 1));
    const float lr = cosine_lr(step, total_steps, o.warmup_steps, o.adamw.lr, o.min_lr_ratio);
    std::optional<backend::nvtx::Range> nvtx_opt;  // the optimizer step, to "zero gradients"
    nvtx_opt.emplace("optimizer");
    auto topt = Clock::now();
    const double cpu_opt = process_cpu_ms();
    // The optimizer step as an op around its parts (collectives, zeroing the gradients).
    const uint32_t opt_op = rec ? rec->events.log().intern("optimizer step") : 0;
    if (rec) rec->events.begin_op(us_since_start(topt), opt_op, EventPhase::kOptimizer, step);
    // ZeRO-2/3: the windows were reduce-scattered into grad_shard during backward. Stage 0
    // without offload zeroes the gradients inside AdamW's pass (also on a skipped step); the
    // others read them no more after the step, and zero them below.
    const ZeroBuffers zb{stage == 3 ? param_shard : params,
                         grads,
                         grad_shard,
                         m,
                         v,
                         /*grads_reduced=*/zw.has_value() || reducer.has_value(),
                         /*zero_grads=*/stage == 0 && !offload};
    // With loss scaling an overflow (a non-finite norm, the same on every rank: it is computed
    // from the reduced gradients) leaves params, m and v untouched; AdamW's bias correction
    // counts the updates applied. The learning-rate schedule follows the step (as PyTorch's
    // GradScaler loop), so a skipped step's rate is not replayed.
    const int64_t skipped_before = scaler ? scaler->state().skipped : 0;
    const int adam_step = step + 1 - int(skipped_before);
    if (rec) zcomm.trace(&rec->events, run_start, EventPhase::kOptimizer, step);
    // A sparsity mask: pruned weights get no gradient (so neither the norm, the clipping nor
    // the moments see one); with m = v = 0 and the weight 0, AdamW's update leaves it 0, and the
    // weights are masked after the update all the same (Note in docs/notes/pruning.md).
    if (mask_active) ops.apply_mask(mask, grads, P);
    Result<double> stepped =
        offload ? offload->step(zb.params, grads, grad_shard, params_bf16, o.adamw, lr, adam_step,
                                zb.grads_reduced, scaler ? loss_scale : 0.0f)
                : zopt.step(zb, o.adamw, lr, adam_step, params_bf16, scaler ? loss_scale : 0.0f);
    zcomm.trace(nullptr, run_start, EventPhase::kNone, -1);
    HR_ASSIGN_OR_RETURN(const double norm, std::move(stepped));
    if (mask_active) ops.apply_mask(mask, params, P);
    // --prune-at: after this step's update, the mask from the weights; pruned weights and their
    // moments become zeros (and the bf16 copy follows).
    if (mask && !mask_active && step + 1 == o.prune.at_step) {
      std::vector<float> copy;
      HR_ASSIGN_OR_RETURN(const model::SparsityMask m0,
                          model::make_mask(cfg, table, host_weights(&copy), o.prune.spec));
      ops.copy_to_device(mask, m0.data(), m0.size());
      mask_active = true;
      // (A mask runs without optimizer offload: m and v are the device's, as the mask is.)
      ops.apply_mask(mask, params, P);
      ops.apply_mask(mask, m, P);
      ops.apply_mask(mask, v, P);
      if (params_bf16) ops.cast_to_bf16(params_bf16, params, P);
      const model::MaskCounts mc = model::count_mask(table, m0);
      cur.events.push_back(fmt::format(
          "step {}: pruned {} of {} prunable weights ({:.1f}%, {}); the mask holds from here",
          step + 1, mc.pruned, mc.prunable, 100.0 * double(mc.pruned) / double(mc.prunable),
          o.prune.spec.describe()));
    }
    const bool skipped = scaler && !scaler->update(norm);
    const Clock::time_point tz = Clock::now();
    if (grads && !zb.zero_grads) ops.zero(grads, P);
    record_op("zero gradients", EventPhase::kOptimizer, tz, Clock::now(), step);
    nvtx_opt.reset();
    if (rec) rec->events.end_op(us_since_start(Clock::now()), opt_op, EventPhase::kOptimizer, step);
    const double optimizer_ms = ms_since(topt);
    const double optimizer_cpu_ms = process_cpu_ms() - cpu_opt;

    StepStats s = std::move(cur);
    cur = StepStats();
    steps_done = step + 1;
    done_position = batch.tag;
    s.step = step + 1;
    s.steps = total_steps;
    s.loss = step_valid ? loss_sum / double(step_valid) : 0.0;
    s.lr = lr;
    s.grad_norm = norm;
    s.loss_scale = loss_scale;
    s.skipped = skipped;
    if (skipped) {
      s.events.push_back(fmt::format(
          "step {}: gradient overflow (inf/NaN) at loss scale {:g}: update skipped, scale now {:g}",
          step + 1, double(loss_scale), double(scaler->scale())));
    }
    s.tokens = step_valid;
    s.padding = step_rows ? 1.0 - double(step_valid) / (double(step_rows) * len) : 0.0;
    s.micro_batches = micro_batches;
    padded_slots += int64_t(step_rows) * len;
    real_tokens += step_valid;
    s.data_wait_ms = data_ms;
    s.optimizer_ms = optimizer_ms;
    s.optimizer_cpu_ms = optimizer_cpu_ms;
    s.op_ms = op_times;
    op_times.ms = {};
    op_times.cpu_ms = {};
    // The step's time excludes validation, which is reported on its own line.
    s.step_ms = ms_since(t0);
    s.step_cpu_ms = process_cpu_ms() - cpu0;
    s.tokens_per_s = double(s.tokens) / (s.step_ms / 1000.0);
    if (!steps_fixed) {
      if (step > start_step) {
        budget_step_sum_s += s.step_ms / 1e3;
        budget_steps_timed++;
      }
      if (step + 1 >= o.warmup_steps) {
        HR_RETURN_IF_ERROR(budget_steps(step + 1, true, s));
      } else if (step + 1 == kMinutesDecisionStep) {
        HR_RETURN_IF_ERROR(budget_steps(step + 1, false, s));
      } else if (estimated_steps > 0) {
        s.steps = estimated_steps;
      }
    }
    const bool last = step + 1 == total_steps;
    if ((o.eval_every > 0 && (step + 1) % o.eval_every == 0) || last) {
      auto tv = Clock::now();
      // Every rank evaluates the same validation batches on the same weights (the same result).
      Result<std::optional<double>> val = evaluate(step);
      HR_RETURN_IF_ERROR(settle(val.status()));
      s.val_loss = *val;
      record("validation", "validation", tv, step, -1);
      // A recovery inside validation is reported with this step.
      for (std::string& e : cur.events) s.events.push_back(std::move(e));
      for (std::string& r : cur.oom_reports) s.oom_reports.push_back(std::move(r));
      s.replans += cur.replans;
      s.oom_recoveries += cur.oom_recoveries;
      cur = StepStats();
    }
    if (!correction_note.empty()) {
      s.events.push_back(std::move(correction_note));
      correction_note.clear();
    }
    if (sc.enabled && sc_steps >= 0) {
      HR_RETURN_IF_ERROR(self_correct(step, s));
    }
    s.micro_batch = elastic.micro_batch();
    s.accumulation = elastic.accumulation() * R;
    s.recompute = plan::recompute_summary(elastic.plan().policy.exec);
    s.predicted_step_ms = elastic.predicted_step_ms();
    s.budget_rank = budget_rank;
    result.replans += s.replans;
    result.oom_recoveries += s.oom_recoveries;
    memory::MemoryStats ms = tracking.stats();
    s.device_bytes_in_use = ms.current;
    s.device_bytes_peak = ms.peak;
    s.planned_peak_bytes = planned_peak();
    s.lower_bound_bytes = elastic.plan().lower_bound_bytes;
    s.pool_reserved_bytes = elastic.pool_stats().reserved;
    s.device_budget = limit.budget();
    if (mp.offload_bytes > 0) {
      const memory::MemoryStats os = offload_tier->stats();
      s.offload_bytes_in_use = os.current;
      s.offload_bytes_peak = os.peak;
      s.planned_offload_bytes = tier_plan->offload_bytes;
    }
    // Both kinds' copies over the one host link: the optimizer's (gradients out, weights back)
    // and the activations' (out and back per micro-batch, on the copy thread).
    if (offload) {
      s.offload_copy_ms = offload->last_copy_ms();
      s.offload_bytes = offload->bytes_to_offload() + offload->bytes_to_device();
    }
    const model::OffloadCopier::Stats copies1 = offload_tier->copy_stats();
    if (copies1.bytes > copies0.bytes) {
      s.offload_bytes += copies1.bytes - copies0.bytes;
      s.offload_copy_ms += (copies1.copy_seconds - copies0.copy_seconds) * 1e3;
      s.offload_wait_ms = (copies1.wait_seconds - copies0.wait_seconds) * 1e3;
    }
    if (!std::isfinite(s.loss)) {
      return Status::internal(
          fmt::format("loss became {} at step {} (lr {}); try a lower --lr", s.loss, s.step, lr));
    }
    if (o.save_every > 0 && ((step + 1) % o.save_every == 0 || step + 1 == total_steps)) {
      HR_ASSIGN_OR_RETURN(s.checkpoint, checkpoint(step + 1, batch.tag));
    }
    if (step > start_step) tps.push_back(s.tokens_per_s);
    result.final_loss = s.loss;
    if (s.val_loss) result.final_val_loss = s.val_loss;
    if (cb.on_step) cb.on_step(s);
    if (cb.should_stop) {
      int64_t go_on = cb.should_stop(s) ? 0 : 1;  // any rank's stop stops all
      if (R > 1) HR_RETURN_IF_ERROR(comm.all_reduce_min(&go_on, 1));
      if (!go_on) {
        result.stopped = true;
        break;
      }
    }
  }
  result.total_steps = total_steps;
  result.steps_done = steps_done;
  if (!tps.empty()) {
    std::nth_element(tps.begin(), tps.begin() + tps.size() / 2, tps.end());
    result.tokens_per_s = tps[tps.size() / 2];
  }
  result.memory = tracking.stats();
  if (rec) {
    rec->kernels = std::move(op_times.kernels);
    rec->ops = std::move(op_times.ops);
    result.profile = std::move(rec);
  }
  result.device_bytes_peak = result.memory.peak;
  result.planned_peak_bytes = planned_peak();
  result.padding = padded_slots ? 1.0 - double(real_tokens) / double(padded_slots) : 0.0;
  if (bucketed) {
    result.shape_plans = shapes->misses();
    result.shape_plan_hits = shapes->hits();
  }
  result.lower_bound_bytes = mp.lower_bound_bytes;
  if (zw) result.zero_events = zw->events();
  result.offload_memory = offload_tier->stats();
  result.offload_bytes_peak = result.offload_memory.peak;
  result.planned_offload_bytes = tier_plan->offload_bytes;
  const model::OffloadCopier::Stats copies = offload_tier->copy_stats();
  result.offload_copied_bytes = copies.bytes;
  result.offload_copy_ms = copies.copy_seconds * 1e3;
  result.offload_wait_ms = copies.wait_seconds * 1e3;
  if (result.stopped) return result;
  Status finish;
  // ZeRO-3: the final weights gathered into host memory on every rank (the model file and the
  // callback's input, I/O staging as a checkpoint's).
  const float* final_params = params;
  std::vector<float> gathered;
  if (stage == 3) {
    gathered.resize(static_cast<size_t>(P));
    finish = gather_through(&comm, zopt.layout(), param_shard, grad_windows[0], staging_floats,
                            gathered.data(), ops);
    final_params = gathered.data();
  } else if (on_device) {  // the final weights in host memory: the model file's and the callback's
    gathered.resize(static_cast<size_t>(P));
    ops.copy_to_host(gathered.data(), params, size_t(P) * sizeof(float));
    final_params = gathered.data();
  }
  if (finish.is_ok() && !o.out_dir.empty() && rank == 0)
    finish = model::save_pretrained(o.out_dir, cfg, table, final_params);
  if (finish.is_ok() && cb.on_finish) {
    // The step region is done: release it, so that what the callback plans (e.g. the sampling
    // arena) is served from the same budget.
    elastic.release_unused();
    // On a device the callback computes on the host copy, from host memory (outside the
    // device budget); on the CPU from the same budget as the run.
    memory::TrackingResource host_tracking(&host_io);
    finish = cb.on_finish(cfg, final_params, on_device ? &host_tracking : &tracking);
  }
  HR_RETURN_IF_ERROR(dist::agree(comm, finish));
  return result;
}

}  // namespace

Result<TrainResult> run_training(const TrainOptions& o, const TrainCallbacks& cb) {
  dist::LocalCommunicator local;
  dist::Communicator& comm = o.comm ? *o.comm : local;
  bool setup_agreed = false;
  Result<TrainResult> r = run_ranks(o, cb, comm, &setup_agreed);
  // A rank that failed during set-up owes the others the agreement they wait in: it gives its
  // error there, and every rank returns the lowest failing rank's.
  if (!r.is_ok() && !setup_agreed && comm.size() > 1) return dist::agree(comm, r.status());
  return r;
}

}  // namespace headroom::train
