// `headroom train`: one process per rank, progress or JSON, the --profile report, the sample.
#include "cli/common.h"
#include "model/prune.h"
#include "plan/cost_model.h"

#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <tuple>

#include <fmt/format.h>

#include "backend/cpu/device.h"
#include "core/log.h"
#include "core/units.h"
#include "core/utf8.h"
#include "data/byte_tokenizer.h"
#include "report/profile.h"
#include "report/progress.h"
#include "train/checkpoint.h"
#include "train/elastic.h"
#include "train/generate.h"

namespace headroom::cli {

report::PlanCandidate plan_candidate(const plan::Candidate& c) {
  report::PlanCandidate p;
  p.micro_batch = c.policy.micro_batch;
  p.accumulation = c.policy.accumulation;
  p.precision = c.policy.precision;
  p.techniques = plan::describe_exec(c.policy.exec);
  p.peak_bytes = c.peak_bytes;
  p.lower_bound_bytes = c.lower_bound_bytes;
  p.predicted_tokens_per_s = c.cost.tokens_per_s;
  for (size_t i = 0; i < c.by_category.size(); i++) {
    if (c.by_category[i]) {
      p.by_category[std::string(memory::category_name(memory::Category(i)))] = c.by_category[i];
    }
  }
  return p;
}

// `--profile DIR`: trace.json, memory.json and report.html from what the run recorded: op spans
// and memory events from the event stream (train/step_events.h), trainer phases and kernels from
// the spans (docs/notes/report.md).
Status write_profile(const std::string& dir, const TrainFlags& f, const train::TrainOptions& o,
                     const train::TrainResult& r) {
  const train::ProfileRecord& rec = *r.profile;
  const plan::MemoryPlan& mp = rec.plan;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return Status::io_error(
        fmt::format("cannot create --profile directory '{}': {}", dir, ec.message()));
  HR_ASSIGN_OR_RETURN(report::ChartLib lib, report::load_chart_lib());

  report::Profile p;
  p.title = "headroom profile: " + o.model_name;
  p.model = fmt::format("{} ({:.1f}M parameters), {} layers, d_model {}", o.model_name,
                        double(mp.params.num_parameters) / 1e6, o.config.n_layer, o.config.n_embd);
  p.device =
      fmt::format("{}, budget {}", o.ops ? o.ops->name() : "cpu", format_bytes(o.device_memory));
  p.run = fmt::format("seq {}, micro-batch {} x {} accumulation, {}, {}, {} steps", o.seq,
                      o.micro_batch, o.accumulation, model::precision_name(o.exec.precision),
                      plan::describe_exec(o.exec), r.steps_done);
  auto cat = [](memory::Category c) { return std::string(memory::category_name(c)); };
  // Spans: trainer phases, ops, kernels.
  for (const auto& sp : rec.spans) {
    if (sp.kind == "micro_batch") continue;  // the ops below cover it
    p.spans.push_back({sp.name, sp.kind,
                       sp.kind == "data" ? report::kThreadData : report::kThreadCompute,
                       sp.start_us, sp.dur_us, sp.step, sp.micro_batch, -1});
  }
  // Op spans from the recorded op_begin/op_end events, an end closing the latest open begin of the
  // same op on the same thread (the model's ops on the training thread; the optimizer step and the
  // data wait there too, the loader's fills on its own track); markers (re-plans, with their
  // cause) from marker events. Ops outside the schedule count as their phase ("optimizer",
  // "data") in the time per category, the loader's as "data loader (background)".
  const EventLog& log = rec.events.log();
  std::map<std::tuple<uint8_t, int32_t, uint32_t>, std::vector<const Event*>> open_ops;
  std::map<std::string, double> by_kind;
  for (const Event& e : log.events()) {
    if (e.kind == EventKind::kMarker) {
      p.markers.push_back({e.t_us, log.name(e.name), log.name(e.category), log.name(e.region)});
    } else if (e.kind == EventKind::kOpBegin) {
      open_ops[{e.thread, e.op, e.name}].push_back(&e);
    } else if (e.kind == EventKind::kOpEnd) {
      auto& open = open_ops[{e.thread, e.op, e.name}];
      if (open.empty()) continue;
      const Event& b = *open.back();
      open.pop_back();
      const bool scheduled = e.op >= 0;
      const std::string category = scheduled ? "op" : std::string(event_phase_name(e.phase));
      const int thread = e.thread == kEventThreadLoader ? report::kThreadData
                         : e.thread == kEventThreadCopy ? report::kThreadCopy
                                                        : report::kThreadCompute;
      p.spans.push_back({log.name(e.name), category, thread, b.t_us, e.t_us - b.t_us, e.step,
                         e.micro_batch, e.layer});
      if (!scheduled) {
        by_kind[thread == report::kThreadData   ? category + " loader (background)"
                : thread == report::kThreadCopy ? "offload copies (background)"
                                                : category] += (e.t_us - b.t_us) / 1e3;
      }
    }
  }
  for (const auto& k : rec.kernels) {
    std::string kind(model::op_kind_name(k.kind));
    p.spans.push_back({kind, kind, report::kThreadCompute, k.start_us, k.dur_us, -1, -1, -1});
    by_kind[kind] += k.dur_us / 1e3;
  }
  for (auto& [k, ms] : by_kind) p.time_by_category_ms[k] = ms / double(std::max(1, r.steps_done));
  // The cost model's figure for each of the kinds (docs/notes/cost-model.md), per step.
  const plan::StepCost predicted = plan::estimate_step(o.config, mp, o.device);
  for (size_t k = 0; k < plan::kCostKinds; k++) {
    p.predicted_time_by_category_ms[std::string(plan::cost_kind_name(plan::CostKind(k)))] =
        predicted.by_kind[k] * 1e3;
  }

  // Memory: the recorded allocations and releases (persistent regions at the start, each step
  // buffer from its first op's begin to its last op's end, every micro-batch).
  p.events = log;
  // The timeline shows the last step.
  for (const auto& sp : rec.spans) {
    if (sp.step != r.steps_done - 1) continue;
    if (p.window_start_us == 0 || sp.start_us < p.window_start_us) p.window_start_us = sp.start_us;
    p.window_end_us = std::max(p.window_end_us, sp.start_us + sp.dur_us);
  }
  // What was live at the peak: from the recorded events (right also after a re-plan); the plan's
  // peak op when nothing was recorded.
  p.live_at_peak = report::live_at_timeline_peak(p.events);
  if (p.live_at_peak.empty()) {
    for (const plan::Region& reg : mp.persistent) {
      for (size_t i = 0; i < reg.buffers.size(); i++) {
        p.live_at_peak.push_back({reg.buffers[i].name, cat(reg.buffers[i].category),
                                  reg.buffers[i].bytes(), reg.layout.offsets[i]});
      }
    }
    for (size_t i = 0; i < mp.step.buffers.size(); i++) {
      if (mp.first_op[i] <= mp.peak_op && mp.peak_op <= mp.last_op[i]) {
        const auto& b = mp.step.buffers[i];
        p.live_at_peak.push_back({b.name, cat(b.category), b.bytes(), mp.step.layout.offsets[i]});
      }
    }
  }
  p.peak_bytes = r.device_bytes_peak;
  p.planned_peak_bytes = mp.peak_bytes;
  p.arena_bytes = mp.peak_bytes;
  p.lower_bound_bytes = mp.lower_bound_bytes;
  p.budget_bytes = o.device_memory;
  if (f.search && f.search->chosen) {
    p.plan.chosen = plan_candidate(*f.search->chosen);
    for (size_t i = 1; i < f.search->candidates.size() && i < 6; i++) {
      p.plan.runners_up.push_back(plan_candidate(f.search->candidates[i]));
    }
    p.plan.planning_ms = f.search->planning_ms;
    for (const plan::Candidate& c : f.search->sweep) {
      report::SweepRow row;
      row.micro_batch = c.policy.micro_batch;
      row.planned_peak = c.peak_bytes;
      row.predicted_tokens_per_s = c.cost.tokens_per_s;
      row.fits = c.fits;
      row.techniques = plan::describe_exec(c.policy.exec);
      if (c.policy.micro_batch == o.micro_batch) {
        row.measured_peak = r.device_bytes_peak;
        row.measured_tokens_per_s = r.tokens_per_s;
      }
      p.sweep.push_back(row);
    }
  } else {
    p.plan.chosen.micro_batch = o.micro_batch;
    p.plan.chosen.accumulation = o.accumulation;
    p.plan.chosen.precision = std::string(model::precision_name(o.exec.precision));
    p.plan.chosen.techniques = plan::describe_exec(o.exec);
    p.plan.chosen.peak_bytes = mp.peak_bytes;
    p.plan.chosen.lower_bound_bytes = mp.lower_bound_bytes;
  }
  HR_RETURN_IF_ERROR(report::write_trace_json(p, dir + "/trace.json"));
  HR_RETURN_IF_ERROR(report::write_memory_json(p, dir + "/memory.json"));
  return report::write_html_report(p, dir + "/report.html", lib.js);
}

int run_train(TrainFlags& f) {
  // Under mpirun (or srun) one process per rank, each training its share of the global batch
  // (docs/notes/zero.md); otherwise one process. Only rank 0 prints and writes.
  Result<std::unique_ptr<dist::Communicator>> world = dist::make_world_communicator();
  if (!world.is_ok()) return fail(world.status());
  dist::Communicator& comm = **world;
  const int rank = comm.rank();
  f.ranks = comm.size();
  if (f.threads == 0 && f.ranks > 1) {
    // Ranks on one machine share its cores (Open MPI / MPICH name the ranks per node).
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!local) local = std::getenv("MPI_LOCALNRANKS");
    const int per_node = local ? std::max(1, std::atoi(local)) : 1;
    set_threads(std::max(1, cpu::query_cpu_device().cores / per_node));
  } else {
    set_threads(f.threads);
  }
  if (rank != 0) f.json = true;  // quiet: no progress, no calibration lines
  train::TrainOptions o;
  o.comm = &comm;
  std::ofstream log;
  auto prepare = [&]() -> Status {
    // --sparsity-mask DIR: the pruned model is the model, unless --model says otherwise.
    if (!f.sparsity_mask.empty() && (!f.model_option || f.model_option->count() == 0) &&
        f.resume.empty()) {
      f.model = f.sparsity_mask;
    }
    HR_RETURN_IF_ERROR(resolve_train_options(f, &o));
    o.sparsity_mask = f.sparsity_mask;
    o.prune.at_step = f.prune_at;
    if (f.prune_at > 0) {
      HR_ASSIGN_OR_RETURN(o.prune.spec,
                          model::parse_mask_spec(f.prune_method, f.prune_method, f.prune_sparsity,
                                                 f.prune_per_layer, "--prune-method"));
    }
    o.out_dir = f.out;
    o.save_every = f.save_every;
    o.keep_checkpoints = f.keep_checkpoints;
    o.resume = f.resume;
    o.eval_at_start = true;  // the summary's "validation loss A -> B"
    if (f.save_every < 0 || f.keep_checkpoints < 0) {
      return Status::invalid_argument("--save-every and --keep-checkpoints must not be negative");
    }
    o.profile = !f.profile.empty() && rank == 0;
    if (o.profile) {
      // Fail before training, not after, when the report cannot be written.
      HR_RETURN_IF_ERROR(report::load_chart_lib().status());
    }
    if (!f.log_json.empty() && rank == 0) {
      log.open(f.log_json, std::ios::trunc);
      if (!log) return Status::io_error(fmt::format("cannot write --log-json '{}'", f.log_json));
    }
    return Status::ok();
  };
  // Rank 0 first (it may calibrate this machine, which the others then read), then the rest;
  // each time all ranks agree, so a bad flag stops every rank with rank 0's message.
  const Status own = rank == 0 ? prepare() : Status::ok();
  Status prepared = own;
  if (f.ranks > 1) {
    prepared = dist::agree(comm, own);
    if (!own.is_ok()) prepared = own;  // rank 0's flag error, without the "rank 0: " prefix
    if (prepared.is_ok()) {
      if (rank != 0) prepared = prepare();
      prepared = dist::agree(comm, prepared);
    }
  }
  if (!prepared.is_ok()) return rank == 0 ? fail(prepared) : 1;
  std::unique_ptr<data::Tokenizer> tok;
  {
    Result<std::unique_ptr<data::Tokenizer>> t = run_tokenizer(f.tokenizer, f.vocab);
    if (t.is_ok()) tok = std::move(t).value();
  }

