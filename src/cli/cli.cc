// Subcommands and their flags (the contract in DESIGN.md), human and JSON output.
#include "cli/cli.h"

#include <omp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "backend/cpu/device.h"
#include "core/log.h"
#include "core/units.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "memory/host_resource.h"
#include "model/config.h"
#include "model/weights.h"
#include "report/progress.h"
#include "train/generate.h"
#include "train/trainer.h"

#ifndef HEADROOM_VERSION
#define HEADROOM_VERSION "0.1.0"
#endif

namespace headroom::cli {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

int fail(const Status& s) {
  std::fprintf(stderr, "headroom: error: %s\n", s.message().c_str());
  return 1;
}

void set_threads(int threads) {
  int n = threads > 0 ? threads : cpu::query_cpu_device().cores;
  omp_set_num_threads(n);
}

std::string cache_dir() {
  if (const char* d = std::getenv("HEADROOM_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/headroom";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/headroom";
  return ".headroom-cache";
}

// The default corpus: Debian's fortunes, tokenised once into the cache.
Result<std::string> default_corpus(const std::string& vocab_dir) {
  std::string path = cache_dir() + "/fortunes.tokens";
  if (fs::exists(path)) return path;
  std::vector<std::string> inputs = data::default_corpus_inputs();
  if (inputs.empty()) {
    return Status::not_found(
        "no --data given and the default corpus (Debian's fortunes package, "
        "/usr/share/games/fortunes) is not installed: run `make setup` or pass --data FILE");
  }
  std::error_code ec;
  fs::create_directories(cache_dir(), ec);
  if (ec) return Status::io_error(fmt::format("cannot create cache directory '{}': {}", cache_dir(), ec.message()));
  log_info("preparing the default corpus ({} fortune files) into {}", inputs.size(), path);
  data::PrepareOptions po;
  po.inputs = inputs;
  po.out = path;
  po.vocab_dir = vocab_dir;
  po.doc_separator = "%";
  HR_ASSIGN_OR_RETURN(data::PrepareStats st, data::prepare_token_file(po));
  log_info("  {} documents, {} tokens in {:.1f} s", st.documents, st.tokens, st.seconds);
  return path;
}

Result<uint64_t> device_budget(const std::string& flag) {
  if (flag.empty() || flag == "auto") {
    cpu::CpuDeviceInfo info = cpu::query_cpu_device();
    return cpu::default_device_budget(info);
  }
  HR_ASSIGN_OR_RETURN(uint64_t b, parse_bytes(flag));
  if (b == 0) return Status::invalid_argument("--device-memory must be positive");
  return b;
}

// ---------------------------------------------------------------------------------------------
struct TrainFlags {
  std::string model = "gpt2-tiny";
  std::string data;
  int seq = 0;
  int batch = 0;
  int global_batch = 0;
  int steps = 200;
  std::string precision = "auto";
  std::string device = "cpu";
  std::string device_memory = "auto";
  std::string plan = "auto";
  uint64_t seed = 1337;
  std::string out = "out";
  std::string log_json;
  float lr = 0;
  int warmup = -1;
  int eval_every = 0;
  double val_fraction = 0.05;
  int sample_tokens = 48;
  int threads = 0;
  std::string vocab;
  bool json = false;
};

void add_train_flags(CLI::App* app, TrainFlags& f) {
  app->add_option("--model", f.model, "preset (gpt2-tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl), "
                                      "a config.json, or a directory holding one")
      ->capture_default_str();
  app->add_option("--data", f.data,
                  "token file from `headroom prepare` (default: Debian's fortunes, prepared once)");
  app->add_option("--seq", f.seq, "sequence length T (default: min(128, n_positions))");
  app->add_option("--batch", f.batch, "micro-batch in sequences (default: 8)");
  app->add_option("--global-batch", f.global_batch,
                  "sequences per optimizer step; a multiple of --batch (default: --batch)");
  app->add_option("--steps", f.steps, "optimizer steps")->capture_default_str();
  app->add_option("--precision", f.precision, "auto or fp32 (bf16 and fp16 are not built yet)")
      ->capture_default_str();
  app->add_option("--device", f.device, "cpu")->capture_default_str();
  app->add_option("--device-memory", f.device_memory,
                  "device memory budget, e.g. 4GiB (default: available memory less a margin, "
                  "cgroup limits respected)")
      ->capture_default_str();
  app->add_option("--seed", f.seed, "seed for initialisation")->capture_default_str();
  app->add_option("--lr", f.lr, "peak learning rate (default: 1e-3 below 50M parameters, else 6e-4)");
  app->add_option("--warmup", f.warmup, "warmup steps (default: 10% of --steps, at most 100)");
  app->add_option("--threads", f.threads, "OpenMP threads (default: the cores available)");
  app->add_option("--vocab", f.vocab, "directory with the GPT-2 vocabulary (default: set-up's)");
}

Status resolve_train_options(TrainFlags& f, train::TrainOptions* o) {
  HR_ASSIGN_OR_RETURN(o->config, model::resolve_model(f.model));
  o->model_name = f.model;
  if (f.device != "cpu") {
    return Status::unsupported(fmt::format("--device {}: only the cpu device is built", f.device));
  }
  if (f.precision != "auto" && f.precision != "fp32") {
    return Status::unsupported(fmt::format(
        "--precision {}: only fp32 is built so far (use --precision fp32 or auto)", f.precision));
  }
  o->seq = f.seq > 0 ? f.seq : std::min(128, o->config.n_positions);
  if (f.seq < 0) return Status::invalid_argument(fmt::format("--seq {} must be positive", f.seq));
  if (f.batch < 0) return Status::invalid_argument(fmt::format("--batch {} must be positive", f.batch));
  o->micro_batch = f.batch > 0 ? f.batch : 8;
  if (f.global_batch < 0) {
    return Status::invalid_argument(fmt::format("--global-batch {} must be positive", f.global_batch));
  }
  int global = f.global_batch > 0 ? f.global_batch : o->micro_batch;
  if (f.batch == 0 && global < o->micro_batch) o->micro_batch = global;
  if (global % o->micro_batch != 0) {
    return Status::invalid_argument(fmt::format(
        "--global-batch {} is not a multiple of --batch {}", global, o->micro_batch));
  }
  o->accumulation = global / o->micro_batch;
  o->steps = f.steps;
  HR_ASSIGN_OR_RETURN(o->device_memory, device_budget(f.device_memory));
  o->seed = f.seed;
  const int64_t nparams = model::gpt2_param_table(o->config).num_parameters;
  o->adamw.lr = f.lr > 0 ? f.lr : (nparams < 50'000'000 ? 1e-3f : 6e-4f);
  if (f.lr < 0 || !std::isfinite(f.lr)) {
    return Status::invalid_argument(fmt::format("--lr {} must be positive", f.lr));
  }
  o->warmup_steps = f.warmup >= 0 ? f.warmup : std::min(100, std::max(1, f.steps / 10));
  o->val_fraction = f.val_fraction;
  if (!(f.val_fraction >= 0 && f.val_fraction < 0.5)) {
    return Status::invalid_argument(fmt::format("--val-fraction {} must be in [0, 0.5)", f.val_fraction));
  }
  o->eval_every = f.eval_every;
  if (f.data.empty()) {
    HR_ASSIGN_OR_RETURN(o->data, default_corpus(f.vocab));
  } else {
    o->data = f.data;
  }
  return Status::ok();
}

json step_json(const train::StepStats& s) {
  json j = {{"step", s.step},
            {"loss", s.loss},
            {"lr", s.lr},
            {"grad_norm", s.grad_norm},
            {"tokens", s.tokens},
            {"tokens_per_s", s.tokens_per_s},
            {"step_ms", s.step_ms},
            {"data_wait_ms", s.data_wait_ms},
            {"device_bytes_in_use", s.device_bytes_in_use},
            {"device_bytes_peak", s.device_bytes_peak},
            {"planned_peak_bytes", s.planned_peak_bytes},
            {"micro_batch", s.micro_batch},
            {"accumulation", s.accumulation}};
  if (s.val_loss) j["val_loss"] = *s.val_loss;
  return j;
}

int run_train(TrainFlags& f) {
  set_threads(f.threads);
  train::TrainOptions o;
  if (Status s = resolve_train_options(f, &o); !s.is_ok()) return fail(s);
  o.out_dir = f.out;

  std::ofstream log;
  if (!f.log_json.empty()) {
    log.open(f.log_json, std::ios::trunc);
    if (!log) return fail(Status::io_error(fmt::format("cannot write --log-json '{}'", f.log_json)));
  }
  std::optional<data::Gpt2Tokenizer> tok;
  {
    std::string vd = f.vocab.empty() ? data::default_vocab_dir() : f.vocab;
    Result<data::Gpt2Tokenizer> t = data::Gpt2Tokenizer::load(vd);
    if (t.is_ok()) tok.emplace(std::move(t).value());
  }

  report::ProgressBar bar;
  train::TrainCallbacks cb;
  cb.on_setup = [&](const train::SetupInfo& info) {
    if (f.json) return;
    std::fprintf(stderr,
                 "headroom train: %s, %.1fM parameters, micro-batch %d x seq %d, accumulation %d, "
                 "%d steps, lr %.2g\n",
                 o.model_name.c_str(), double(info.num_parameters) / 1e6, o.micro_batch, o.seq,
                 o.accumulation, o.steps, double(o.adamw.lr));
    std::fprintf(stderr, "data: %s (%lld train / %lld validation tokens)\n", o.data.c_str(),
                 static_cast<long long>(info.train_tokens), static_cast<long long>(info.val_tokens));
    std::fprintf(stderr, "device: cpu, %d threads, budget %s\nmemory plan:\n%s", omp_get_max_threads(),
                 format_bytes(o.device_memory).c_str(), info.memory_table.c_str());
  };
  cb.on_step = [&](const train::StepStats& s) {
    if (log.is_open()) log << step_json(s).dump() << "\n" << std::flush;
    if (f.json) return;
    std::string text = fmt::format("loss {:.4f}  lr {:.2e}  {:.0f} tok/s  mem {} / {}", s.loss, s.lr,
                                   s.tokens_per_s, format_bytes(s.device_bytes_in_use),
                                   format_bytes(s.device_budget));
    if (s.val_loss) bar.println(fmt::format("step {}: validation loss {:.4f}", s.step, *s.val_loss));
    bar.update(s.step, s.steps, text);
  };
  std::string sample_text;
  cb.on_finish = [&](const model::Gpt2Config& cfg, const float* params) -> Status {
    if (!tok || f.sample_tokens <= 0) return Status::ok();
    memory::HostResource host;
    train::SampleOptions so;
    so.max_new_tokens = f.sample_tokens;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = f.seed;
    so.stop_token = tok->eot_token();
    HR_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                        train::sample_tokens(cfg, params, {tok->eot_token()}, so, &host));
    if (!ids.empty() && ids.back() == tok->eot_token()) ids.pop_back();
    sample_text = tok->decode(ids);
    return Status::ok();
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  bar.finish();
  if (!r.is_ok()) return fail(r.status());
  if (f.json) {
    json j = {{"final_loss", r->final_loss},
              {"tokens_per_s", r->tokens_per_s},
              {"device_bytes_peak", r->device_bytes_peak},
              {"out", o.out_dir},
              {"sample", sample_text}};
    if (r->final_val_loss) j["final_val_loss"] = *r->final_val_loss;
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::fprintf(stderr, "done: loss %.4f", r->final_loss);
  if (r->final_val_loss) std::fprintf(stderr, ", validation loss %.4f", *r->final_val_loss);
  std::fprintf(stderr, ", median %.0f tokens/s, peak device memory %s\n", r->tokens_per_s,
               format_bytes(r->device_bytes_peak).c_str());
  std::fprintf(stderr, "model saved to %s/ (config.json, model.safetensors)\n", o.out_dir.c_str());
  if (!sample_text.empty()) std::printf("sample:\n%s\n", sample_text.c_str());
  return 0;
}

// ---------------------------------------------------------------------------------------------
struct GenerateFlags {
  std::string model_dir;
  std::string prompt;
  int max_new_tokens = 64;
  float temperature = 0.8f;
  int top_k = 40;
  uint64_t seed = 42;
  std::string vocab;
  int threads = 0;
  bool json = false;
};

int run_generate(GenerateFlags& f) {
  set_threads(f.threads);
  Result<model::Gpt2Config> cfg = model::load_config_file(f.model_dir + "/config.json");
  if (!cfg.is_ok()) return fail(cfg.status());
  std::string vd = f.vocab.empty() ? data::default_vocab_dir() : f.vocab;
  Result<data::Gpt2Tokenizer> tok = data::Gpt2Tokenizer::load(vd);
  if (!tok.is_ok()) return fail(tok.status());
  if (tok->vocab_size() > cfg->vocab_size) {
    return fail(Status::invalid_argument(fmt::format(
        "{}/config.json: vocab_size {} is smaller than the tokenizer's {}", f.model_dir,
        cfg->vocab_size, tok->vocab_size())));
  }
  const model::ParamTable table = model::gpt2_param_table(*cfg);
  memory::HostResource host;
  Result<memory::Arena> params = memory::Arena::create(
      &host, {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}},
      memory::sequential_layout(
          {{"parameters", DType::kF32, Shape{table.total_floats}, memory::Category::kWeights}}),
      memory::Category::kWeights);
  if (!params.is_ok()) return fail(params.status());
  if (Status s = model::load_weights(f.model_dir + "/model.safetensors", table, params->f32(0));
      !s.is_ok()) {
    return fail(s);
  }
  std::vector<int32_t> prompt = tok->encode(f.prompt);
  if (prompt.empty()) prompt.push_back(tok->eot_token());
  train::SampleOptions so;
  so.max_new_tokens = f.max_new_tokens;
  so.temperature = f.temperature;
  so.top_k = f.top_k;
  so.seed = f.seed;
  so.stop_token = tok->eot_token();
  if (!f.json) std::printf("%s", f.prompt.c_str());
  Result<std::vector<int32_t>> ids = train::sample_tokens(
      *cfg, params->f32(0), prompt, so, &host, [&](int32_t t) {
        if (!f.json && t != tok->eot_token()) {
          std::printf("%s", tok->decode(std::span<const int32_t>(&t, 1)).c_str());
          std::fflush(stdout);
        }
      });
  if (!ids.is_ok()) return fail(ids.status());
  if (f.json) {
    std::vector<int32_t> out = *ids;
    if (!out.empty() && out.back() == tok->eot_token()) out.pop_back();
    json j = {{"prompt", f.prompt}, {"completion", tok->decode(out)}, {"tokens", *ids}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("\n");
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
struct PrepareFlags {
  std::vector<std::string> inputs;
  std::string out;
  std::string separator;
  std::string vocab;
  bool json = false;
};

int run_prepare(PrepareFlags& f) {
  data::PrepareOptions po;
  po.inputs = f.inputs;
  po.out = f.out;
  po.doc_separator = f.separator;
  po.vocab_dir = f.vocab;
  Result<data::PrepareStats> st = data::prepare_token_file(po);
  if (!st.is_ok()) return fail(st.status());
  if (f.json) {
    json j = {{"out", f.out},         {"files", st->files},   {"documents", st->documents},
              {"tokens", st->tokens}, {"bytes", st->bytes},   {"seconds", st->seconds}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s: %llu documents, %llu tokens from %llu files (%s of text) in %.1f s\n",
                f.out.c_str(), static_cast<unsigned long long>(st->documents),
                static_cast<unsigned long long>(st->tokens),
                static_cast<unsigned long long>(st->files), format_bytes(st->bytes).c_str(),
                st->seconds);
  }
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"headroom: trains transformer language models in the memory you have"};
  app.set_version_flag("--version", std::string("headroom ") + HEADROOM_VERSION);
  app.require_subcommand(1);
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "more log output");

  TrainFlags tf;
  CLI::App* train_cmd = app.add_subcommand("train", "train a GPT-2 model on a token file");
  add_train_flags(train_cmd, tf);
  train_cmd->add_option("--out", tf.out, "directory for the trained model")->capture_default_str();
  train_cmd->add_option("--log-json", tf.log_json, "write one JSON object per step to FILE");
  train_cmd->add_option("--eval-every", tf.eval_every,
                        "steps between validation runs (default: only at the end)");
  train_cmd->add_option("--val-fraction", tf.val_fraction, "share of documents held out")
      ->capture_default_str();
  train_cmd->add_option("--sample-tokens", tf.sample_tokens,
                        "tokens to sample at the end (0: none)")
      ->capture_default_str();
  train_cmd->add_flag("--json", tf.json, "print the result as JSON instead of the progress bar");

  GenerateFlags gf;
  CLI::App* gen_cmd = app.add_subcommand("generate", "sample text from a trained model");
  gen_cmd->add_option("--model-dir", gf.model_dir, "directory with config.json and model.safetensors")
      ->required();
  gen_cmd->add_option("--prompt", gf.prompt, "text to continue (default: a new document)");
  gen_cmd->add_option("--max-new-tokens", gf.max_new_tokens, "tokens to generate")
      ->capture_default_str();
  gen_cmd->add_option("--temperature", gf.temperature, "sampling temperature; 0 = greedy")
      ->capture_default_str();
  gen_cmd->add_option("--top-k", gf.top_k, "sample among the k most likely tokens; 0 = all")
      ->capture_default_str();
  gen_cmd->add_option("--seed", gf.seed, "sampling seed")->capture_default_str();
  gen_cmd->add_option("--vocab", gf.vocab, "directory with the GPT-2 vocabulary");
  gen_cmd->add_option("--threads", gf.threads, "OpenMP threads (default: the cores available)");
  gen_cmd->add_flag("--json", gf.json, "print prompt, completion and token ids as JSON");

  PrepareFlags pf;
  CLI::App* prep_cmd =
      app.add_subcommand("prepare", "tokenise text files (GPT-2 BPE) into a token file");
  prep_cmd->add_option("inputs", pf.inputs, "text files or directories")->required();
  prep_cmd->add_option("--out", pf.out, "the token file to write")->required();
  prep_cmd->add_option("--doc-separator", pf.separator,
                       "a line that separates documents inside a file (\"%\" for fortune files); "
                       "default: each file is one document");
  prep_cmd->add_option("--vocab", pf.vocab, "directory with the GPT-2 vocabulary");
  prep_cmd->add_flag("--json", pf.json, "print the statistics as JSON");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (verbose) set_log_level(LogLevel::kDebug);
  if (train_cmd->parsed()) return run_train(tf);
  if (gen_cmd->parsed()) return run_generate(gf);
  if (prep_cmd->parsed()) return run_prepare(pf);
  return 2;
}

}  // namespace headroom::cli
