// The command line: the subcommands and their flags (the contract in DESIGN.md), wired with
// CLI11; each subcommand runs in its own file (cli/<subcommand>.cc).
#include "cli/cli.h"

#include <CLI/CLI.hpp>
#include <stdexcept>

#include <fmt/format.h>

#include "backend/cpu/amx_gemm.h"
#include "backend/cpu/fused_kernels.h"
#include "backend/cpu/kernels.h"
#include "cli/common.h"
#include "cli/prune.h"
#include "core/log.h"

namespace headroom::cli {

int run(int argc, char** argv) {
  CLI::App app{"headroom: trains transformer language models in the memory you have"};
  app.set_version_flag("--version", version_text,
                       "print the version and what it was built with, and exit");
  app.require_subcommand(1);
  app.footer(
      "JSON output (--json, --log-json, --profile's files, plan files, checkpoints): text that is "
      "not valid UTF-8 (a path, a prompt, a completion ending inside a character) has U+FFFD for "
      "its bad bytes; token ids are exact (docs/notes/json-text.md).\n"
      "Integer flags take whole numbers; counts start at 1, and auto stands for the default where "
      "--help says so; sizes are e.g. 4GiB, 512MiB, 24GB (docs/notes/flags.md).");
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "more log output");

  TrainFlags tf;
  CLI::App* train_cmd = app.add_subcommand("train", "train a GPT-2 model on a token file");
  add_train_flags(train_cmd, tf);
  add_distill_flags(train_cmd, tf);
  train_cmd->add_option("--out", tf.out, "directory for the trained model")->capture_default_str();
  train_cmd->add_option("--log-json", tf.log_json,
                        "write one JSON object per step to FILE (text as in --json: invalid "
                        "UTF-8 as U+FFFD)");
  train_cmd->add_flag("!--no-self-correct", tf.self_correct,
                      "do not correct the cost model by this run's measured op times (nor "
                      "re-plan by it, nor keep the correction for the next run)");
  train_cmd->add_option("--device-memory-file", tf.device_memory_file,
                        "read the device budget (e.g. 2GiB) from FILE before every step; "
                        "editing it re-plans micro-batch, accumulation and recomputation "
                        "with the same global batch (instead of --device-memory); with several "
                        "ranks, {rank} in FILE is replaced by each rank's number (no {rank}: "
                        "one file for all) and the ranks re-plan together under the smallest");
  add_int_flag(train_cmd, "--eval-every", tf.eval_every, {.min = 0, .what = "steps"},
               "steps between validation runs (default 0: only at the end)");
  train_cmd->add_option("--val-fraction", tf.val_fraction, "share of documents held out")
      ->capture_default_str();
  add_int_flag(train_cmd, "--sample-tokens", tf.sample_tokens,
               {.min = 0, .max = kMaxCount, .what = "tokens"},
               "tokens to sample at the end (0: none; default 48, bytes-tiny 320)", true);
  add_int_flag(train_cmd, "--save-every", tf.save_every, {.min = 0, .what = "steps"},
               "write a checkpoint to OUT/checkpoints/step-NNNNNN every N steps and at the end "
               "(0: none)",
               true);
  add_int_flag(train_cmd, "--keep-checkpoints", tf.keep_checkpoints,
               {.min = 0, .what = "checkpoints"}, "newest checkpoints kept (0: all)", true);
  train_cmd
      ->add_option("--zero", tf.zero,
                   "ZeRO stage with several ranks (mpirun -np N headroom train ...): 0 all-reduces "
                   "gradients, 1 shards the optimizer state, 2 also the gradients (per-layer "
                   "windows), 3 also the parameters (gathered per layer); auto: the planner's "
                   "choice")
      ->capture_default_str();
  train_cmd->add_option("--resume", tf.resume,
                        "continue exactly from a checkpoint directory, or from OUT (its newest "
                        "checkpoint); --steps is the run's total");
  train_cmd->add_option("--profile", tf.profile,
                        "write trace.json, memory.json and report.html of the run to DIR");
  train_cmd
      ->add_option("--loss-scale", tf.loss_scale,
                   "fp16: dynamic (start at 2^16, halve on an overflow and skip that step, double "
                   "after --loss-scale-window good steps) or a fixed scale >= 1")
      ->capture_default_str();
  add_int_flag(train_cmd, "--loss-scale-window", tf.loss_scale_window, {.what = "steps"},
               "fp16, dynamic loss scale: good steps in a row before the scale doubles", true);
  train_cmd
      ->add_option("--inject-overflow-at", tf.inject_overflow,
                   "tests: put an infinity into the gradients at these 1-based steps")
      ->group("");  // hidden
  train_cmd->add_flag("--json", tf.json,
                      "print the result as JSON instead of the progress bar (the sample's and "
                      "paths' bytes that are not UTF-8 as U+FFFD)");
  train_cmd->add_option("--batching", tf.batching,
                        "packed (default: T-token windows of the concatenated documents) or "
                        "bucketed (one document per row, rows of one length bucket per step, "
                        "padding masked out of the loss; docs/notes/batching.md)");
  tf.bucket_option = add_int_flag(
      train_cmd, "--bucket", tf.bucket, {.max = kMaxCount, .what = "tokens"},
      "--batching bucketed: bucket lengths are multiples of N tokens (default 32), up to --seq");

