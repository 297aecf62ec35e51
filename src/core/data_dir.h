// Where headroom finds its data files (GPT-2's vocabulary, the report's charting library, the
// model configs) without the source tree: an installed binary, an embedding program, a developer
// build. See docs/notes/install.md.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"

namespace headroom {

// The data files, each under a data directory in the installed layout (share/headroom/...).
enum class DataItem {
  kGpt2Vocab,  // gpt2/: encoder.json + vocab.bpe (or vocab.json + merges.txt)
  kChartLib,   // chartlib/chart.umd.min.js: Chart.js for report.html
  kConfigs,    // configs/: the shipped model configs (Llama 3.2 1B, ...)
};

// "the GPT-2 vocabulary", ...: for messages.
const char* data_item_name(DataItem item);

// How to get an item that is missing: "run scripts/get-gpt2-vocab", ...
const char* data_item_hint(DataItem item);

// One place an item may be, and why it is looked at.
struct DataCandidate {
  std::string path;    // the item's file or directory there
  std::string origin;  // "HEADROOM_DATA_DIR", "installed", "install prefix", "source tree"
};

// Where `item` is looked for, in order:
//   1. $HEADROOM_DATA_DIR (set and non-empty), in the installed layout;
//   2. <the running executable's directory>/../share/headroom (an installed binary, relocatable);
//   3. the install prefix configured at build time, <prefix>/share/headroom (an embedding program
//      linked against an installed engine, wherever its own executable lives);
//   4. the source tree the build came from (third_party/..., configs/): a developer's build.
//      HEADROOM_DATA_NO_SOURCE=1 leaves it out (the install test: the source tree must not be what
//      makes an installed binary work).
// Duplicates (the executable's prefix is the configured one) are listed once.
std::vector<DataCandidate> data_candidates(DataItem item);

// The first candidate that holds `item` (for a directory: its marker files). Errors: NotFound
// naming the item, every place looked at (with its origin) and how to get it.
Result<DataCandidate> find_data(DataItem item);

}  // namespace headroom
