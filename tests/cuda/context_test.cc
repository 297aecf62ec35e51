// The CUDA table's creation: it exists exactly when a device is usable, and says why not.
#include <string>

#include "cuda_test_util.h"

namespace headroom {
namespace {

TEST(CudaContext, TableExistsExactlyWhenADeviceIsUsable) {
  std::string why;
  const bool available = backend::cuda::device_available(&why);
  std::string why2;
  const backend::Ops* ops = backend::cuda::cuda_ops(&why2);
  EXPECT_EQ(available, ops != nullptr);
  if (!available) {
    EXPECT_FALSE(why.empty());
    EXPECT_EQ(why, why2);
    GTEST_SKIP() << "no CUDA device: " << why;
  }
  EXPECT_EQ(ops->name(), "cuda");
  ops->synchronize();
}

}  // namespace
}  // namespace headroom
