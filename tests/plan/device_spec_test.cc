// Tests for the device table (plan/device_spec.h) and the CPU calibration and its cache file
// (plan/calibrate.h). Calibration runs with quick sizes: these tests check plumbing and sanity,
// never speed (STYLE.md: speed is measured in benchmarks).
#include "plan/device_spec.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/units.h"
#include "plan/calibrate.h"

namespace headroom::plan {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            (std::string("hr_plan_") + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

Calibration sample_calibration() {
  Calibration c;
  c.gemm_flops_fp32 = 123.456789e9;
  c.gemm_flops_bf16 = 0;
  c.gemm_peak_fp32 = 234.5e9;
  c.gemm_peak_bf16 = 0;
  c.mem_bandwidth = 1.0 / 3.0 * 1e11;
  c.copy_bandwidth = 9.87654321e9;
  c.threads = 2;
  c.cpu_model = "Test CPU \"quoted\" @ 2.00GHz";
  c.date = "2025-01-31";
  return c;
}

// The cost model's terms as save_calibration writes them (values of the right order).
nlohmann::json sample_terms_json() {
  Calibration c = sample_calibration();
  for (std::array<GemmTerm, 2>* g :
       {&c.terms.gemm_small, &c.terms.gemm_large, &c.terms.gemm_head_small, &c.terms.gemm_head})
    (*g)[0] = {5e10, 200};
  c.terms.attention[0] = {1e-5, 3e-11};
  for (KernelTerm* k : {&c.terms.norm, &c.terms.gelu, &c.terms.residual, &c.terms.loss,
                        &c.terms.embedding, &c.terms.optimizer[0], &c.terms.optimizer[1]})
    *k = {5e-6, 1e-9};
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("headroom-terms-" + std::to_string(::getpid()) + ".json"))
                               .string();
  HR_CHECK(save_calibration(c, path).is_ok());
  std::ifstream in(path);
  nlohmann::json j = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  return j["terms"];
}

nlohmann::json sample_json() {
  return {{"version", 5},
          {"gemm_flops_fp32", 1.5e11},
          {"gemm_flops_bf16", 0.0},
          {"gemm_peak_fp32", 2e11},
          {"gemm_peak_bf16", 0.0},
          {"mem_bandwidth", 2e10},
          {"copy_bandwidth", 1e10},
          {"threads", 2},
          {"cpu_model", "x"},
          {"date", "2025-01-31"},
          {"terms", sample_terms_json()}};
}

// Loads `j` from a file and expects Corrupt naming the file and `field`.
void expect_corrupt(const nlohmann::json& j, const std::string& field) {
  TempDir dir;
  std::string path = dir.file("calibration.json");
  write_file(path, j.dump());
  Result<Calibration> r = load_calibration(path);
  ASSERT_FALSE(r.is_ok()) << "field " << field;
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt) << r.status().to_string();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  EXPECT_NE(r.status().message().find("'" + field + "'"), std::string::npos)
      << r.status().to_string();
}

// ---- the datasheet table -------------------------------------------------------------------

