// Checkpoints: everything needed to continue a run exactly. A checkpoint is a directory
// OUT/checkpoints/step-NNNNNN/ holding config.json and model.safetensors (Hugging Face names,
// loadable by `headroom generate`), optimizer.safetensors (the AdamW moments, flat) and
// trainer_state.json (step, data position, the schedule and the plan). It is written into a
// temporary directory, each file fsync'ed, then renamed into place, so a directory named
// step-NNNNNN is always complete; a crash leaves at most a temporary directory behind.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/status.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "train/loss_scale.h"

namespace headroom::train {

struct TrainerState {
  int step = 0;               // optimizer steps done
  int64_t data_position = 0;  // the train batcher's position()
  int total_steps = 0;        // the run's --steps (the schedule's length)
  int warmup_steps = 0;
  float lr = 0;
  float min_lr_ratio = 0;
  int micro_batch = 0;
  int accumulation = 0;
  int seq = 0;
  uint64_t seed = 0;
  std::string data;  // the token file the run reads
  // How data_position is counted (docs/notes/batching.md): "packed" (a token index) or
  // "bucketed" (batches served; `bucket` is the bucket granularity). Absent in older
  // checkpoints, which were packed.
  std::string batching = "packed";
  int bucket = 0;
  // fp16: the dynamic loss scaler's state ("loss_scale" in trainer_state.json; absent for fp32
  // and bf16, and in checkpoints written before fp16 existed).
  std::optional<LossScaleState> loss_scale;
  // The packed batcher's order (data::PackedBatcher::Order): "shuffled" (data_position counts
  // windows) or "sequential" (a token index). Absent in checkpoints written before the shuffle,
  // which were sequential; bucketed checkpoints leave it at that and ignore it.
  std::string data_order = "sequential";
};

struct CheckpointView {
  const model::Gpt2Config* config;
  const model::ParamTable* table;
  const float* params;
  const float* adam_m;
  const float* adam_v;
  TrainerState state;
};

// Writes `root`/step-NNNNNN atomically and then deletes all but the newest `keep` checkpoints
// (keep <= 0 keeps all). Returns the directory written.
Result<std::string> save_checkpoint(const std::string& root, const CheckpointView& c, int keep);

// `path` is a checkpoint directory, or a run's output directory / checkpoints directory (then its
// newest complete checkpoint). Fills the three buffers (each table.total_floats floats) and
// returns the state. Errors name the file and what is wrong. On an error the buffers may hold
// part of the checkpoint: the caller must not train from them (the trainer stops).
struct LoadedCheckpoint {
  std::string dir;
  model::Gpt2Config config;
  TrainerState state;
};
Result<LoadedCheckpoint> find_checkpoint(const std::string& path);
Status load_checkpoint(const LoadedCheckpoint& c, const model::ParamTable& table, float* params,
                       float* adam_m, float* adam_v);

}  // namespace headroom::train
