// The training loop (see trainer.h).
#include "train/trainer.h"

#include <omp.h>

#include <fmt/format.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <sys/statvfs.h>
#include <unistd.h>

#include "backend/cpu/device.h"
#include "backend/cpu/kernels.h"
#include "core/log.h"
#include "core/units.h"
#include "data/batcher.h"
#include "data/prefetcher.h"
#include "data/token_file.h"
#include "memory/arena.h"
#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/weights.h"
#include "plan/memory_plan.h"
#include "train/checkpoint.h"
#include "train/elastic.h"
#include "train/offload_tier.h"
#include "train/step_events.h"
#include "train/zero.h"

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
  if (o.micro_batch <= 0) {
    return Status::invalid_argument(fmt::format("--batch {} must be positive", o.micro_batch));
  }
  if (o.accumulation <= 0) {
    return Status::invalid_argument(
        fmt::format("accumulation {} must be positive", o.accumulation));
  }
  if (o.steps <= 0)
    return Status::invalid_argument(fmt::format("--steps {} must be positive", o.steps));
  if (int64_t(o.micro_batch) * o.seq > (int64_t(1) << 24)) {
    return Status::invalid_argument(fmt::format(
        "--batch {} x --seq {} tokens per micro-batch is too large", o.micro_batch, o.seq));
  }
  if (!(o.adamw.lr > 0) || !std::isfinite(o.adamw.lr)) {
    return Status::invalid_argument(fmt::format("--lr {} must be positive", o.adamw.lr));
  }
  if (o.zero_stage == 3) {
    return Status::unsupported(
        "--zero 3 is not built into the trainer yet: the model reads one full parameter buffer, "
        "so sharding the parameters would save nothing until it reads per-layer windows; use "
        "--zero 0, 1 or 2");
  }
  if (o.zero_stage < 0 || o.zero_stage > 3) {
    return Status::invalid_argument(fmt::format("--zero {}: use 0, 1 or 2", o.zero_stage));
  }
  if (o.comm && o.comm->size() > 1 && !o.device_memory_file.empty()) {
    return Status::unsupported(fmt::format(
        "--device-memory-file with {} ranks: re-planning while training runs is built for one "
        "process only (every rank would have to re-plan together); use --device-memory",
        o.comm->size()));
  }
  return Status::ok();
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
    default:
      return head + fmt::format(
                        ": as ZeRO-1 (m, v sharded 1/{} per rank, gradients reduce-scattered); the "
                        "gradient accumulation buffer stays full until backward writes per-bucket "
                        "windows, so its memory is ZeRO-1's",
                        ranks);
  }
}

