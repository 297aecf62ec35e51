// `headroom train`'s flags into the library's request (train/run_request.h): the CLI's thin layer.
#include "cli/common.h"

#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

#include "core/utf8.h"

namespace headroom::cli {

void add_distill_flags(CLI::App* app, TrainFlags& f) {
  app->add_option("--teacher", f.teacher,
                  "knowledge distillation: the teacher's model directory (config.json and "
                  "model.safetensors, e.g. a `headroom train --out` directory), run forward only "
                  "beside the student; same vocabulary, any width or depth "
                  "(docs/notes/distillation.md)");
  app->add_option("--distill-alpha", f.distill_alpha,
                  "with --teacher: the KD share A of the loss A * T^2 * KL(teacher/T || "
                  "student/T) + (1 - A) * cross-entropy, in [0, 1] (default 0.5; 0 is plain "
                  "training)");
  app->add_option("--distill-temperature", f.distill_temperature,
                  "with --teacher: the softmax temperature T > 0 of the KD term (default 2)");
  app->add_option("--teacher-dtype", f.teacher_dtype,
                  "with --teacher: the teacher's precision, auto (bf16 where its weights are "
                  "stored in bf16, else fp32), fp32 or bf16")
      ->capture_default_str();
}

Status resolve_train_options(TrainFlags& f, train::TrainOptions* o) {
  train::RunRequest r;
  r.model = f.model;
  r.model_given = f.model_option && f.model_option->count() > 0;
  r.data = f.data;
  r.tokenizer = f.tokenizer;
  r.vocab = f.vocab;
  r.resume = f.resume;
  // 0 (the flags' default) is auto; a negative value goes through to the library's message.
  auto count = [](int v) { return v != 0 ? std::optional<int>(v) : std::nullopt; };
  r.seq = count(f.seq);
  r.micro_batch = count(f.batch);
  r.global_batch = count(f.global_batch);
  r.steps = f.steps;
  if (!f.minutes.empty()) {
    char* end = nullptr;
    r.minutes = std::strtod(f.minutes.c_str(), &end);
    if (end == f.minutes.c_str() || *end != '\0' || !(r.minutes > 0) || !std::isfinite(r.minutes)) {
      return Status::invalid_argument(
          fmt::format("--minutes {}: not a positive number of minutes (give one such as 2 or 0.5)",
                      valid_utf8(f.minutes)));
    }
  }
  r.seed = f.seed;
  r.precision = f.precision;
  r.recompute = f.recompute;
  r.offload_activations = f.offload_activations;
  r.offload_optimizer = f.offload_optimizer;
  HR_ASSIGN_OR_RETURN(r.device_memory, parse_size_flag("--device-memory", f.device_memory, true));
  r.device_memory_file = f.device_memory_file;
  if (!f.device_memory_file.empty() && f.device_memory != "auto") {
    return Status::invalid_argument(fmt::format(
        "--device-memory {} and --device-memory-file {}: give one (the file holds the budget "
        "and may change while training runs)",
        f.device_memory, f.device_memory_file));
  }
  HR_ASSIGN_OR_RETURN(r.offload_memory,
                      parse_size_flag("--offload-memory", f.offload_memory, true));
  r.device = f.device;
  r.managed_memory = f.managed_memory;
  r.plan_file = f.plan == "auto" ? "" : f.plan;
  r.zero = f.zero;
  r.batching = f.batching;
  if (f.bucket_option && f.bucket_option->count() > 0) r.bucket = f.bucket;
  if (f.lr != 0) r.lr = f.lr;  // 0: auto (NaN and negatives get the library's message)
  if (f.warmup >= 0) r.warmup = f.warmup;
  r.val_fraction = f.val_fraction;
  r.eval_every = f.eval_every;
  r.loss_scale = f.loss_scale;
  r.loss_scale_window = f.loss_scale_window;
  r.inject_overflow = f.inject_overflow;
  r.ranks = f.ranks;
  r.sweep = !f.profile.empty();  // the report shows memory versus micro-batch
  r.quiet = f.json;
  r.self_correct = f.self_correct;
  r.teacher = f.teacher;
  r.distill_alpha = f.distill_alpha;
  r.distill_temperature = f.distill_temperature;
  r.teacher_dtype = f.teacher_dtype;
  HR_ASSIGN_OR_RETURN(train::ResolvedRun run, train::resolve_run(r));
  dist::Communicator* comm = o->comm;  // the caller's
  *o = std::move(run.options);
  o->comm = comm;
  f.search = std::move(run.search);
  f.tokenizer = run.tokenizer;
  return Status::ok();
}

}  // namespace headroom::cli
