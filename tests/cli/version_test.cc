// `headroom --version` and `version --json` say whether CUDA was built in and, when it was, the
// toolkit, the architectures, NCCL, and whether a device is usable here or why not.
#include <gtest/gtest.h>

#include <string>

#include "cli/common.h"
#ifdef HEADROOM_HAVE_CUDA
#include "backend/cuda/build_info.h"
#endif

namespace headroom::cli {
namespace {

TEST(Version, SaysWhetherCudaIsBuiltInAndUsable) {
  const json j = version_json();
  const std::string text = version_text();
  ASSERT_TRUE(j["cuda"].is_boolean());
#ifdef HEADROOM_HAVE_CUDA
  const backend::cuda::CudaBuildInfo b = backend::cuda::build_info();
  EXPECT_TRUE(j["cuda"].get<bool>());
  const json& c = j["cuda_details"];
  ASSERT_TRUE(c.is_object()) << c.dump();
  EXPECT_EQ(c["toolkit_version"], b.toolkit_version);
  EXPECT_EQ(c["archs"], b.archs);
  EXPECT_NE(b.archs, "unknown");  // CMake passed the architectures
  EXPECT_EQ(c["nccl_version"], b.nccl_version);
  EXPECT_EQ(c["device_usable"], b.device_usable);
  EXPECT_NE(text.find("CUDA: yes: toolkit " + b.toolkit_version), std::string::npos) << text;
  EXPECT_NE(text.find("NCCL " + b.nccl_version), std::string::npos) << text;
  if (b.device_usable) {
    EXPECT_TRUE(c["why_not"].is_null());
    EXPECT_NE(text.find("device usable here: " + b.device_name), std::string::npos) << text;
  } else {
    ASSERT_TRUE(c["why_not"].is_string());
    EXPECT_FALSE(b.why_not.empty());
    EXPECT_NE(text.find("no device usable here: " + b.why_not), std::string::npos) << text;
  }
#else
  EXPECT_FALSE(j["cuda"].get<bool>());
  EXPECT_TRUE(j["cuda_details"].is_null());
  EXPECT_NE(text.find("CUDA: no (a CPU-only build"), std::string::npos) << text;
#endif
}

}  // namespace
}  // namespace headroom::cli
