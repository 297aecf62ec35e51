// The calibration file stays valid JSON whatever bytes the CPU's model name holds (it comes from
// /proc/cpuinfo), and loads back with it as core/utf8.h's valid_utf8 (docs/notes/json-text.md).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "../json_text_cases.h"
#include "core/utf8.h"
#include "plan/calibrate.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;

TEST(JsonText, CalibrationFileParsesWithArbitraryBytesInTheCpuModel) {
  const fs::path dir =
      fs::path(testing::TempDir()) / ("headroom_json_text_cal_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "calibration.json").string();
  for (const std::string& s : test::json_text_cases(50)) {
    plan::Calibration c;
    c.gemm_flops_fp32 = c.gemm_peak_fp32 = 1e11;
    c.mem_bandwidth = c.copy_bandwidth = 1e10;
    c.threads = 2;
    c.cpu_model = s;
    c.date = s;
    ASSERT_TRUE(plan::save_calibration(c, path).is_ok()) << testing::PrintToString(s);
    std::ifstream in(path, std::ios::binary);
    std::ostringstream text;
    text << in.rdbuf();
    ASSERT_NO_THROW((void)nlohmann::json::parse(text.str())) << testing::PrintToString(s);
    Result<plan::Calibration> back = plan::load_calibration(path);
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    EXPECT_EQ(back->cpu_model, valid_utf8(s));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace headroom
