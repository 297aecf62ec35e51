// The training loop: owns the memory stack (host leaf, budget, tracking), the arenas made from
// the model's buffer tables, the data batchers, and AdamW. Reports each step through a callback;
// the CLI turns those into the progress bar and the JSON log.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/doc_batcher.h"
#include "dist/communicator.h"
#include "memory/adaptors.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/prune.h"
#include "plan/device_spec.h"
#include "plan/memory_plan.h"
#include "train/loss_scale.h"
#include "train/optimizer.h"
#include "train/zero_windows.h"

namespace headroom::train {

struct TrainOptions {
  // Data parallelism (docs/notes/zero.md). Null: one process. With R ranks, micro_batch and
  // accumulation are per rank and the global batch is G = R x micro_batch x accumulation: every
  // rank reads the same token stream and computes sequences [r G/R, (r+1) G/R) of each step, so
  // the data order is one process's. Every rank calls run_training with the same options (the
  // test hooks and profile excepted); only rank 0 writes checkpoints and the final model.
  dist::Communicator* comm = nullptr;
  // ZeRO stage: 0 all-reduces the gradients; 1 reduce-scatters them, shards AdamW's m and v and
  // all-gathers the updated parameters; 2 as 1 with gradient windows instead of a full gradient
  // buffer, reduce-scattered per layer while backward continues; 3 as 2 with the parameters
  // sharded and gathered per layer (bf16 needs exec.bf16_weight_copy false).
  int zero_stage = 0;
  model::Gpt2Config config;
  std::string model_name;  // for messages
  std::string plan_note;   // how micro-batch and accumulation were chosen, for the start-up lines
  std::string data;        // token file (headroom prepare)
  int seq = 128;           // T
  // Batching (docs/notes/batching.md). kPacked: each sequence a T-token window of the
  // concatenated documents. kBucketed: each row one document (or a T-token piece of a longer
  // one), padded to a multiple of `bucket` tokens; every optimizer step is one bucket's batch
  // of rows x length <= G x T tokens (G = ranks x micro_batch x accumulation), cut into
  // micro-batches of floor(micro_batch x T / length) rows; with several ranks, rank r runs the
  // step's micro-batches r, r + R, ... (every rank reads the whole step).
  data::Batching batching = data::Batching::kPacked;
  int bucket = 32;
  // Packed batching: serve the training windows in a shuffled order (seed, epoch), so that each
  // step samples the whole corpus; false reads them in file order (data::PackedBatcher::Order).
  bool shuffle = true;
  int micro_batch = 8;      // B: sequences per micro-batch
  int accumulation = 1;     // k: micro-batches per optimizer step
  model::ExecOptions exec;  // attention kernel, LM head, recomputation per block
  int steps = 200;          // optimizer steps (with `minutes`: the most the run may take)
  // A time budget, minutes (0: none): after the warmup's last step the run fixes its step count so
  // that its steps and validations end near `minutes` after the first of them, and the cosine
  // schedule ends at its floor (train/time_budget.h; needs warmup_steps >= 4). The run is then
  // exactly `steps = N` with the N it chose (TrainResult::total_steps; kept in checkpoints).
  double minutes = 0;
  double minutes_assume_step_s = 0;  // tests: the step time `minutes` fixes the count from
  int warmup_steps = 20;
  float min_lr_ratio = 0.1f;
  AdamWConfig adamw;
  uint64_t device_memory = 0;  // the budget, bytes
  // The offload tier's budget, bytes (a host resource of its own; pinned host memory on a GPU):
  // where offloaded activations live between their block's forward and backward. 0: the host's
  // available memory (MemAvailable).
  uint64_t offload_memory = 0;
  // Tests: hooks of the offload copy thread (delay each copy; poison copied sources).
  model::OffloadCopier::Options offload_copier;
  // Optimizer offload: the pieces (floats, a multiple of 64) the update is computed and copied
  // back in (OptimizerOffload::set_upload_chunk_floats); 0: its default (4 MiB). Tests set small
  // pieces so that a tiny model pipelines.
  int64_t optimizer_upload_chunk = 0;
  uint64_t seed = 1337;
  double val_fraction = 0.05;
  int eval_every = 0;  // steps between validation runs; 0 = only at the end
  int eval_batches = 4;
  // Validate once before the first step too (TrainResult::initial_val_loss). Off by default: it
  // is one more step-region acquisition, which fail_step_allocations counts.
  bool eval_at_start = false;
  std::string out_dir;       // where the model is saved at the end; empty = not saved
  bool breakdown = false;    // time every kernel call by kind (StepStats::op_ms)
  bool profile = false;      // record every kernel, op and step span (TrainResult::profile)
  int save_every = 0;        // steps between checkpoints (and one at the end); 0 = none
  int keep_checkpoints = 3;  // newest checkpoints kept in out_dir/checkpoints; 0 = all
  std::string resume;        // a checkpoint directory, or a run's out directory (its newest)
  // Elastic micro-batching (docs/notes/elastic.md). The device's speed prices re-plans and the
  // expected step time; left empty, nominal figures are used (the ranking needs only ratios).
  plan::DeviceSpec device;
  // Self-correction of the cost model (Note [Self-correction] in docs/notes/cost-model.md): the
  // run times its ops by kind over `measure_steps` steps after `skip_steps`, scales the model's
  // prediction of each kind by what it measured (device.correction), saves that correction in
  // `cache_path` (rank 0; one entry per machine key and model key) for the next run, which
  // starts from it (`load`), and with `replan` (one process) re-plans the micro-batch and
  // recomputation with the corrected model, as an elastic re-plan.
  struct SelfCorrection {
    bool enabled = false;
    int skip_steps = 1;
    int measure_steps = 2;
    std::string cache_path;   // corrections file (plan::corrections_path); empty: not persisted
    std::string machine_key;  // plan::correction_machine_key of this machine and thread count
    bool load = true;
    bool replan = false;
  };
  SelfCorrection self_correct;
  // Read before every optimizer step (a size such as "2GiB"); a change of the budget re-plans the
  // micro-batch, accumulation and recomputation with the same effective batch. Empty: the budget
  // is device_memory for the whole run. With several ranks `{rank}` in the path is replaced by
  // the rank (budget_file_for_rank; the CLI reads the starting device_memory from that file), and
  // the ranks agree on one plan for the smallest room (docs/notes/elastic.md, "Several ranks").
  std::string device_memory_file;
  // A device that says what it has free (a GPU: cudaMemGetInfo), read before each step when there
  // is no device_memory_file: returns the run's budget given `held`, the bytes the run's arenas
  // and pool hold on the device now (the CLI's: held + free less a margin, at most
  // --device-memory). A budget the current plan no longer fits re-plans the step region as a
  // lowered budget file does; one 5% above the current budget re-plans to use the room; smaller
  // moves are ignored (free memory moves a little every step). An error keeps the budget (an
  // event says why). Null: the budget stays device_memory.
  std::function<Result<uint64_t>(uint64_t held)> device_budget_probe;
  // Optimizer offload (docs/notes/offload.md): the fp32 master weights, AdamW's m and v (this
  // rank's shard) and a gradient copy live in the offload tier, a host memory stack of its own
  // under `offload_memory` bytes (0: the host's available memory, MemAvailable), where AdamW
  // runs; the device budget counts only what stays (parameters, gradients, step region).
  bool offload_optimizer = false;
  // Fault injection for tests: the 0-based indices of the step-region acquisitions (one per
  // micro-batch and per validation run, counted from step one) that fail as out of memory.
  std::vector<uint64_t> fail_step_allocations;
  // For tests of the overlap (ZeRO-2/3): record the order of backward ops and gradient
  // reductions (TrainResult::zero_events).
  bool record_zero_events = false;
  // fp16 only (exec.precision kFp16): dynamic or fixed loss scaling (train/loss_scale.h).
  LossScaleConfig loss_scale;
  // Fault injection for tests: the 0-based steps whose backward on this rank starts from an
  // infinite loss gradient, so that its gradients overflow as an fp16 overflow would.
  std::vector<int> inject_overflow_steps;
  // A model directory (config.json and model.safetensors or its shards, as `train --out` and
  // Hugging Face write) whose weights the run starts from, as from_pretrained does; its tensors
  // must have `config`'s shapes. Empty: initialised from `seed`. A resume's checkpoint and a
  // sparsity_mask directory's weights win.
  std::string init_from;
  // Training with a sparsity mask (docs/notes/pruning.md; stage 0 without optimizer offload).
  // sparsity_mask: a model directory (a pruned model, `headroom prune`) whose weights the run
  // starts from and whose zeros in the prunable tensors are the mask; its config must be
  // `config`'s. Pruned weights stay exact zeros through AdamW.
  std::string sparsity_mask;
  // Knowledge distillation (docs/notes/distillation.md), with exec.distill set (the loss, the
  // teacher's config and precision): the teacher's model directory (config.json and
  // model.safetensors, as `headroom generate --model-dir` reads), whose weights it loads.
  std::string teacher_dir;
  // Or pruning during the run: after optimizer step `at_step` (1-based; 0: never) the mask of
  // `spec` is taken from the weights and held from then on. A resumed run past that step takes
  // the mask from the checkpoint's zeros.
  struct Prune {
    int at_step = 0;
    model::MaskSpec spec;
  } prune;
  // The backend the run computes on (docs/notes/device-trainer.md): its op table, and the leaf
  // that every planned region (the device budget's bytes) comes from. Null: the CPU's
  // (backend::cpu_ops(), host memory). A backend whose memory the host cannot address
  // (Ops::host_addressable() false: a GPU) needs a leaf, and reaches its memory only through the
  // table and its copies; it runs what the CPU runs: ZeRO stages 0-3 on one rank or several (its
  // collectives through NCCL, or `comm` behind dist::StagingCommunicator), packed and bucketed
  // batching, optimizer and activation offload, sparsity masks and a teacher.
  const backend::Ops* ops = nullptr;
  memory::MemoryResource* device_leaf = nullptr;
  // The offload tier's host memory (under `offload_memory`); null: plain host memory. A GPU
  // run's is pinned (PinnedHostResource), so its asynchronous copies run behind the call.
  memory::MemoryResource* offload_leaf = nullptr;
  // The host memory of the loader's token slots on a device (a few MiB outside every budget);
  // null: plain host memory. A GPU run's is pinned, so that each slot's copy to the device runs
  // on the host-to-device stream while the steps before it compute.
  memory::MemoryResource* slot_leaf = nullptr;
};

// The start-up line for the rank layout: "2 ranks, ZeRO-1: optimizer state sharded (...)".
std::string describe_ranks(int ranks, int zero_stage);

// Everything reported for one optimizer step (the --log-json fields).
struct StepStats {
  std::string checkpoint;  // the checkpoint written after this step, if any
  int step = 0;            // 1-based
  int steps = 0;
  double loss = 0;
  float lr = 0;
  double grad_norm = 0;   // unscaled (inf or NaN on a skipped step)
  int64_t tokens = 0;     // tokens in this step that are trained on (padding excluded)
  double padding = 0;     // padded share of the step's rows x length (0 when packed)
  int micro_batches = 0;  // micro-batches this step ran on this rank
  // fp16: the loss scale this step ran with, and whether its update was skipped (an overflow);
  // 1 and false for fp32 and bf16, which are not scaled.
  float loss_scale = 1.0f;
  bool skipped = false;
  double tokens_per_s = 0;
  double step_ms = 0;
  double data_wait_ms = 0;
  uint64_t device_bytes_in_use = 0;
  uint64_t device_bytes_peak = 0;
  uint64_t planned_peak_bytes = 0;
  // The plan's lower bound (the most bytes live at one moment) and what the step region's pool
  // holds at the end of the step: the step's fragmentation is device_bytes_peak / lower bound.
  uint64_t lower_bound_bytes = 0;
  uint64_t pool_reserved_bytes = 0;
  uint64_t device_budget = 0;
  // The offload tier (optimizer offload, activation offload, or both in one tier): its bytes in
  // use, its peak and the plan's (0 without); this step's copies between the device and the
  // tier, both kinds together (bytes and the copies' time), and the time the executor waited
  // for activation copies (transfer time not hidden behind compute).
  uint64_t offload_bytes_in_use = 0;
  uint64_t offload_bytes_peak = 0;
  uint64_t planned_offload_bytes = 0;
  uint64_t offload_bytes = 0;
  double offload_copy_ms = 0;
  double offload_wait_ms = 0;
  int micro_batch = 0;              // the plan at the end of the step
  int accumulation = 0;             // global batch / micro_batch
  std::string recompute;            // the plan's recomputation: none, selective, full or mixed
  double predicted_step_ms = 0;     // the cost model's time for the plan at the end of the step
  int replans = 0;                  // plan changes before and during this step
  int oom_recoveries = 0;           // allocation failures recovered in this step
  std::vector<std::string> events;  // one line per re-plan, recovery or budget-file warning
  std::vector<std::string> oom_reports;  // the memory report of each allocation failure
  std::optional<double> val_loss;        // on steps where validation ran
  // Several ranks: the rank whose budget (room for the step region) bounds the agreed plan, as
  // of the last re-plan; 0 with one process.
  int budget_rank = 0;
  // With TrainOptions::breakdown: milliseconds of this step per kind of op, and the optimizer
  // (wall time; op_ms.cpu_ms and the *_cpu_ms fields: process CPU time, every thread's).
  model::OpTimes op_ms;
  double optimizer_ms = 0;
  double optimizer_cpu_ms = 0;
  double step_cpu_ms = 0;  // the whole step's process CPU time (always measured)
};

// What the trainer sets up before step one: the memory table for the startup report.
struct SetupInfo {
  int64_t num_parameters = 0;
  uint64_t planned_bytes = 0;  // all arenas together
  std::string memory_table;    // by category, planned
  std::string offload_table;   // the offload tier's buffers, planned ("" without offload)
  uint64_t offload_bytes = 0;  // the offload tier, planned (both kinds)
  uint64_t offload_budget = 0;
  bool offload_optimizer = false;  // the tier holds the optimizer state
  int offloaded_blocks = 0;        // and this many blocks' activations
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  double predicted_step_ms = 0;  // the cost model's time per optimizer step for the plan
  std::string device_source;     // where the speed figures come from ("measured ...", "nominal")
  std::string batching;  // one paragraph on the batching (documents, buckets, padding, shapes)
};

// What `--profile` records, in microseconds since the run started.
struct ProfileRecord {
  struct Span {
    std::string name;
    std::string kind;  // "data", "micro_batch", "optimizer", "validation"
    double start_us, dur_us;
    int step, micro_batch;
  };
  std::vector<Span> spans;
  std::vector<model::KernelSpan> kernels;
  std::vector<model::OpSpan> ops;  // op = index into plan.ops (validation runs ops 0..L+1)
  plan::MemoryPlan plan;
  EventRecorder events;  // every buffer's alloc/free and op begin/end (train/step_events.h)
};

struct TrainResult {
  bool stopped = false;  // should_stop ended the run early
  int total_steps = 0;   // the schedule's steps: TrainOptions::steps, or the count `minutes` chose
  int steps_done = 0;    // steps completed when the run ended
  double final_loss = 0;
  std::optional<double> initial_val_loss;  // with TrainOptions::eval_at_start
  std::optional<double> final_val_loss;
  double tokens_per_s = 0;  // median over steps after the first
  uint64_t device_bytes_peak = 0;
  uint64_t planned_peak_bytes = 0;
  uint64_t lower_bound_bytes = 0;  // most planned bytes live at one moment
  // The offload tier: its measured peak and the plan's offload regions; and the activation copy
  // thread's totals over the run (see StepStats).
  uint64_t offload_bytes_peak = 0;
  uint64_t planned_offload_bytes = 0;
  memory::MemoryStats offload_memory;
  // The device memory the run's communicator holds outside the plan (NCCL's buffers, measured
  // when it connected); 0 on one rank, on the CPU, or through host staging.
  uint64_t communicator_device_bytes = 0;
  uint64_t offload_copied_bytes = 0;
  double offload_copy_ms = 0;
  double offload_wait_ms = 0;
  int replans = 0;  // plan changes over the run (elastic micro-batching)
  int oom_recoveries = 0;
  double padding = 0;            // padded share of all steps' tokens (bucketed batching)
  uint64_t shape_plans = 0;      // step-region plans computed per micro-batch shape (bucketed)
  uint64_t shape_plan_hits = 0;  // micro-batches that found their shape's plan in the cache
  memory::MemoryStats memory;
  std::optional<ProfileRecord> profile;         // with TrainOptions::profile
  std::vector<ZeroWindows::Event> zero_events;  // with TrainOptions::record_zero_events
};

struct TrainCallbacks {
  std::function<void(const SetupInfo&)> on_setup;
  std::function<void(const StepStats&)> on_step;
  // With TrainOptions::eval_at_start: the validation loss before the first step.
  std::function<void(double)> on_initial_validation;
  // Asked after each step (after its checkpoint, if any): true ends the run there, as an
  // interruption would (no final save, no on_finish). For tests of resume, and signals.
  std::function<bool(const StepStats&)> should_stop;
  // Called after training with the final weights, before they are released (for sampling).
  // `device` serves allocations from the run's budget (the step region is released by then).
  std::function<Status(const model::Gpt2Config&, const float* params,
                       memory::MemoryResource* device)>
      on_finish;
};

// Errors: InvalidArgument / NotFound / IoError for bad options, data, budget file or output
// directory (checked before step one); OutOfMemory when no plan fits the budget, at the start or
// after a budget change or an allocation failure; then the last completed step is checkpointed
// to out_dir first (the message says where).
// With several ranks every rank returns the same status: errors are agreed (dist::agree) before
// step one and at every step boundary, so a failure on one rank stops all of them with its
// message ("rank 1: ..."). Re-planning after an allocation failure is not built for several
// ranks yet: the run stops (checkpointing the last completed step). Callbacks run on every rank
// (the CLI prints on rank 0 only); should_stop is agreed (any rank's true stops all).
Result<TrainResult> run_training(const TrainOptions& options, const TrainCallbacks& callbacks);

}  // namespace headroom::train