namespace {

// The training run proper. Every rank runs it; `setup_agreed` is set once all ranks have agreed
// that set-up succeeded (the first collective), so that run_training knows whether a failing
// rank still owes the others that agreement.
Result<TrainResult> run_ranks(const TrainOptions& o, const TrainCallbacks& cb,
                              dist::Communicator& comm, bool* setup_agreed) {
  HR_RETURN_IF_ERROR(check_options(o));
  const int R = comm.size(), rank = comm.rank();
  if (!o.device_memory_file.empty()) {
    // Before step one a bad budget file is an error; later, a warning (see follow_budget).
    HR_RETURN_IF_ERROR(read_budget_file(o.device_memory_file).status());
  }
  const model::Gpt2Config& cfg = o.config;
  const int B = o.micro_batch, T = o.seq, K = o.accumulation;  // per rank

  // ---- data ----
  HR_ASSIGN_OR_RETURN(data::TokenFile file, data::TokenFile::open(o.data));
  if (file.vocab_size() > cfg.vocab_size) {
    return Status::invalid_argument(fmt::format(
        "{}: the token file's vocabulary ({}) is larger than the model's vocab_size ({})", o.data,
        file.vocab_size(), cfg.vocab_size));
  }
  // Not a structured binding: a lambda below captures val_range, which clang 14 cannot do.
  const auto split = data::split_train_val(file, o.val_fraction, T + 1);
  data::TokenRange train_range = split.first, val_range = split.second;
  HR_ASSIGN_OR_RETURN(data::PackedBatcher train_batches,
                      data::PackedBatcher::create(file, train_range, B, T));
  std::optional<data::PackedBatcher> val_batches;
  if (val_range.size() >= T + 1) {
    HR_ASSIGN_OR_RETURN(data::PackedBatcher vb, data::PackedBatcher::create(file, val_range, B, T));
    val_batches.emplace(std::move(vb));
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
  HR_ASSIGN_OR_RETURN(const plan::MemoryPlan mp, plan::plan_training_memory(cfg, policy));
  if (mp.peak_bytes > o.device_memory) {
    return Status::out_of_memory(fmt::format(
        "model {} with micro-batch {} x seq {} needs {} but the device budget is {}:\n{}"
        "try a smaller --batch or --seq, or a larger --device-memory{}",
        o.model_name, B, T, format_bytes(mp.peak_bytes), format_bytes(o.device_memory),
        plan::category_table(mp, o.device_memory),
        R > 1 && o.zero_stage == 0 ? " (or --zero 1 to shard the optimizer state)" : ""));
  }
  memory::HostResource host;
  memory::LimitResource limit(&host, o.device_memory);
  memory::TrackingResource tracking(&limit);
  const model::ParamTable& table = mp.params;
  auto make = [&](const plan::Region& r) {
    return memory::Arena::create(&tracking, r.buffers, r.layout, r.category);
  };
  HR_ASSIGN_OR_RETURN(memory::Arena params_arena, make(mp.persistent[0]));
  HR_ASSIGN_OR_RETURN(memory::Arena grads_arena, make(mp.persistent[1]));
  HR_ASSIGN_OR_RETURN(memory::Arena opt_arena, make(mp.persistent[2]));
  HR_ASSIGN_OR_RETURN(memory::Arena staging, make(mp.persistent[3]));
  // Mixed precision: the bf16 copy of the weights that the GEMMs read (refreshed by AdamW).
  memory::Arena bf16_arena;
  if (mp.persistent.size() > plan::MemoryPlan::kBf16WeightsRegion) {
    HR_ASSIGN_OR_RETURN(bf16_arena, make(mp.persistent[plan::MemoryPlan::kBf16WeightsRegion]));
  }
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
  {
    // Fault the region's pages in now, not inside step one; the pool keeps them.
    HR_ASSIGN_OR_RETURN(memory::Arena warm, elastic.acquire_uninjected());
  }
  if (!o.out_dir.empty() && rank == 0) {
    // Room for a checkpoint (weights and two moments) and the final model, and some slack.
    HR_RETURN_IF_ERROR(
        check_output_dir(o.out_dir, uint64_t(table.total_floats) * 4 * 4 + 16 * kMiB));
  }

  const int64_t P = table.total_floats;
  float* params = params_arena.f32(0);
  float* grads = grads_arena.f32(0);
  // ZeRO-1/2: this rank's piece of the reduced gradient, m and v (docs/notes/zero.md).
  float* grad_shard = o.zero_stage > 0 ? grads_arena.f32(1) : nullptr;
  float* m = opt_arena.f32(0);
  float* v = opt_arena.f32(1);
  const int64_t moment_floats = int64_t(mp.persistent[2].buffers[0].bytes() / sizeof(float));
  ZeroOptimizer zopt(&comm, &table, o.zero_stage);
  HR_CHECK_MSG(zopt.sizes().m <= moment_floats, "the plan's optimizer shard is too small");
  model::gpt2_init_params(cfg, table, params, o.seed);
  cpu::zero(grads, P);
  if (grad_shard) cpu::zero(grad_shard, moment_floats);
  cpu::zero(m, moment_floats);
  cpu::zero(v, moment_floats);
  int start_step = 0;
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
    if (st.micro_batch != B || st.accumulation != K * R || st.seq != T) {
      return Status::invalid_argument(fmt::format(
          "{}: the checkpoint ran micro-batch {} x {} accumulation at seq {}, this run {} x {} at "
          "seq {}; resume with --batch {} --global-batch {} --seq {} for an exact continuation",
          ck.dir, st.micro_batch, st.accumulation, st.seq, B, K * R, T, st.micro_batch,
          st.micro_batch * st.accumulation, st.seq));
    }
    if (!train_batches.valid_position(st.data_position)) {
      return Status::corrupt(fmt::format("{}: data_position {} is outside the training data of {}",
                                         ck.dir, st.data_position, o.data));
    }
    if (st.step >= o.steps) {
      return Status::invalid_argument(
          fmt::format("{} is at step {}, and --steps is {}: nothing left to do (raise --steps)",
                      ck.dir, st.step, o.steps));
    }
    if (rank == 0 &&
        (st.total_steps != o.steps || st.lr != o.adamw.lr || st.warmup_steps != o.warmup_steps)) {
      log_warn(
          "{}: the learning-rate schedule differs from the checkpointed run's ({} steps, lr {}, "
          "warmup {} now; {}, {}, {} then): the continuation follows the new schedule",
          ck.dir, o.steps, o.adamw.lr, o.warmup_steps, st.total_steps, st.lr, st.warmup_steps);
    }
    if (o.zero_stage == 0) {
      HR_RETURN_IF_ERROR(load_checkpoint(ck, table, params, m, v));
    } else {
      // Checkpoints hold the full moments: every rank reads them (m through the gradient buffer,
      // free before step one; v through a host copy, as a GPU run reads a file) and keeps its
      // piece. With several machines --resume must be on a file system they share.
      std::vector<float> full_v(static_cast<size_t>(P));
      HR_RETURN_IF_ERROR(load_checkpoint(ck, table, params, grads, full_v.data()));
      zopt.scatter_params(grads, m);
      zopt.scatter_params(full_v.data(), v);
      cpu::zero(grads, P);
    }
    train_batches.set_position(st.data_position);
    start_step = st.step;
    if (rank == 0) log_info("resumed from {} at step {}", ck.dir, st.step);
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
                    o.steps,
                    o.warmup_steps,
                    o.adamw.lr,
                    o.min_lr_ratio,
                    elastic.micro_batch(),
                    elastic.accumulation() * R,
                    T,
                    o.seed,
                    o.data};
    const float* full_m = m;
    const float* full_v = v;
    std::vector<float> host_m;
    if (o.zero_stage > 0) {
      HR_RETURN_IF_ERROR(zopt.gather_params(m, grads));
      if (rank == 0) host_m.assign(grads, grads + P);
      HR_RETURN_IF_ERROR(zopt.gather_params(v, grads));
      full_m = host_m.data();
      full_v = grads;
    }
    Result<std::string> written = std::string();
    if (rank == 0) {
      written = save_checkpoint(o.out_dir + "/checkpoints",
                                {&cfg, &table, params, full_m, full_v, st}, o.keep_checkpoints);
    }
    if (o.zero_stage > 0) cpu::zero(grads, P);
    HR_RETURN_IF_ERROR(dist::agree(comm, written.status()));
    return written;
  };

