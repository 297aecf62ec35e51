// The training loop (see trainer.h).
#include "train/trainer.h"

#include <omp.h>

#include <fmt/format.h>
#include <algorithm>
#include <chrono>
#include <cmath>

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
  return Status::ok();
}

}  // namespace

Result<TrainResult> run_training(const TrainOptions& o, const TrainCallbacks& cb) {
  HR_RETURN_IF_ERROR(check_options(o));
  const model::Gpt2Config& cfg = o.config;
  const int B = o.micro_batch, T = o.seq, K = o.accumulation;

  // ---- data ----
  HR_ASSIGN_OR_RETURN(data::TokenFile file, data::TokenFile::open(o.data));
  if (file.vocab_size() > cfg.vocab_size) {
    return Status::invalid_argument(fmt::format(
        "{}: the token file's vocabulary ({}) is larger than the model's vocab_size ({})", o.data,
        file.vocab_size(), cfg.vocab_size));
  }
  auto [train_range, val_range] = data::split_train_val(file, o.val_fraction, T + 1);
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
  HR_ASSIGN_OR_RETURN(const plan::MemoryPlan mp, plan::plan_training_memory(cfg, policy));
  if (mp.peak_bytes > o.device_memory) {
    return Status::out_of_memory(fmt::format(
        "model {} with micro-batch {} x seq {} needs {} but the device budget is {}:\n{}"
        "try a smaller --batch or --seq, or a larger --device-memory",
        o.model_name, B, T, format_bytes(mp.peak_bytes), format_bytes(o.device_memory),
        plan::category_table(mp, o.device_memory)));
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
  HR_ASSIGN_OR_RETURN(memory::Arena act_arena, make(mp.step));

  float* params = params_arena.f32(0);
  float* grads = grads_arena.f32(0);
  float* m = opt_arena.f32(0);
  float* v = opt_arena.f32(1);
  model::gpt2_init_params(cfg, table, params, o.seed);
  cpu::zero(grads, table.total_floats);
  cpu::zero(m, table.total_floats);
  cpu::zero(v, table.total_floats);
  int start_step = 0;
  if (!o.resume.empty()) {
    HR_ASSIGN_OR_RETURN(LoadedCheckpoint ck, find_checkpoint(o.resume));
    const TrainerState& st = ck.state;
    if (ck.config.to_json() != cfg.to_json()) {
      return Status::invalid_argument(
          fmt::format("{}: the checkpoint's model (config.json) differs from --model {}", ck.dir,
                      o.model_name));
    }
    if (st.micro_batch != B || st.accumulation != K || st.seq != T) {
      return Status::invalid_argument(fmt::format(
          "{}: the checkpoint ran micro-batch {} x {} accumulation at seq {}, this run {} x {} at "
          "seq {}; resume with --batch {} --global-batch {} --seq {} for an exact continuation",
          ck.dir, st.micro_batch, st.accumulation, st.seq, B, K, T, st.micro_batch,
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
    if (st.total_steps != o.steps || st.lr != o.adamw.lr || st.warmup_steps != o.warmup_steps) {
      log_warn(
          "{}: the learning-rate schedule differs from the checkpointed run's ({} steps, lr {}, "
          "warmup {} now; {}, {}, {} then): the continuation follows the new schedule",
          ck.dir, o.steps, o.adamw.lr, o.warmup_steps, st.total_steps, st.lr, st.warmup_steps);
    }
    HR_RETURN_IF_ERROR(load_checkpoint(ck, table, params, m, v));
    train_batches.set_position(st.data_position);
    start_step = st.step;
    log_info("resumed from {} at step {}", ck.dir, st.step);
  }
  auto checkpoint = [&](int steps_done, int64_t data_position) -> Result<std::string> {
    if (o.out_dir.empty()) {
      return Status::invalid_argument("--save-every needs an output directory (--out)");
    }
    TrainerState st{steps_done, data_position,  o.steps, o.warmup_steps,
                    o.adamw.lr, o.min_lr_ratio, B,       K,
                    T,          o.seed,         o.data};
    return save_checkpoint(o.out_dir + "/checkpoints", {&cfg, &table, params, m, v, st},
                           o.keep_checkpoints);
  };

  model::Gpt2 net(cfg, &table);
  net.bind_params(params, grads);
  net.bind_activations(&act_arena, &mp.activations, B, T);
  model::OpTimes op_times;
  const Clock::time_point run_start = Clock::now();
  std::optional<ProfileRecord> rec;
  if (o.profile) {
    rec.emplace();
    rec->plan = mp;
    op_times.record = true;
    op_times.origin = run_start;
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
  const uint64_t planned = mp.peak_bytes;

  if (cb.on_setup) {
    SetupInfo info;
    info.num_parameters = table.num_parameters;
    info.planned_bytes = planned;
    info.memory_table = plan::category_table(mp, o.device_memory);
    info.train_tokens = train_range.size();
    info.val_tokens = val_range.size();
    cb.on_setup(info);
  }

  auto evaluate = [&]() -> std::optional<double> {
    if (!val_batches) return std::nullopt;
    val_batches->set_position(val_range.begin);
    double sum = 0;
    int64_t count = 0;
    for (int i = 0; i < o.eval_batches; i++) {
      val_batches->next(val_inputs, val_targets);
      int64_t valid = 0;
      sum += net.forward(val_inputs, val_targets, &valid);
      count += valid;
    }
    return count ? std::optional<double>(sum / double(count)) : std::nullopt;
  };

  TrainResult result;
  std::vector<double> tps;
  // The loader thread fills the next steps' micro-batches into the staging slots while this
  // thread computes; the slot's tag is the data position after it (what a checkpoint saves).
  // Declared after the arenas, so it stops before they are released.
  data::Prefetcher loader(depth, [&](int slot) {
    int32_t* in = static_cast<int32_t*>(staging.data(size_t(2 * slot)));
    int32_t* tg = static_cast<int32_t*>(staging.data(size_t(2 * slot + 1)));
    for (int k = 0; k < K; k++)
      train_batches.next(in + int64_t(k) * B * T, tg + int64_t(k) * B * T);
    return train_batches.position();
  });
  for (int step = start_step; step < o.steps; step++) {
    auto t0 = Clock::now();
    tracking.reset_peak();
    // The whole step's micro-batches are there before the first forward, so the loss is
    // normalised by the valid tokens of the whole optimizer step (not per micro-batch).
    auto td = Clock::now();
    const data::Prefetcher::Ready batch = loader.acquire();
    const double data_ms = batch.waited_ms;
    record("wait for data", "data", td, step, -1);
    const int32_t* inputs = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot)));
    const int32_t* targets = static_cast<const int32_t*>(staging.data(size_t(2 * batch.slot + 1)));
    int64_t step_valid = 0;
    for (int64_t i = 0; i < int64_t(K) * B * T; i++) step_valid += targets[i] >= 0;
    const float dloss = step_valid ? 1.0f / float(step_valid) : 0.0f;
    double loss_sum = 0;
    for (int k = 0; k < K; k++) {
      const int32_t* in = inputs + int64_t(k) * B * T;
      const int32_t* tg = targets + int64_t(k) * B * T;
      auto tm = Clock::now();
      loss_sum += net.forward(in, tg);
      net.backward(in, tg, dloss);
      record("micro-batch", "micro_batch", tm, step, k);
    }
    loader.release(batch.slot);
    const float lr = cosine_lr(step, o.steps, o.warmup_steps, o.adamw.lr, o.min_lr_ratio);
    auto topt = Clock::now();
    const double norm = adamw_step(table, params, grads, m, v, o.adamw, lr, step + 1);
    cpu::zero(grads, table.total_floats);
    const double optimizer_ms = ms_since(topt);
    record("adamw", "optimizer", topt, step, -1);

    StepStats s;
    s.step = step + 1;
    s.steps = o.steps;
    s.loss = step_valid ? loss_sum / double(step_valid) : 0.0;
    s.lr = lr;
    s.grad_norm = norm;
    s.tokens = int64_t(K) * B * T;
    s.micro_batch = B;
    s.accumulation = K;
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
      s.val_loss = evaluate();
      record("validation", "validation", tv, step, -1);
    }
    memory::MemoryStats ms = tracking.stats();
    s.device_bytes_in_use = ms.current;
    s.device_bytes_peak = ms.peak;
    s.planned_peak_bytes = planned;
    s.device_budget = limit.budget();
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
    if (cb.should_stop && cb.should_stop(s)) {
      result.stopped = true;
      break;
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
  result.planned_peak_bytes = mp.peak_bytes;
  result.lower_bound_bytes = mp.lower_bound_bytes;
  if (result.stopped) return result;
  if (!o.out_dir.empty()) {
    HR_RETURN_IF_ERROR(model::save_pretrained(o.out_dir, cfg, table, params));
  }
  if (cb.on_finish) {
    // The step region is done: release it, so that what the callback plans (e.g. the sampling
    // arena) is served from the same budget.
    act_arena = memory::Arena();
    HR_RETURN_IF_ERROR(cb.on_finish(cfg, params, &tracking));
  }
  return result;
}

}  // namespace headroom::train
