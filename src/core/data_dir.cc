// The data-file resolver: environment, installed layout, configured prefix, source tree.
#include "core/data_dir.h"

#include <cstdlib>
#include <filesystem>
#include <initializer_list>

// Where the installed data lies relative to the installed executable (CMake: from BINDIR to
// DATADIR/headroom).
#ifndef HEADROOM_BIN_TO_DATA
#define HEADROOM_BIN_TO_DATA "../share/headroom"
#endif

namespace headroom {

namespace {

namespace fs = std::filesystem;

// The item's path under a data directory (the installed layout).
const char* installed_path(DataItem item) {
  switch (item) {
    case DataItem::kGpt2Vocab:
      return "gpt2";
    case DataItem::kChartLib:
      return "chartlib/chart.umd.min.js";
    case DataItem::kConfigs:
      return "configs";
  }
  return "";
}

// The item's path in the source tree, where scripts/setup puts it.
const char* source_path(DataItem item) {
  switch (item) {
    case DataItem::kGpt2Vocab:
      return "third_party/gpt2";
    case DataItem::kChartLib:
      return "third_party/chartlib/node_modules/chart.js/dist/chart.umd.min.js";
    case DataItem::kConfigs:
      return "configs";
  }
  return "";
}

bool holds(DataItem item, const fs::path& p) {
  std::error_code ec;
  auto has = [&](std::initializer_list<const char*> files) {
    for (const char* f : files) {
      if (!fs::is_regular_file(p / f, ec)) return false;
    }
    return true;
  };
  switch (item) {
    case DataItem::kGpt2Vocab:
      return has({"encoder.json", "vocab.bpe"}) || has({"vocab.json", "merges.txt"});
    case DataItem::kChartLib:
      return fs::is_regular_file(p, ec);
    case DataItem::kConfigs:
      return fs::is_directory(p, ec);
  }
  return false;
}

// The running executable's directory, or "" where /proc is not there.
fs::path executable_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : exe.parent_path();
}

}  // namespace

const char* data_item_name(DataItem item) {
  switch (item) {
    case DataItem::kGpt2Vocab:
      return "the GPT-2 vocabulary";
    case DataItem::kChartLib:
      return "the charting library for report.html (Chart.js)";
    case DataItem::kConfigs:
      return "the model configs";
  }
  return "";
}

const char* data_item_hint(DataItem item) {
  switch (item) {
    case DataItem::kGpt2Vocab:
      return "run scripts/get-gpt2-vocab (or `make setup`) in the source tree and reinstall, or "
             "point HEADROOM_DATA_DIR at a directory with gpt2/encoder.json and gpt2/vocab.bpe";
    case DataItem::kChartLib:
      return "run scripts/get-chart-lib (or `make setup`) in the source tree and reinstall, or "
             "point HEADROOM_DATA_DIR at a directory with chartlib/chart.umd.min.js";
    case DataItem::kConfigs:
      return "reinstall headroom, or point HEADROOM_DATA_DIR at a directory with configs/";
  }
  return "";
}

std::vector<DataCandidate> data_candidates(DataItem item) {
  std::vector<DataCandidate> out;
  auto add = [&](const fs::path& root, const char* rel, const char* origin) {
    const std::string path = (root / rel).lexically_normal().string();
    for (const DataCandidate& c : out) {
      if (c.path == path) return;
    }
    out.push_back({path, origin});
  };
  if (const char* d = std::getenv("HEADROOM_DATA_DIR"); d && *d) {
    add(d, installed_path(item), "HEADROOM_DATA_DIR");
  }
  if (const fs::path exe = executable_dir(); !exe.empty()) {
    add(exe / HEADROOM_BIN_TO_DATA, installed_path(item), "installed");
  }
#ifdef HEADROOM_INSTALL_DATA_DIR
  add(HEADROOM_INSTALL_DATA_DIR, installed_path(item), "install prefix");
#endif
#ifdef HEADROOM_SOURCE_DIR
  const char* no_source = std::getenv("HEADROOM_DATA_NO_SOURCE");
  if (!(no_source && std::string(no_source) == "1")) {
    add(HEADROOM_SOURCE_DIR, source_path(item), "source tree");
  }
#endif
  return out;
}

Result<DataCandidate> find_data(DataItem item) {
  const std::vector<DataCandidate> candidates = data_candidates(item);
  std::string looked;
  for (const DataCandidate& c : candidates) {
    if (holds(item, c.path)) return c;
    looked += "\n  " + c.path + " (" + c.origin + ")";
  }
  if (looked.empty()) looked = "\n  (nowhere: HEADROOM_DATA_DIR is unset)";
  return Status::not_found(std::string(data_item_name(item)) + " not found; looked in:" + looked +
                           "\n" + data_item_hint(item));
}

}  // namespace headroom