  bf16_t* params_bf16 = bf16_arena.size() > 0 ? static_cast<bf16_t*>(bf16_arena.data(0)) : nullptr;
  if (params_bf16) cpu::cast_to_bf16(params_bf16, params, table.total_floats);
  // The offload tier: its own host resource and budget, and the copy thread (declared before
  // the model, so that it outlives every forward and backward).
  const uint64_t offload_budget =
      o.offload_memory > 0 ? o.offload_memory : cpu::query_cpu_device().available_bytes;
  HR_ASSIGN_OR_RETURN(std::unique_ptr<OffloadTier> offload,
                      OffloadTier::create(mp, offload_budget, o.offload_copier));
  model::Gpt2 net(cfg, &table);
  net.bind_params(params, grads, params_bf16);
  model::OpTimes op_times;
  const Clock::time_point run_start = Clock::now();
  std::optional<ProfileRecord> rec;
  if (o.profile) {
    rec.emplace();
    rec->plan = mp;
    op_times.record = true;
    op_times.origin = run_start;
    record_plan(mp, &rec->events);  // persistent allocations at 0; the step's schedule
    op_times.events = &rec->events;
  }
  if (o.breakdown || o.profile) net.set_op_times(&op_times);
  auto us_since_start = [&](Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - run_start).count();
  };
  auto record = [&](const char* name, const char* kind, Clock::time_point t0, int step, int mb) {
    if (rec) {
      rec->spans.push_back({name, kind, us_since_start(t0),
                            us_since_start(Clock::now()) - us_since_start(t0), step, mb});
    }
  };
  const int depth = mp.policy.prefetch_depth;
  int32_t* val_inputs = static_cast<int32_t*>(staging.data(size_t(2 * depth)));
  int32_t* val_targets = static_cast<int32_t*>(staging.data(size_t(2 * depth + 1)));
  // Sequences per optimizer step, all ranks: invariant (DESIGN.md principle 2). This rank
  // computes `share` of them, from sequence `first` of the step on.
  const int G = B * K * R;
  const int share = B * K, first = rank * share;

  if (cb.on_setup) {
    SetupInfo info;
    info.num_parameters = table.num_parameters;
    info.planned_bytes = mp.peak_bytes;
    info.memory_table = plan::category_table(mp, o.device_memory);
    info.train_tokens = train_range.size();
    info.val_tokens = val_range.size();
    info.predicted_step_ms = elastic.predicted_step_ms();
    info.device_source = o.device.source.empty() ? nominal_cpu_spec().source : o.device.source;
    cb.on_setup(info);
  }

  // ---- elastic re-planning and out-of-memory recovery (docs/notes/elastic.md) ----
  int steps_done = start_step;                       // optimizer steps completed
  int64_t done_position = train_batches.position();  // the data position after them
  uint64_t ceiling = o.device_memory;  // what plans may use: the budget, lowered after a failure
  std::string last_file_error;
  StepStats cur;  // this step's events and counts, moved into its StepStats at the end
  TrainResult result;
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
    const std::string path = fmt::format("{}/oom-report-step-{:06d}.txt", o.out_dir, step);
    std::ofstream f(path, std::ios::app);  // a step's later failures are appended
    f << report << "\n";
    return f.good() ? path : "";
  };
  // The step region for the next micro-batch (or validation). An allocation failure is recovered
  // here, before any compute of that micro-batch: plans are chosen again under less memory (the
  // micro-batch must divide the `remaining` sequences of the step) and the acquisition retried.
  auto acquire = [&](int step, const std::string& where, int remaining) -> Result<memory::Arena> {
    while (true) {
      Result<memory::Arena> a = elastic.acquire();
      if (a.is_ok() || a.status().code() != StatusCode::kOutOfMemory) return a;
      const std::string at = fmt::format("at step {}, {}", step + 1, where);
      std::string report = elastic.oom_report(a.status(), at, limit.budget(), tracking.stats());
      if (R > 1) {
        // The run stops after agreement (settle below), checkpointing the last completed step.
        return Status::out_of_memory(
            report +
            fmt::format("  re-planning after an allocation failure is built for one process "
                        "only ({} ranks would have to re-plan together): restart with a smaller "
                        "--batch or a larger --device-memory",
                        R));
      }
      ceiling = std::min<uint64_t>(limit.budget(), elastic.planned_peak() - 1);
      Result<ElasticStep::Replan> rp = elastic.replan(ceiling, remaining);
      if (!rp.is_ok()) {
        report += fmt::format("  re-planning under {} found nothing that fits: {}\n",
                              format_bytes(ceiling), rp.status().message());
        save_report(step + 1, report);
        return fail_out_of_memory(report);
      }
      report += fmt::format("  alternatives computed by the planner (under {}):\n{}",
                            format_bytes(ceiling), rp->alternatives);
      const std::string path = save_report(step + 1, report);
      cur.events.push_back(fmt::format("step {}: out of memory {}: re-planned {}; redoing it{}",
                                       step + 1, where, rp->change,
                                       path.empty() ? "" : " (report: " + path + ")"));
      cur.oom_reports.push_back(report);
      cur.oom_recoveries++;
      cur.replans++;
    }
  };
  // Before each step: the budget file, read again; a change re-plans for the whole step.
  auto follow_budget = [&](int step) -> Status {
    if (o.device_memory_file.empty()) return Status::ok();
    Result<uint64_t> nb = read_budget_file(o.device_memory_file);
    if (!nb.is_ok()) {
      // Mid-run (an editor saving, a typo) the run goes on under the budget it has.
      if (nb.status().message() != last_file_error) {
        last_file_error = nb.status().message();
        cur.events.push_back(fmt::format("step {}: warning: {}; keeping the budget {}", step + 1,
                                         last_file_error, format_bytes(limit.budget())));
      }
      return Status::ok();
    }
    last_file_error.clear();
    const uint64_t old = limit.budget();
    if (*nb == old) return Status::ok();
    limit.set_budget(*nb);
    ceiling = *nb;
    Result<ElasticStep::Replan> rp = elastic.replan(ceiling, G);
    const std::string head =
        fmt::format("step {}: budget {} -> {}", step + 1, format_bytes(old), format_bytes(*nb));
    if (!rp.is_ok()) {
      return fail_out_of_memory(head + ": no plan fits: " + rp.status().message());
    }
    cur.events.push_back(
        fmt::format("{}: {} {}", head, rp->changed ? "re-planned" : "plan kept,", rp->change));
    cur.replans += rp->changed;
    return Status::ok();
  };

  // Validation over the same sequences whatever the micro-batch: each batch of the validation
  // staging (the run's first micro-batch, B sequences) runs in pieces of the current micro-batch,
  // which divides B.
  auto evaluate = [&](int step) -> Result<std::optional<double>> {
    if (!val_batches) return std::optional<double>();
    HR_ASSIGN_OR_RETURN(memory::Arena arena, acquire(step, "for validation", G));
    const int b = elastic.micro_batch();
    net.bind_activations(&arena, &elastic.plan().activations, b, T);
    offload->bind(net, elastic.plan());
    val_batches->set_position(val_range.begin);
    double sum = 0;
    int64_t count = 0;
    for (int i = 0; i < o.eval_batches; i++) {
      val_batches->next(val_inputs, val_targets);
      for (int q = 0; q < B; q += b) {
        int64_t valid = 0;
        sum += net.forward(val_inputs + int64_t(q) * T, val_targets + int64_t(q) * T, &valid);
        count += valid;
      }
    }
    return count ? std::optional<double>(sum / double(count)) : std::optional<double>();
  };

  std::vector<double> tps;
  // The loader thread fills the next steps' micro-batches into the staging slots while this
  // thread computes; the slot's tag is the data position after it (what a checkpoint saves).
  // Declared after the arenas, so it stops before they are released.
  data::Prefetcher loader(depth, [&](int slot) {
    int32_t* in = static_cast<int32_t*>(staging.data(size_t(2 * slot)));
    int32_t* tg = static_cast<int32_t*>(staging.data(size_t(2 * slot + 1)));
    for (int k = 0; k < K * R; k++)
      train_batches.next(in + int64_t(k) * B * T, tg + int64_t(k) * B * T);
    return train_batches.position();
  });
  // A rank's failure inside a step (out of memory, validation) becomes every rank's: agreed at
  // the step boundary, before the step's collectives. One process recovers inside acquire()
  // (and checkpoints there when it cannot); several ranks stop here, checkpointing first.
  auto settle = [&](const Status& local) -> Status {
    Status agreed = dist::agree(comm, local);
    if (agreed.is_ok() || R == 1) return agreed;
    if (agreed.code() == StatusCode::kOutOfMemory) return fail_out_of_memory(agreed.message());
    return agreed;
  };
  // Set-up succeeded on this rank; from here every rank reaches the same collectives.
  *setup_agreed = true;
  HR_RETURN_IF_ERROR(dist::agree(comm, Status::ok()));
  for (int step = start_step; step < o.steps; step++) {
    auto t0 = Clock::now();
    cur = StepStats();
    const model::OffloadCopier::Stats copies0 = offload->copy_stats();
    HR_RETURN_IF_ERROR(follow_budget(step));
    tracking.reset_peak();
    // The whole step's micro-batches are there before the first forward, so the loss is
    // normalised by the valid tokens of the whole optimizer step (not per micro-batch).
    auto td = Clock::now();
    const data::Prefetcher::Ready batch = loader.acquire();
    const double data_ms = batch.waited_ms;
    record("wait for data", "data", td, step, -1);
    const int32_t* inputs = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot)));
    const int32_t* targets = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot + 1)));
    // Every rank has the whole step's tokens: the loss is normalised by the global step's.
    int64_t step_valid = 0;
    for (int64_t i = 0; i < int64_t(G) * T; i++) step_valid += targets[i] >= 0;
    const float dloss = step_valid ? 1.0f / float(step_valid) : 0.0f;
    double loss_sum = 0;
    // This rank's `share` sequences lie in the slot one after another; they are cut into
    // micro-batches of the current plan, which may change between two of them (a recovery).
    Status local;
    for (int done = 0, k = 0; done < share; k++) {
      Result<memory::Arena> arena = acquire(
          step, fmt::format("at micro-batch {} (sequence {} of {})", k + 1, first + done + 1, G),
          share - done);
      if (!arena.is_ok()) {
        local = arena.status();
        break;
      }
      const int b = elastic.micro_batch();
      net.bind_activations(&*arena, &elastic.plan().activations, b, T);
      offload->bind(net, elastic.plan());
      const int32_t* in = inputs + int64_t(first + done) * T;
      const int32_t* tg = targets + int64_t(first + done) * T;
      auto tm = Clock::now();
      if (rec) begin_micro_batch(&rec->events, elastic.plan(), step, k, us_since_start(tm));
      loss_sum += net.forward(in, tg);
      net.backward(in, tg, dloss);
      record("micro-batch", "micro_batch", tm, step, k);
      done += b;
    }
    loader.release(batch.slot);
    HR_RETURN_IF_ERROR(settle(local));
    HR_RETURN_IF_ERROR(comm.all_reduce(&loss_sum, 1));
    const float lr = cosine_lr(step, o.steps, o.warmup_steps, o.adamw.lr, o.min_lr_ratio);
    auto topt = Clock::now();
    const ZeroBuffers zb{params, grads, grad_shard, m, v, /*grads_reduced=*/false};
    HR_ASSIGN_OR_RETURN(const double norm, zopt.step(zb, o.adamw, lr, step + 1, params_bf16));
    cpu::zero(grads, P);
    const double optimizer_ms = ms_since(topt);
    record("adamw", "optimizer", topt, step, -1);

    StepStats s = std::move(cur);
    cur = StepStats();
    steps_done = step + 1;
    done_position = batch.tag;
    s.step = step + 1;
    s.steps = o.steps;
    s.loss = step_valid ? loss_sum / double(step_valid) : 0.0;
    s.lr = lr;
    s.grad_norm = norm;
    s.tokens = int64_t(G) * T;
    s.data_wait_ms = data_ms;
    s.optimizer_ms = optimizer_ms;
    s.op_ms = op_times;
    op_times.ms = {};
    // The step's time excludes validation, which is reported on its own line.
    s.step_ms = ms_since(t0);
    s.tokens_per_s = double(s.tokens) / (s.step_ms / 1000.0);
    const bool last = step + 1 == o.steps;
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
    s.micro_batch = elastic.micro_batch();
    s.accumulation = elastic.accumulation() * R;
    s.recompute = plan::recompute_summary(elastic.plan().policy.exec);
    s.predicted_step_ms = elastic.predicted_step_ms();
    result.replans += s.replans;
    result.oom_recoveries += s.oom_recoveries;
    memory::MemoryStats ms = tracking.stats();
    s.device_bytes_in_use = ms.current;
    s.device_bytes_peak = ms.peak;
    s.planned_peak_bytes = elastic.planned_peak();
    s.device_budget = limit.budget();
    const model::OffloadCopier::Stats copies1 = offload->copy_stats();
    s.offload_bytes = copies1.bytes - copies0.bytes;
    s.offload_copy_ms = (copies1.copy_seconds - copies0.copy_seconds) * 1e3;
    s.offload_wait_ms = (copies1.wait_seconds - copies0.wait_seconds) * 1e3;
    if (!std::isfinite(s.loss)) {
      return Status::internal(
          fmt::format("loss became {} at step {} (lr {}); try a lower --lr", s.loss, s.step, lr));
    }
    if (o.save_every > 0 && ((step + 1) % o.save_every == 0 || step + 1 == o.steps)) {
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
  result.planned_peak_bytes = elastic.planned_peak();
  result.lower_bound_bytes = mp.lower_bound_bytes;
  result.offload_bytes_peak = offload->stats().peak;
  result.planned_offload_bytes = mp.offload_bytes;
  const model::OffloadCopier::Stats copies = offload->copy_stats();
  result.offload_copied_bytes = copies.bytes;
  result.offload_copy_ms = copies.copy_seconds * 1e3;
  result.offload_wait_ms = copies.wait_seconds * 1e3;
  if (result.stopped) return result;
  Status finish;
  if (!o.out_dir.empty() && rank == 0)
    finish = model::save_pretrained(o.out_dir, cfg, table, params);
  if (finish.is_ok() && cb.on_finish) {
    // The step region is done: release it, so that what the callback plans (e.g. the sampling
    // arena) is served from the same budget.
    elastic.release_unused();
    finish = cb.on_finish(cfg, params, &tracking);
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