  train_cmd->add_option("--sparsity-mask", tf.sparsity_mask,
                        "train a pruned model (`headroom prune`) from DIR with its zeros held: "
                        "pruned weights stay exactly zero through AdamW (the mask: 1 byte per "
                        "weight, planned); --model defaults to DIR");
  add_int_flag(train_cmd, "--prune-at", tf.prune_at, {.min = 0, .what = "steps"},
               "prune after this optimizer step (--prune-method) and hold the mask from then on "
               "(0: never)");
  train_cmd
      ->add_option("--prune-method", tf.prune_method,
                   "--prune-at's mask: an N:M pattern such as 2:4, or magnitude "
                   "(--prune-sparsity, --prune-per-layer)")
      ->capture_default_str();
  train_cmd
      ->add_option("--prune-sparsity", tf.prune_sparsity,
                   "--prune-method magnitude: the share of the prunable weights to prune")
      ->capture_default_str();
  train_cmd->add_flag("--prune-per-layer", tf.prune_per_layer,
                      "--prune-method magnitude: rank each block's weights alone");

  PruneFlags prf;
  CLI::App* prune_cmd = app.add_subcommand("prune",
                                           "prune a saved model (magnitude, N:M, or structured: "
                                           "MLP channels, attention heads) into a new one");
  add_prune_flags(prune_cmd, prf);

  GenerateFlags gf;
  CLI::App* gen_cmd = app.add_subcommand("generate", "sample text from a trained model");
  gen_cmd
      ->add_option("--model-dir", gf.model_dir, "directory with config.json and model.safetensors")
      ->required();
  gen_cmd->add_option("--prompt", gf.prompt, "text to continue (default: a new document)");
  add_int_flag(gen_cmd, "--max-new-tokens", gf.max_new_tokens, {.max = kMaxCount, .what = "tokens"},
               "tokens to generate", true);
  gen_cmd->add_option("--temperature", gf.temperature, "sampling temperature; 0 = greedy")
      ->capture_default_str();
  add_int_flag(gen_cmd, "--top-k", gf.top_k, {.min = 0, .what = "tokens"},
               "sample among the k most likely tokens; 0 = all", true);
  add_int_flag(gen_cmd, "--seed", gf.seed, kSeedRule, "sampling seed", true);
  gen_cmd->add_option("--vocab", gf.vocab, "directory with the GPT-2 vocabulary");
  add_int_flag(gen_cmd, "--threads", gf.threads, kThreadsRule,
               "OpenMP threads (default, or auto: the cores available)");
  gen_cmd->add_flag("--json", gf.json,
                    "print prompt, completion, the completion's token ids (tokens) and the "
                    "prompt's (prompt_tokens) as JSON; text that is not valid UTF-8 (a completion "
                    "ending inside a character) has U+FFFD for its bad bytes, the ids are exact");