  report::ProgressBar bar;
  train::TrainCallbacks cb;
  cb.on_setup = [&](const train::SetupInfo& info) {
    if (f.json) return;
    const std::string steps =
        o.minutes > 0
            ? fmt::format("{:g} minutes (steps fixed after step {})", o.minutes, o.warmup_steps)
            : fmt::format("{} steps", o.steps);
    std::fprintf(stderr,
                 "headroom train: %s, %.1fM parameters, micro-batch %d x seq %d, accumulation %d, "
                 "%s, lr %.2g\n",
                 o.model_name.c_str(), double(info.num_parameters) / 1e6, o.micro_batch, o.seq,
                 o.accumulation, steps.c_str(), double(o.adamw.lr));
    if (!o.init_from.empty() && o.resume.empty()) {
      std::fprintf(stderr, "weights: from %s (pass its config.json to start from --seed instead)\n",
                   o.init_from.c_str());
    }
    if (f.ranks > 1) {
      std::fprintf(stderr,
                   "ranks: %s\n  global batch %d = %d ranks x micro-batch %d x accumulation %d; "
                   "per-rank planned peak %s (the memory plan below is one rank's)\n",
                   train::describe_ranks(f.ranks, o.zero_stage).c_str(),
                   f.ranks * o.micro_batch * o.accumulation, f.ranks, o.micro_batch, o.accumulation,
                   format_bytes(info.planned_bytes).c_str());
    }
    std::fprintf(stderr, "plan: %s\n  %s, %s\n", o.plan_note.c_str(),
                 std::string(model::precision_name(o.exec.precision)).c_str(),
                 plan::describe_exec(o.exec).c_str());
    std::fprintf(stderr, "data: %s (%lld train / %lld validation tokens)\n", o.data.c_str(),
                 static_cast<long long>(info.train_tokens),
                 static_cast<long long>(info.val_tokens));
    std::fprintf(
        stderr, "device: %s, %d threads, budget %s%s\nmemory plan:\n%s",
        o.ops && !o.ops->host_addressable() ? std::string(o.ops->name()).c_str() : "cpu",
        omp_get_max_threads(), format_bytes(o.device_memory).c_str(),
        o.device_memory_file.empty()
            ? ""
            : fmt::format(" (from {}, read before every step)", o.device_memory_file).c_str(),
        info.memory_table.c_str());
    if (!info.offload_table.empty()) {
      std::string what;
      if (info.offload_optimizer) {
        what =
            "optimizer offload: AdamW runs on the offload tier; per step the gradients go there "
            "and the updated weights come back";
      }
      if (info.offloaded_blocks > 0) {
        what += fmt::format(
            "{}activation offload: {} blocks' saved activations wait there "
            "between their forward and backward",
            what.empty() ? "" : "; ", info.offloaded_blocks);
      }
      std::fprintf(stderr, "%s (offload tier: host memory, one budget %s)\n%s", what.c_str(),
                   format_bytes(info.offload_budget).c_str(), info.offload_table.c_str());
    }
    std::fprintf(stderr, "expected step time: %.0f ms (cost model; speeds %s)\n",
                 info.predicted_step_ms, info.device_source.c_str());
    if (!info.batching.empty()) std::fprintf(stderr, "batching: %s\n", info.batching.c_str());
  };
  cb.on_step = [&](const train::StepStats& s) {
    if (rank != 0) return;  // every rank's step is the same step
    if (log.is_open()) log << dump_json(step_json(s)) << "\n" << std::flush;
    // Re-plans, recoveries and their memory reports are logged in every mode (stderr).
    for (const std::string& e : s.events) {
      f.json ? (void)std::fprintf(stderr, "%s\n", e.c_str()) : bar.println(e);
    }
    for (const std::string& r : s.oom_reports) {
      f.json ? (void)std::fprintf(stderr, "%s", r.c_str()) : bar.println(r);
    }
    if (f.json) return;
    // Memory: in use / budget, then the step's measured peak against the plan's, and the
    // fragmentation: the peak over the most bytes live at one moment (1.00x: no byte wasted).
    std::string text = fmt::format(
        "loss {:.4f}  lr {:.2e}  {:.0f} tok/s  mem {} / {}  peak {} (plan {}, frag {:.2f}x)",
        s.loss, s.lr, s.tokens_per_s, format_bytes(s.device_bytes_in_use),
        format_bytes(s.device_budget), format_bytes(s.device_bytes_peak),
        format_bytes(s.planned_peak_bytes),
        s.lower_bound_bytes ? double(s.device_bytes_peak) / double(s.lower_bound_bytes) : 1.0);
    if (s.planned_offload_bytes) {
      text += fmt::format("  offload {} (plan {})", format_bytes(s.offload_bytes_peak),
                          format_bytes(s.planned_offload_bytes));
    }
    if (s.val_loss)
      bar.println(fmt::format("step {}: validation loss {:.4f}", s.step, *s.val_loss));
    if (!s.checkpoint.empty())
      bar.println(fmt::format("step {}: checkpoint {}", s.step, s.checkpoint));
    bar.update(s.step, s.steps, text);
  };
  std::string sample_text;
  cb.on_initial_validation = [&](double loss) {
    if (rank != 0 || f.json) return;
    bar.println(fmt::format("validation loss {:.4f} before the first step", loss));
  };
  cb.on_finish = [&](const model::Gpt2Config& cfg, const float* params,
                     memory::MemoryResource* device) -> Status {
    const int n_sample =
        f.sample_tokens >= 0 ? f.sample_tokens : model::preset_run_defaults(f.model).sample_tokens;
    if (!tok || n_sample <= 0 || rank != 0) return Status::ok();
    train::SampleOptions so;
    so.max_new_tokens = n_sample;
    so.temperature = 0.8f;
    so.top_k = 40;
    so.seed = f.seed;
    so.stop_token = tok->eos_token();
    // Within the positions the run trained (--seq): a longer sample slides that window.
    so.window = o.seq;
    HR_ASSIGN_OR_RETURN(
        std::vector<int32_t> ids,
        train::sample_tokens(cfg, params, {std::max(tok->eos_token(), 0)}, so, device));
    if (!ids.empty() && ids.back() == tok->eos_token()) ids.pop_back();
    sample_text = tok->decode(ids);
    return Status::ok();
  };
  Result<train::TrainResult> r = train::run_training(o, cb);
  bar.finish();
  if (!r.is_ok()) return rank == 0 ? fail(r.status()) : 1;  // every rank has the same status
  // Every rank's measured and planned peak, for rank 0's report (a sum of one-hot vectors).
  std::vector<double> peaks(size_t(2 * f.ranks), 0.0);
  peaks[size_t(2 * rank)] = double(r->device_bytes_peak);
  peaks[size_t(2 * rank + 1)] = double(r->planned_peak_bytes);
  if (Status s = comm.all_reduce(peaks.data(), int64_t(peaks.size())); !s.is_ok()) return fail(s);
  if (rank != 0) return 0;
  if (o.profile) {
    if (Status s = write_profile(f.profile, f, o, *r); !s.is_ok()) return fail(s);
    if (!f.json) {
      std::fprintf(stderr,
                   "profile: %s/trace.json (Perfetto, chrome://tracing), %s/report.html, "
                   "%s/memory.json\n",
                   f.profile.c_str(), f.profile.c_str(), f.profile.c_str());
    }
  }
  // The tokenizer travels with the model, so that generate (and any HF program) finds it (with
  // --json too).
  std::error_code dir_ec;
  if (f.tokenizer == data::kByteTokenizerName && !fs::is_directory(f.tokenizer, dir_ec)) {
    if (Status st = data::write_byte_tokenizer_config(o.out_dir); !st.is_ok()) {
      log_warn("{}", st.to_string());
    }
  } else if (!f.tokenizer.empty()) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                             "special_tokens_map.json", "encoder.json", "vocab.bpe"}) {
      std::error_code ec;
      const fs::path src = fs::path(f.tokenizer) / name;
      if (!fs::exists(src, ec) || fs::equivalent(f.tokenizer, o.out_dir, ec)) continue;
      fs::copy_file(src, fs::path(o.out_dir) / name, fs::copy_options::overwrite_existing, ec);
      if (ec) log_warn("could not copy {} into {}: {}", src.string(), o.out_dir, ec.message());
    }
  }
  if (f.json) {
    json j = {{"final_loss", r->final_loss},
              {"steps", r->steps_done},
              {"total_steps", r->total_steps},
              {"tokens_per_s", r->tokens_per_s},
              {"device_bytes_peak", r->device_bytes_peak},
              {"planned_peak_bytes", r->planned_peak_bytes},
              {"lower_bound_bytes", r->lower_bound_bytes},
              {"out", o.out_dir},
              {"sample", sample_text},
              {"ranks", f.ranks},
              {"zero", o.zero_stage},
              {"batching", data::batching_name(o.batching)},
              {"padding", r->padding},
              {"offload", offload_kind(o.offload_optimizer, plan::offloaded_blocks(o.exec) > 0)}};
    if (r->communicator_device_bytes > 0) {
      j["communicator_device_bytes"] = r->communicator_device_bytes;
    }
    if (r->planned_offload_bytes > 0) {
      j["offload_bytes_peak"] = r->offload_bytes_peak;
      j["planned_offload_bytes"] = r->planned_offload_bytes;
      j["offload_memory"] = o.offload_memory;
    }
    if (o.batching == data::Batching::kBucketed) {
      j["bucket"] = o.bucket;
      j["shape_plans"] = r->shape_plans;
      j["shape_plan_hits"] = r->shape_plan_hits;
    }
    if (f.ranks > 1) {
      json per_rank = json::array();
      for (int i = 0; i < f.ranks; i++) {
        per_rank.push_back({{"rank", i},
                            {"device_bytes_peak", uint64_t(peaks[size_t(2 * i)])},
                            {"planned_peak_bytes", uint64_t(peaks[size_t(2 * i + 1)])}});
      }
      j["per_rank"] = per_rank;
    }
    if (r->initial_val_loss) j["initial_val_loss"] = *r->initial_val_loss;
    if (r->final_val_loss) j["final_val_loss"] = *r->final_val_loss;
    // The sample may end inside a multi-byte character: U+FFFD for invalid UTF-8, never throw.
    std::printf("%s\n", dump_json(j, 2).c_str());
    return 0;
  }
  std::fprintf(stderr, "done: loss %.4f", r->final_loss);
  if (r->final_val_loss) {
    if (r->initial_val_loss) {
      std::fprintf(stderr, ", validation loss %.4f -> %.4f", *r->initial_val_loss,
                   *r->final_val_loss);
    } else {
      std::fprintf(stderr, ", validation loss %.4f", *r->final_val_loss);
    }
  }
  std::fprintf(stderr, ", median %.0f tokens/s", r->tokens_per_s);
  if (o.batching == data::Batching::kBucketed) {
    std::fprintf(stderr, " (real tokens; padding %.1f%%, %llu micro-batch shapes planned)",
                 100.0 * r->padding, static_cast<unsigned long long>(r->shape_plans));
  }
  std::fprintf(stderr, "\n");
  std::fprintf(
      stderr,
      "device memory: peak %s measured, %s planned, lower bound %s (fragmentation "
      "%.3fx), budget %s\n",
      format_bytes(r->device_bytes_peak).c_str(), format_bytes(r->planned_peak_bytes).c_str(),
      format_bytes(r->lower_bound_bytes).c_str(),
      r->lower_bound_bytes ? double(r->planned_peak_bytes) / double(r->lower_bound_bytes) : 1.0,
      format_bytes(o.device_memory).c_str());
  if (r->planned_offload_bytes > 0) {
    std::fprintf(stderr, "offload tier: peak %s measured, %s planned, budget %s\n",
                 format_bytes(r->offload_bytes_peak).c_str(),
                 format_bytes(r->planned_offload_bytes).c_str(),
                 format_bytes(o.offload_memory).c_str());
  }
  for (int i = 0; i < f.ranks && f.ranks > 1; i++) {
    std::fprintf(stderr, "  rank %d: peak %s measured, %s planned\n", i,
                 format_bytes(uint64_t(peaks[size_t(2 * i)])).c_str(),
                 format_bytes(uint64_t(peaks[size_t(2 * i + 1)])).c_str());
  }
  std::fprintf(stderr, "model saved to %s/ (config.json, model.safetensors%s)\n", o.out_dir.c_str(),
               f.tokenizer.empty() ? "" : ", the tokenizer");
  if (!sample_text.empty()) std::printf("sample:\n%s\n", sample_text.c_str());
  return 0;
}

}  // namespace headroom::cli