TEST(NamedDevice, FindsEveryRequiredDevice) {
  for (const char* name : {"A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "RTX-4090", "T4"}) {
    Result<DeviceSpec> spec = named_device(name);
    ASSERT_TRUE(spec.is_ok()) << name << ": " << spec.status().to_string();
    EXPECT_EQ(spec->name, name);
    EXPECT_EQ(spec->kind, "gpu");
  }
}

TEST(NamedDevice, IsCaseInsensitive) {
  Result<DeviceSpec> spec = named_device("h100-80gb");
  ASSERT_TRUE(spec.is_ok()) << spec.status().to_string();
  EXPECT_EQ(spec->name, "H100-80GB");
  EXPECT_TRUE(named_device("rtx-4090").is_ok());
}

TEST(NamedDevice, UnknownNameListsTheKnownOnes) {
  Result<DeviceSpec> spec = named_device("V100");
  ASSERT_FALSE(spec.is_ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kNotFound);
  const std::string& msg = spec.status().message();
  EXPECT_NE(msg.find("'V100'"), std::string::npos) << msg;
  for (const std::string& name : named_device_names()) {
    EXPECT_NE(msg.find(name), std::string::npos) << name << " missing from: " << msg;
  }
  EXPECT_FALSE(named_device("").is_ok());
  EXPECT_FALSE(named_device("H100").is_ok());  // no silent guess between variants
}

TEST(NamedDevice, NamesAreUniqueIgnoringCase) {
  std::vector<std::string> names = named_device_names();
  ASSERT_GE(names.size(), 7u);
  for (size_t i = 0; i < names.size(); ++i) {
    for (size_t j = i + 1; j < names.size(); ++j) {
      std::string a = names[i], b = names[j];
      for (auto& ch : a) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      for (auto& ch : b) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      EXPECT_NE(a, b);
    }
  }
}

TEST(NamedDevice, TableIsSane) {
  for (const std::string& name : named_device_names()) {
    SCOPED_TRACE(name);
    DeviceSpec s = named_device(name).value();
    EXPECT_GT(s.flops_fp32, 1e12);
    EXPECT_LT(s.flops_fp32, 1e15);
    // Every GPU in the table has tensor cores: 16-bit math is at least as fast as fp32.
    EXPECT_GE(s.flops_fp16, s.flops_fp32);
    // bf16 is either supported through tensor cores (then >= fp32) or absent (0).
    EXPECT_TRUE(s.flops_bf16 == 0 || s.flops_bf16 >= s.flops_fp32) << s.flops_bf16;
    EXPECT_GT(s.mem_bandwidth, 1e11);  // > 100 GB/s
    EXPECT_LT(s.mem_bandwidth, 1e13);  // < 10 TB/s
    EXPECT_GT(s.host_link_bandwidth, 1e10);
    EXPECT_LT(s.host_link_bandwidth, s.mem_bandwidth);
    EXPECT_GE(s.gemm_efficiency, 0.6);
    EXPECT_LE(s.gemm_efficiency, 0.7);
    EXPECT_FALSE(s.source.empty());
  }
  EXPECT_EQ(named_device("T4")->flops_bf16, 0.0);  // Turing has no bf16
  EXPECT_GT(named_device("A100-40GB")->flops_bf16, 0.0);
  EXPECT_GT(named_device("H100-80GB")->flops_bf16, named_device("A100-80GB")->flops_bf16);
}

TEST(NamedDevice, MemoryMatchesTheLabel) {
  // What the driver reports may sit a little under the label (ECC, firmware), never above it.
  struct Label {
    const char* name;
    double gib;
  };
  for (Label l : {Label{"A100-40GB", 40}, Label{"A100-80GB", 80}, Label{"H100-80GB", 80},
                  Label{"H200", 141}, Label{"L4", 24}, Label{"RTX-4090", 24}, Label{"T4", 16}}) {
    SCOPED_TRACE(l.name);
    double gib = static_cast<double>(named_device(l.name)->memory_bytes) / kGiB;
    EXPECT_LE(gib, l.gib);
    EXPECT_GE(gib, 0.93 * l.gib);
  }
  EXPECT_LT(named_device("A100-40GB")->memory_bytes, named_device("A100-80GB")->memory_bytes);
}

// ---- the calibration file ------------------------------------------------------------------

TEST(CalibrationFile, RoundTrips) {
  TempDir dir;
  std::string path = dir.file("sub/dir/calibration.json");  // parents are created
  Calibration c = sample_calibration();
  ASSERT_TRUE(save_calibration(c, path).is_ok());
  Result<Calibration> r = load_calibration(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->gemm_flops_fp32, c.gemm_flops_fp32);  // JSON numbers round-trip exactly
  EXPECT_EQ(r->gemm_flops_bf16, c.gemm_flops_bf16);
  EXPECT_EQ(r->gemm_peak_fp32, c.gemm_peak_fp32);
  EXPECT_EQ(r->gemm_peak_bf16, c.gemm_peak_bf16);
  EXPECT_EQ(r->mem_bandwidth, c.mem_bandwidth);
  EXPECT_EQ(r->copy_bandwidth, c.copy_bandwidth);
  EXPECT_EQ(r->threads, c.threads);
  EXPECT_EQ(r->cpu_model, c.cpu_model);
  EXPECT_EQ(r->date, c.date);
  // No temporary file is left next to it.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path())) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1);
}

// A new calibration drops the corrections measured against the old one's predictions.
TEST(CalibrationFile, SavingDropsTheCorrectionsOfTheOldOne) {
  TempDir dir;
  const std::string path = dir.file("calibration.json");
  const std::string corrections = corrections_path(path);
  write_file(corrections, "{}");
  ASSERT_TRUE(fs::exists(corrections));
  ASSERT_TRUE(save_calibration(sample_calibration(), path).is_ok());
  EXPECT_FALSE(fs::exists(corrections));
  EXPECT_TRUE(load_calibration(path).is_ok());
}

TEST(CalibrationFile, MissingFileIsNotFound) {
  TempDir dir;
  Result<Calibration> r = load_calibration(dir.file("nope.json"));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("nope.json"), std::string::npos);
}