  PrepareFlags pf;
  CLI::App* prep_cmd = app.add_subcommand(
      "prepare", "tokenise text files (GPT-2 BPE, or --tokenizer) into a token file");
  prep_cmd
      ->add_option("inputs", pf.inputs,
                   "text files, JSON Lines files (*.jsonl, *.ndjson: one object per line) or "
                   "directories (their files, recursively, sorted; hidden, *.dat and *.u8 "
                   "skipped)")
      ->required();
  prep_cmd->add_option("--out", pf.out, "the token file to write")->required();
  prep_cmd->add_option("--doc-separator", pf.separator,
                       "a line that separates documents inside a file (\"%\" for fortune files); "
                       "default: each file is one document");
  prep_cmd->add_option("--vocab", pf.vocab, "directory with the GPT-2 vocabulary");
  prep_cmd->add_option("--tokenizer", pf.tokenizer,
                       "directory with tokenizer.json, tokenizer.model or GPT-2's files, or "
                       "`bytes` (one token a byte) (default: GPT-2)");
  prep_cmd
      ->add_option("--field", pf.field,
                   "JSON Lines: the member of each line's object that holds the text")
      ->capture_default_str();
  prep_cmd->add_flag("--json", pf.json, "print the statistics as JSON");

  PlanFlags plf;
  CLI::App* plan_cmd = app.add_subcommand(
      "plan", "plan the memory of a training configuration and choose the fastest that fits");
  add_train_flags(plan_cmd, plf.t);
  add_distill_flags(plan_cmd, plf.t);
  add_int_flag(plan_cmd, "--devices", plf.devices, {.max = 1 << 16, .what = "devices"},
               "data-parallel devices", true);
  if (!plan_cmd->get_option_no_throw("--zero")) {
    plan_cmd
        ->add_option("--zero", plf.zero,
                     "ZeRO stage with --devices above 1: auto (the planner chooses), 0, 1, 2 or 3")
        ->capture_default_str();
  }
  plan_cmd->add_flag("!--no-self-correct", plf.t.self_correct,
                     "price the candidates with the nominal cost model, without the corrections "
                     "that earlier `headroom train` runs of this model measured on this machine");
  plan_cmd->add_flag("--sweep", plf.sweep, "also print memory versus micro-batch");
  plan_cmd->add_flag("--json", plf.t.json, "print the plan as one JSON object");

  BenchFlags bnf;
  bnf.t.steps = 5;
  CLI::App* bench_cmd = app.add_subcommand(
      "bench", "time whole training steps on random tokens (median after warm-up)");
  bench_cmd->add_option("--model", bnf.t.model, "preset or config.json")->capture_default_str();
  add_int_flag(bench_cmd, "--batch", bnf.t.batch,
               {.max = kMaxCount, .what = "the micro-batch in sequences", .auto_means = "8"},
               "micro-batch in sequences (default, or auto: 8)");
  add_int_flag(bench_cmd, "--seq", bnf.t.seq,
               {.max = kMaxCount,
                .what = "the sequence length in tokens",
                .auto_means = "min(256, n_positions)"},
               "sequence length (default, or auto: min(256, n_positions))");
  bench_cmd->add_option("--precision", bnf.t.precision, "fp32, bf16 or fp16 (auto: fp32)")
      ->capture_default_str();
  add_int_flag(bench_cmd, "--steps", bnf.t.steps, {.what = "timed steps"}, "timed steps", true);
  add_int_flag(bench_cmd, "--warmup", bnf.warmup, {.min = 0, .what = "steps"},
               "untimed steps first (0: none)", true);
  bench_cmd
      ->add_option("--device", bnf.t.device,
                   "cpu, or cuda in a CUDA build (the process's GPU; MFU against its spec's "
                   "peak)")
      ->capture_default_str();
  bench_cmd->add_flag("--managed-memory", bnf.t.managed_memory,
                      "with --device cuda: the arenas in managed (unified) memory");
  add_size_flag(bench_cmd, "--device-memory", bnf.t.device_memory, true,
                "device memory budget (default, or auto: available memory less a margin)", true);
  add_int_flag(bench_cmd, "--threads", bnf.t.threads, kThreadsRule,
               "OpenMP threads (default, or auto: the cores available)");
  bench_cmd->add_option("--recompute", bnf.t.recompute, "none, selective or full (every block)")
      ->capture_default_str();
  bench_cmd
      ->add_option("--offload-activations", bnf.t.offload_activations,
                   "on: offload every block's saved activations to the offload tier; off (auto: "
                   "off)")
      ->capture_default_str();
  add_size_flag(bench_cmd, "--offload-memory", bnf.t.offload_memory, true,
                "offload tier budget (default, or auto: the host's available memory)");
  bench_cmd->add_option("--attention", bnf.attention, "tiled or plain")->capture_default_str();
  add_int_flag(bench_cmd, "--head-chunk", bnf.head_chunk, {.min = 0, .what = "tokens"},
               "tokens per chunk of the fused LM head; 0 = full logits", true);
  bench_cmd
      ->add_option("--bf16-weights", bnf.bf16_weights,
                   "bf16: keep a bf16 copy of the weights (copy) or cast each layer's before use "
                   "(cast)")
      ->capture_default_str();
  bench_cmd
      ->add_option("--pad-rows", bnf.pad_rows,
                   "pad the MLP activations' rows off 4 KiB multiples and the logits' rows to 64 "
                   "elements (true/false)")
      ->capture_default_str();
  bench_cmd->add_flag("--record", bnf.record,
                      "record every kernel, op and step span as --profile does (to measure "
                      "the recording's cost)");
  bench_cmd
      ->add_option("--peak-between-steps", bnf.peak_between_steps,
                   "time calibrate's peak GEMMs after every timed step and quote MFU against "
                   "them too (true/false)")
      ->capture_default_str();
  bench_cmd->add_option(
      "--alternate", bnf.alternate,
      "VAR=A,B: run successive steps with the knob VAR (HEADROOM_BF16_GEMM, "
      "HEADROOM_BF16_WGRAD_TRANSPOSE or HEADROOM_GELU_TABLE) set to A, B, A, ... (empty: unset) "
      "and report each value's "
      "tokens/s and the median ratio of adjacent steps: an A/B on the same state of the host");
  bench_cmd->add_flag("--breakdown", bnf.breakdown,
                      "time every kernel call by kind (gemm, attention, norm, ...), in wall and "
                      "process CPU time");
  bench_cmd->add_flag("--json", bnf.t.json,
                      "print tokens_per_s, step_ms_median, model_flops_per_s, mfu, mfu_in_run, "
                      "peak_device_bytes as JSON");

