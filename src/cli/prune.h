// `headroom prune`: magnitude, N:M or structured (MLP channels, attention heads / KV groups)
// pruning of a saved model into a new model directory, with parameters, planned memory and
// validation loss before and after (docs/notes/pruning.md).
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace headroom::cli {

struct PruneFlags {
  std::string model_dir;
  std::string out;
  std::string method;  // magnitude | n:m | N:M (e.g. 2:4) | structured
  double sparsity = 0.5;
  CLI::Option* sparsity_option = nullptr;  // to tell a given --sparsity from the default
  std::string nm = "2:4";
  bool per_layer = false;
  std::string what = "mlp";  // structured: mlp | heads | both
  CLI::Option* what_option = nullptr;
  std::string data;  // a token file, "default" (the default corpus), or empty: no validation
  int seq = 0;       // 0: min(128, n_positions)
  int batch = 8;
  int eval_batches = 4;
  double val_fraction = 0.05;
  int threads = 0;
  bool json = false;
};

// Adds the flags of `prune` to its subcommand.
void add_prune_flags(CLI::App* cmd, PruneFlags& f);

// Runs `prune`; returns the exit code. default_corpus(tokenizer_dir) gives the default corpus's
// token file for --data default (the tokenizer directory is the model's own, or "").
int run_prune(PruneFlags& f,
              const std::function<Result<std::string>(const std::string&)>& default_corpus);

}  // namespace headroom::cli