TEST(CalibrationFile, InvalidJsonIsCorruptNamingTheFile) {
  TempDir dir;
  std::string path = dir.file("calibration.json");
  write_file(path, "{\"version\": 1, \"gemm_flops_fp32\": ");
  Result<Calibration> r = load_calibration(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();

  write_file(path, "[1, 2, 3]");
  r = load_calibration(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorrupt);
}

TEST(CalibrationFile, MissingFieldsAreCorruptNamingTheField) {
  for (const char* field :
       {"version", "gemm_flops_fp32", "gemm_flops_bf16", "gemm_peak_fp32", "gemm_peak_bf16",
        "mem_bandwidth", "copy_bandwidth", "threads", "cpu_model", "date", "terms"}) {
    nlohmann::json j = sample_json();
    j.erase(field);
    expect_corrupt(j, field);
  }
}

TEST(CalibrationFile, BadValuesAreCorruptNamingTheField) {
  auto with = [](const char* field, nlohmann::json value) {
    nlohmann::json j = sample_json();
    j[field] = std::move(value);
    return j;
  };
  expect_corrupt(with("gemm_flops_fp32", "fast"), "gemm_flops_fp32");
  expect_corrupt(with("gemm_flops_fp32", 0.0), "gemm_flops_fp32");
  expect_corrupt(with("mem_bandwidth", -1.0), "mem_bandwidth");
  expect_corrupt(with("copy_bandwidth", nullptr), "copy_bandwidth");
  expect_corrupt(with("gemm_flops_bf16", -5.0), "gemm_flops_bf16");
  expect_corrupt(with("threads", 0), "threads");
  expect_corrupt(with("threads", 2.5), "threads");
  expect_corrupt(with("cpu_model", 7), "cpu_model");
  expect_corrupt(with("version", 99), "version");
  expect_corrupt(with("version", 1), "version");  // before the peaks: measured again
  expect_corrupt(with("version", 2), "version");  // before the cost terms: measured again
  expect_corrupt(with("version", 3), "version");  // attention per call, not per head: again
  expect_corrupt(with("version", 4), "version");  // one optimizer term for both precisions
  nlohmann::json bad_terms = sample_json();
  bad_terms["terms"]["norm"]["unit_seconds"] = -1.0;
  expect_corrupt(bad_terms, "terms.norm.unit_seconds");
  expect_corrupt(with("gemm_peak_fp32", 0.0), "gemm_peak_fp32");
  expect_corrupt(with("gemm_peak_bf16", "x"), "gemm_peak_bf16");
  // bf16 may be 0: "not measured / unsupported".
  TempDir dir;
  std::string path = dir.file("ok.json");
  write_file(path, sample_json().dump());
  EXPECT_TRUE(load_calibration(path).is_ok());
}

TEST(CalibrationFile, DefaultPathFollowsTheEnvironment) {
  auto restore = [](const char* name, const char* old) {
    if (old != nullptr) {
      setenv(name, old, 1);
    } else {
      unsetenv(name);
    }
  };
  std::string old_cache = getenv("HEADROOM_CACHE_DIR") ? getenv("HEADROOM_CACHE_DIR") : "";
  std::string old_xdg = getenv("XDG_CACHE_HOME") ? getenv("XDG_CACHE_HOME") : "";
  std::string old_home = getenv("HOME") ? getenv("HOME") : "";
  bool had_cache = getenv("HEADROOM_CACHE_DIR") != nullptr;
  bool had_xdg = getenv("XDG_CACHE_HOME") != nullptr;
  bool had_home = getenv("HOME") != nullptr;

  setenv("HEADROOM_CACHE_DIR", "/c", 1);
  setenv("XDG_CACHE_HOME", "/x", 1);
  setenv("HOME", "/h", 1);
  EXPECT_EQ(default_calibration_path(), "/c/calibration.json");
  setenv("HEADROOM_CACHE_DIR", "", 1);  // empty counts as unset
  EXPECT_EQ(default_calibration_path(), "/x/headroom/calibration.json");
  unsetenv("HEADROOM_CACHE_DIR");
  unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(default_calibration_path(), "/h/.cache/headroom/calibration.json");

  restore("HEADROOM_CACHE_DIR", had_cache ? old_cache.c_str() : nullptr);
  restore("XDG_CACHE_HOME", had_xdg ? old_xdg.c_str() : nullptr);
  restore("HOME", had_home ? old_home.c_str() : nullptr);
}

// ---- measuring -----------------------------------------------------------------------------

bool positive_finite(double x) { return std::isfinite(x) && x > 0; }

TEST(Calibrate, QuickRunGivesPositiveFiniteFigures) {
  std::vector<std::string> lines;
  Result<Calibration> r = run_calibration([&](const std::string& line) { lines.push_back(line); },
                                          CalibrationOptions{.quick = true});
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(positive_finite(r->gemm_flops_fp32)) << r->gemm_flops_fp32;
  EXPECT_TRUE(std::isfinite(r->gemm_flops_bf16) && r->gemm_flops_bf16 >= 0) << r->gemm_flops_bf16;
  EXPECT_TRUE(positive_finite(r->gemm_peak_fp32)) << r->gemm_peak_fp32;
  EXPECT_TRUE(std::isfinite(r->gemm_peak_bf16) && r->gemm_peak_bf16 >= 0) << r->gemm_peak_bf16;
  EXPECT_EQ(r->gemm_flops_bf16 > 0, r->gemm_peak_bf16 > 0);  // both measured, or neither
  EXPECT_TRUE(positive_finite(r->mem_bandwidth)) << r->mem_bandwidth;
  EXPECT_TRUE(positive_finite(r->copy_bandwidth)) << r->copy_bandwidth;
  EXPECT_EQ(r->threads, calibration_threads());
  EXPECT_GE(r->threads, 1);
  EXPECT_FALSE(r->cpu_model.empty());
  ASSERT_EQ(r->date.size(), 10u) << r->date;  // YYYY-MM-DD
  EXPECT_EQ(r->date[4], '-');
  EXPECT_EQ(r->date[7], '-');
  EXPECT_GE(lines.size(), 4u);  // a line per stage
  EXPECT_FALSE(describe_calibration(*r).empty());
}

// The probe bench times between steps is what calibrate's peak is the best of (the square GEMM
// and the step's per-layer shapes): named so, a
// positive rate on every call, and bf16 either measured or refused as unsupported (never 0).
TEST(Calibrate, PeakProbeTimesTheSquareGemmAgain) {
  Result<std::unique_ptr<GemmPeakProbe>> fp32 = GemmPeakProbe::create(false);
  ASSERT_TRUE(fp32.is_ok()) << fp32.status().to_string();
  EXPECT_EQ((*fp32)->describe(),
            "fp32 GEMM 2048^3 and the step's four per-layer GEMMs forward and backward");
  EXPECT_TRUE(positive_finite((*fp32)->measure(1, 1)));
  EXPECT_TRUE(positive_finite((*fp32)->measure(0, 1)));
  Result<std::unique_ptr<GemmPeakProbe>> bf16 = GemmPeakProbe::create(true);
  if (bf16.is_ok()) {
    EXPECT_EQ((*bf16)->describe(),
              "bf16 GEMM 2112^3 and the step's four per-layer GEMMs forward and backward");
    EXPECT_TRUE(positive_finite((*bf16)->measure(1, 1)));
  } else {
    EXPECT_EQ(bf16.status().code(), StatusCode::kUnsupported) << bf16.status().to_string();
  }
}

TEST(Calibrate, LoadOrCalibrateMeasuresOnceThenLoads) {
  TempDir dir;
  std::string path = dir.file("calibration.json");
  const CalibrationOptions quick{.quick = true};
  Result<Calibration> first = load_or_calibrate(path, {}, quick);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  ASSERT_TRUE(fs::exists(path));

  // A second call loads the file: prove it by planting a recognisable figure.
  Calibration planted = *first;
  planted.gemm_flops_fp32 = 4242e9;
  ASSERT_TRUE(save_calibration(planted, path).is_ok());
  Result<Calibration> second = load_or_calibrate(path, {}, quick);
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(second->gemm_flops_fp32, 4242e9);

  // Another thread count (or CPU) means a stale cache: measure again and overwrite it.
  planted.threads = first->threads + 7;
  ASSERT_TRUE(save_calibration(planted, path).is_ok());
  std::vector<std::string> lines;
  Result<Calibration> third = load_or_calibrate(
      path, [&](const std::string& l) { lines.push_back(l); }, quick);
  ASSERT_TRUE(third.is_ok());
  EXPECT_EQ(third->threads, calibration_threads());
  EXPECT_NE(third->gemm_flops_fp32, 4242e9);
  EXPECT_EQ(load_calibration(path)->threads, calibration_threads());
  ASSERT_FALSE(lines.empty());
  EXPECT_NE(lines.front().find("measuring again"), std::string::npos) << lines.front();

  // A corrupt cache is measured again too, not an error.
  write_file(path, "not json");
  Result<Calibration> fourth = load_or_calibrate(path, {}, quick);
  ASSERT_TRUE(fourth.is_ok()) << fourth.status().to_string();
  EXPECT_TRUE(load_calibration(path).is_ok());
}

TEST(Calibrate, CpuDeviceSpecCarriesTheMeasurement) {
  Calibration c = sample_calibration();
  DeviceSpec s = cpu_device_spec(c, 4 * kGiB);
  EXPECT_EQ(s.name, "cpu");
  EXPECT_EQ(s.kind, "cpu");
  EXPECT_EQ(s.memory_bytes, 4 * kGiB);
  EXPECT_EQ(s.flops_fp32, c.gemm_flops_fp32);
  EXPECT_EQ(s.flops_bf16, c.gemm_flops_bf16);
  EXPECT_EQ(s.peak_flops_fp32, c.gemm_peak_fp32);
  EXPECT_EQ(s.peak_flops_bf16, c.gemm_peak_bf16);
  EXPECT_EQ(s.flops_fp16, 0.0);
  EXPECT_EQ(s.mem_bandwidth, c.mem_bandwidth);
  EXPECT_EQ(s.host_link_bandwidth, c.copy_bandwidth);
  EXPECT_EQ(s.gemm_efficiency, 1.0);
  EXPECT_EQ(s.source, "measured 2025-01-31");
}

// A calibration far below the previous one on the same machine is reported figure by figure
// (the CLI warns with these lines); another machine or thread count is not compared.
TEST(CalibrationFile, DropsAgainstThePreviousAreNamed) {
  Calibration old = sample_calibration();
  old.gemm_flops_bf16 = 800e9;
  old.gemm_peak_bf16 = 1600e9;
  Calibration now = old;
  EXPECT_TRUE(calibration_drops(old, now, 0.6).empty());
  now.gemm_peak_bf16 = 344e9;  // 0.215x: reported
  now.mem_bandwidth *= 0.7;    // 0.7x: above the ratio, not reported
  now.gemm_flops_fp32 *= 0.5;  // reported
  std::vector<std::string> d = calibration_drops(old, now, 0.6);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], "fp32 GEMM rate 61.7 GFLOP/s, 0.50x the previous 123.5");
  EXPECT_EQ(d[1], "bf16 GEMM peak 344.0 GFLOP/s, 0.21x the previous 1600.0");
  // Faster is never a drop; a figure the old file lacked (bf16 unsupported: 0) is not compared.
  EXPECT_TRUE(calibration_drops(now, old, 0.6).empty());
  Calibration no_bf16 = old;
  no_bf16.gemm_flops_bf16 = no_bf16.gemm_peak_bf16 = 0;
  Calibration with_bf16 = no_bf16;
  with_bf16.gemm_peak_bf16 = 1e9;
  EXPECT_TRUE(calibration_drops(no_bf16, with_bf16, 0.6).empty());
  // Another machine or thread count: nothing to compare against.
  Calibration other = now;
  other.threads = 4;
  EXPECT_TRUE(calibration_drops(old, other, 0.6).empty());
  other = now;
  other.cpu_model = "Another CPU";
  EXPECT_TRUE(calibration_drops(old, other, 0.6).empty());
}

}  // namespace
}  // namespace headroom::plan