  bool calib_json = false;
  std::string calib_device = "cpu";
  CLI::App* cal_cmd = app.add_subcommand(
      "calibrate", "measure this machine's GEMM speed and memory bandwidth for the cost model");
  cal_cmd->add_flag("--json", calib_json, "print the figures as JSON");
  cal_cmd->add_option("--device", calib_device,
                      "cpu (default), or cuda: measure the process's GPU (GEMMs, device memory, "
                      "pinned copies) for plans on it");

  bool version_json_flag = false;
  CLI::App* version_cmd = app.add_subcommand(
      "version",
      "print the version, the compiler, the kernels compiled and usable here, oneDNN, "
      "OpenMP, MPI and CUDA");
  version_cmd->add_flag("--json", version_json_flag, "print the same as one JSON object");

  try {
    app.parse(argc, argv);
  } catch (const FlagValueError& e) {
    return fail(Status::invalid_argument(e.what()));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (verbose) set_log_level(LogLevel::kDebug);
  // Measurement knobs from the environment: a bad value is an error here, before any work.
  try {
    (void)cpu::attention_bf16_kernel();
    (void)cpu::bf16_wgrad_transposes(1, 1, 1);
    (void)cpu::amx_gemm_takes(32, DType::kF32);  // reads HEADROOM_BF16_GEMM first, on any CPU
    (void)cpu::gelu_by_table();
  } catch (const std::invalid_argument& e) {
    return fail(Status::invalid_argument(std::string(e.what()) + " (unset it for the default)"));
  }
  // JSON output never throws on text (dump_json: U+FFFD for invalid UTF-8); anything else a JSON
  // value throws is a bug, reported here rather than as an abort.
  try {
    if (train_cmd->parsed()) return run_train(tf);
    if (gen_cmd->parsed()) return run_generate(gf);
    if (prune_cmd->parsed()) {
      return run_prune(prf, [&](const std::string& tok) { return default_corpus("", tok); });
    }
    if (prep_cmd->parsed()) return run_prepare(pf);
    if (plan_cmd->parsed()) return run_plan(plf);
    if (cal_cmd->parsed()) return run_calibrate(calib_json, calib_device);
    if (bench_cmd->parsed()) return run_bench(bnf);
    if (version_cmd->parsed()) return run_version(version_json_flag);
  } catch (const nlohmann::json::exception& e) {
    return fail(Status::internal(fmt::format(
        "could not build the JSON output: {} (a bug in headroom: please report it with the "
        "command line)",
        e.what())));
  }
  return 2;
}

}  // namespace headroom::cli
