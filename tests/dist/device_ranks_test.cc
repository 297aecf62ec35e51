// Several ranks and ZeRO 0-3 on a device the host cannot address (docs/notes/device-trainer.md),
// proven on the fenced device (docs/notes/fenced-device.md): the staging communicator against
// the host communicator it decorates, and the trainer on the fenced device against the same run
// on the CPU with the same ranks and stage, bit for bit (losses, gradient norms, validation, the
// final weights, every saved file) with the measured peak the planned one. Runs on 1 rank (the
// plain discovery: the local communicator behind the staging) and on 2 (dist_mpi_2ranks).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "../train/fenced_test_util.h"
#include "../train/train_test_util.h"
#include "backend/fenced/fenced_ops.h"
#include "core/check.h"
#include "dist/staging_communicator.h"
#include "test_env.h"
#include "train/trainer.h"

namespace headroom {
namespace {

namespace fs = std::filesystem;
using dist::test::world;
using train::test::RunOutput;

// ---- the staging communicator -------------------------------------------------------------

// Device buffers of a fenced resource, filled from and read back to host vectors by the ops.
class StagingCommunicatorTest : public ::testing::Test {
 protected:
  StagingCommunicatorTest() : ops_(&device_) { device_.fence(); }
  ~StagingCommunicatorTest() override {
    for (auto& [p, bytes] : blocks_) device_.deallocate(p, bytes);
  }

  template <typename T>
  T* on_device(const std::vector<T>& host) {
    const size_t bytes = std::max<size_t>(1, host.size()) * sizeof(T);
    Result<void*> p = device_.allocate(bytes);
    HR_CHECK(p.is_ok());
    blocks_.push_back({*p, bytes});
    ops_.copy_to_device(*p, host.data(), host.size() * sizeof(T));
    return static_cast<T*>(*p);
  }
  template <typename T>
  std::vector<T> to_host(const T* device, size_t n) const {
    std::vector<T> h(n);
    ops_.copy_to_host(h.data(), device, n * sizeof(T));
    return h;
  }

  // Values that differ per rank and per element, with fractions whose sums round.
  static std::vector<float> values(size_t n, int salt) {
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) {
      v[i] = float(world().rank() + 1) * 0.1f + float(i) / 7.0f + float(salt) * 1e-3f;
    }
    return v;
  }
  // Rank r holds 5 + 3 r floats (unequal), or 0 for the zero-count case.
  static std::vector<int64_t> counts(bool empty_last = false) {
    std::vector<int64_t> c(size_t(world().size()));
    for (int r = 0; r < world().size(); r++) c[size_t(r)] = 5 + 3 * r;
    if (empty_last) c.back() = 0;
    return c;
  }
  static int64_t total(const std::vector<int64_t>& c) {
    return std::accumulate(c.begin(), c.end(), int64_t(0));
  }
  static int64_t displ(const std::vector<int64_t>& c, int r) {
    return std::accumulate(c.begin(), c.begin() + r, int64_t(0));
  }

  backend::FencedResource device_;
  backend::FencedOps ops_;
  std::vector<std::pair<void*, size_t>> blocks_;
};

TEST_F(StagingCommunicatorTest, AllReducesEqualTheInnerCommunicatorsOnHostData) {
  dist::StagingCommunicator sc(&world(), &ops_);
  EXPECT_EQ(sc.rank(), world().rank());
  EXPECT_EQ(sc.size(), world().size());

  std::vector<float> f = values(37, 1), f_ref = f;
  float* df = on_device(f);
  std::vector<double> d(11), d_ref;
  for (size_t i = 0; i < d.size(); i++) d[i] = (world().rank() + 1) / 3.0 + double(i) * 1e-9;
  d_ref = d;
  double* dd = on_device(d);
  std::vector<int64_t> m = {int64_t(5 - world().rank()), int64_t(world().rank()), -7};
  std::vector<int64_t> m_ref = m;
  int64_t* dm = on_device(m);

  const Status s1 = sc.all_reduce(df, int64_t(f.size()));
  const Status s2 = world().all_reduce(f_ref.data(), int64_t(f_ref.size()));
  const Status s3 = sc.all_reduce(dd, int64_t(d.size()));
  const Status s4 = world().all_reduce(d_ref.data(), int64_t(d_ref.size()));
  const Status s5 = sc.all_reduce_min(dm, int64_t(m.size()));
  const Status s6 = world().all_reduce_min(m_ref.data(), int64_t(m_ref.size()));
  // Host data passes straight through (agree()'s values, the trainer's loss sums).
  std::vector<float> h = values(9, 2), h_ref = h;
  const int64_t before = sc.bytes_to_host();
  const Status s7 = sc.all_reduce(h.data(), int64_t(h.size()));
  const Status s8 = world().all_reduce(h_ref.data(), int64_t(h_ref.size()));
  for (const Status& s : {s1, s2, s3, s4, s5, s6, s7, s8}) EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(to_host(df, f.size()), f_ref);
  EXPECT_EQ(to_host(dd, d.size()), d_ref);
  EXPECT_EQ(to_host(dm, m.size()), m_ref);
  EXPECT_EQ(h, h_ref);
  EXPECT_EQ(sc.bytes_to_host(), before);
  if (world().size() == 1) {
    EXPECT_EQ(sc.bytes_to_host(), 0);  // one rank: nothing to copy
  } else {
    EXPECT_GT(sc.bytes_to_host(), 0);
  }
}

TEST_F(StagingCommunicatorTest, ReduceScatterWithUnequalCountsOnDeviceAndHostBuffers) {
  dist::StagingCommunicator sc(&world(), &ops_);
  for (bool empty_last : {false, true}) {
    SCOPED_TRACE(empty_last ? "the last rank's count 0" : "unequal counts");
    const std::vector<int64_t> c = counts(empty_last);
    const size_t n = size_t(total(c)), mine = size_t(c[size_t(world().rank())]);
    const std::vector<float> send = values(n, 3);
    std::vector<float> ref(std::max<size_t>(1, mine));
    const Status sr = world().reduce_scatter(send.data(), ref.data(), c);
    ref.resize(mine);
    // Device send and recv; host send into device recv; device send into host recv.
    const float* dsend = on_device(send);
    float* drecv = on_device(std::vector<float>(std::max<size_t>(1, mine), -1.0f));
    float* drecv2 = on_device(std::vector<float>(std::max<size_t>(1, mine), -1.0f));
    std::vector<float> hrecv(std::max<size_t>(1, mine), -1.0f);
    const Status s1 = sc.reduce_scatter(dsend, drecv, c);
    const Status s2 = sc.reduce_scatter(send.data(), drecv2, c);
    const Status s3 = sc.reduce_scatter(dsend, hrecv.data(), c);
    for (const Status& s : {sr, s1, s2, s3}) EXPECT_TRUE(s.is_ok()) << s.to_string();
    hrecv.resize(mine);
    EXPECT_EQ(to_host(drecv, mine), ref);
    EXPECT_EQ(to_host(drecv2, mine), ref);
    EXPECT_EQ(hrecv, ref);
  }
}

TEST_F(StagingCommunicatorTest, AllGatherInPlaceAndNotOnDeviceAndHostBuffers) {
  dist::StagingCommunicator sc(&world(), &ops_);
  for (bool empty_last : {false, true}) {
    SCOPED_TRACE(empty_last ? "the last rank's count 0" : "unequal counts");
    const std::vector<int64_t> c = counts(empty_last);
    const size_t n = size_t(total(c)), mine = size_t(c[size_t(world().rank())]);
    const size_t at = size_t(displ(c, world().rank()));
    const std::vector<float> shard = values(std::max<size_t>(1, mine), 4);
    std::vector<float> ref(n, -2.0f);
    const Status sr = world().all_gather(shard.data(), ref.data(), c);
    // In place on the device: this rank's segment already in recv.
    std::vector<float> init(n, -3.0f);
    std::copy(shard.begin(), shard.begin() + ptrdiff_t(mine), init.begin() + ptrdiff_t(at));
    float* in_place = on_device(init);
    const Status s1 = sc.all_gather(in_place + at, in_place, c);
    // Device shard into device recv; host shard into device recv; device shard into host recv.
    const float* dshard = on_device(shard);
    float* drecv = on_device(std::vector<float>(n, -1.0f));
    float* drecv2 = on_device(std::vector<float>(n, -1.0f));
    std::vector<float> hrecv(n, -1.0f);
    const Status s2 = sc.all_gather(dshard, drecv, c);
    const Status s3 = sc.all_gather(shard.data(), drecv2, c);
    const Status s4 = sc.all_gather(dshard, hrecv.data(), c);
    for (const Status& s : {sr, s1, s2, s3, s4}) EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(to_host(in_place, n), ref);
    EXPECT_EQ(to_host(drecv, n), ref);
    EXPECT_EQ(to_host(drecv2, n), ref);
    EXPECT_EQ(hrecv, ref);
  }
}

TEST_F(StagingCommunicatorTest, BroadcastAndAgreeOnDeviceAndHostData) {
  dist::StagingCommunicator sc(&world(), &ops_);
  const int root = world().size() - 1;
  const std::vector<float> mine = values(13, 5);
  std::vector<float> ref = mine;
  const Status sr = world().broadcast(ref.data(), int64_t(ref.size()), root);
  float* d = on_device(mine);
  const Status s1 = sc.broadcast(d, int64_t(mine.size()), root);
  // agree() passes host values through the staging communicator as they are.
  const Status agreed =
      dist::agree(sc, world().rank() == root ? Status::invalid_argument("bad flag") : Status::ok());
  EXPECT_TRUE(sr.is_ok() && s1.is_ok()) << sr.to_string() << s1.to_string();
  EXPECT_EQ(to_host(d, mine.size()), ref);
  EXPECT_EQ(agreed.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(agreed.message().find("rank " + std::to_string(root) + ": bad flag"), std::string::npos)
      << agreed.message();
}

TEST_F(StagingCommunicatorTest, StagingGrowsToTheLargestCollectiveOnce) {
  dist::StagingCommunicator sc(&world(), &ops_);
  const std::vector<int64_t> c = counts();
  const size_t n = size_t(total(c));
  const std::vector<float> shard = values(size_t(c[size_t(world().rank())]), 6);
  float* recv = on_device(std::vector<float>(n));
  const float* dshard = on_device(shard);
  float* part = on_device(std::vector<float>(shard.size()));
  EXPECT_TRUE(sc.all_gather(dshard, recv, c).is_ok());
  EXPECT_TRUE(sc.reduce_scatter(recv, part, c).is_ok());
  const size_t grown = sc.staging_bytes();
  EXPECT_GE(grown, (n + shard.size()) * sizeof(float));
  for (int i = 0; i < 3; i++) {
    EXPECT_TRUE(sc.all_gather(dshard, recv, c).is_ok());
    EXPECT_TRUE(sc.reduce_scatter(recv, part, c).is_ok());
  }
  EXPECT_EQ(sc.staging_bytes(), grown);  // no growth, no allocation per call
}

// ---- the trainer on the fenced device with several ranks ----------------------------------

using train::test::read_tree;

class DeviceRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = train::test::fresh_test_dir("headroom_device_ranks");
    data_ = (dir_ / "data.tok").string();
    train::test::write_random_tokens(data_, 31, 20000);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // world()'s ranks, ZeRO `stage`; 2 micro-batches per rank and step (the ZeRO-2/3 windows
  // accumulate into the shard), validation before the first step and after the last, a checkpoint
  // after step 2 (gathered through the device) and the final model.
  train::TrainOptions options(const std::string& out, int stage, model::Precision precision) {
    train::TrainOptions o;
    o.comm = &world();
    o.zero_stage = stage;
    o.config = train::test::tiny_config();
    o.model_name = "tiny";
    o.data = data_;
    o.seq = 16;
    o.micro_batch = 2;
    o.accumulation = 2;
    o.steps = 3;
    o.warmup_steps = 1;
    o.adamw.lr = 1e-3f;
    o.device_memory = uint64_t(1) << 30;
    o.eval_every = 0;  // the last step's validation
    o.eval_batches = 1;
    o.eval_at_start = true;
    o.save_every = 2;
    o.exec.precision = precision;
    // ZeRO-3 keeps no full bf16 copy: its GEMMs cast each gathered unit per use.
    o.exec.bf16_weight_copy = !(precision == model::Precision::kBf16 && stage == 3);
    o.out_dir = (dir_ / out).string();
    return o;
  }

  // `o` on this rank's own fenced device, fenced from before the first allocation.
  static RunOutput run_fenced(train::TrainOptions o,
                              std::function<bool(const train::StepStats&)> stop = nullptr) {
    return train::test::run_fenced(std::move(o), nullptr, std::move(stop));
  }

  static void expect_same(const RunOutput& a, const RunOutput& b) {
    train::test::expect_same_bits(a, b);
  }

  fs::path dir_;
  std::string data_;
};

TEST_F(DeviceRanks, ZeroStages0To3MatchTheCpuBitForBit) {
  for (model::Precision precision : {model::Precision::kFp32, model::Precision::kBf16}) {
    for (int stage = 0; stage <= 3; stage++) {
      const std::string tag =
          std::string(model::precision_name(precision)) + "-zero" + std::to_string(stage);
      SCOPED_TRACE(tag);
      // Every rank runs both (the same collectives in the same order), then checks.
      const RunOutput cpu = train::test::run_collecting(options("cpu-" + tag, stage, precision));
      const RunOutput dev = run_fenced(options("fenced-" + tag, stage, precision));
      ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
      ASSERT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
      ASSERT_EQ(dev.steps.size(), 3u);
      expect_same(dev, cpu);
      EXPECT_TRUE(dev.result->initial_val_loss.has_value());
      EXPECT_EQ(dev.result->initial_val_loss, cpu.result->initial_val_loss);
      EXPECT_EQ(dev.result->final_val_loss, cpu.result->final_val_loss);
      // The plan is the allocation on every rank's device: measured peak = planned peak (the
      // host staging is outside the device budget, as the loader's host mirror is).
      EXPECT_EQ(dev.result->device_bytes_peak, dev.result->planned_peak_bytes);
      EXPECT_EQ(dev.result->planned_peak_bytes, cpu.result->planned_peak_bytes);
      for (const train::StepStats& s : dev.steps)
        EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
      // Rank 0 wrote the checkpoints (steps 2 and 3) and the model: the CPU run's bytes.
      const std::map<std::string, std::string> cpu_files = read_tree(dir_ / ("cpu-" + tag));
      const std::map<std::string, std::string> dev_files = read_tree(dir_ / ("fenced-" + tag));
      if (world().rank() == 0) {
        EXPECT_TRUE(cpu_files.count("model.safetensors"));
        EXPECT_TRUE(cpu_files.count("checkpoints/step-000002/optimizer.safetensors"));
      }
      train::test::expect_same_files(cpu_files, dev_files);
    }
  }
}

// A run cut after step 2 (its checkpoint gathered through the device) and resumed on the device
// equals the CPU's uninterrupted run, for the stages whose resume reads host copies and scatters
// them to the device's shards.
TEST_F(DeviceRanks, ResumeOnTheDeviceEqualsTheUninterruptedCpuRun) {
  for (int stage : {1, 3}) {  // stage 2 resumes as stage 1 does (full parameters)
    SCOPED_TRACE(::testing::Message() << "ZeRO-" << stage);
    const std::string tag = "zero" + std::to_string(stage);
    const RunOutput straight =
        train::test::run_collecting(options("straight-" + tag, stage, model::Precision::kFp32));
    train::TrainOptions a = options("cut-" + tag, stage, model::Precision::kFp32);
    const RunOutput first = run_fenced(a, [](const train::StepStats& s) { return s.step == 2; });
    train::TrainOptions b = a;
    b.eval_at_start = false;
    // Every rank reads rank 0's checkpoint (a shared file system), as under mpirun on one host.
    b.resume = a.out_dir;
    int64_t ok = first.result.is_ok() ? 1 : 0;
    ASSERT_TRUE(world().all_reduce_min(&ok, 1).is_ok());
    ASSERT_TRUE(ok) << (first.result.is_ok() ? "another rank failed"
                                             : first.result.status().to_string());
    // Rank 0's directory holds the checkpoint; the other ranks read it there.
    std::vector<char> path(4096, 0);
    if (world().rank() == 0) std::snprintf(path.data(), path.size(), "%s", a.out_dir.c_str());
    ASSERT_TRUE(world().broadcast(path.data(), int64_t(path.size()), 0).is_ok());
    b.resume = path.data();
    const RunOutput second = run_fenced(b);
    ASSERT_TRUE(straight.result.is_ok()) << straight.result.status().to_string();
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    EXPECT_TRUE(first.result->stopped);
    ASSERT_EQ(first.steps.size(), 2u);
    ASSERT_EQ(second.steps.size(), 1u);
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, straight);
    for (const train::StepStats& s : second.steps)
      EXPECT_EQ(s.device_bytes_peak, s.planned_peak_bytes) << "step " << s.step;
  }
}

// Optimizer offload under ZeRO 1-3 on the device: each rank's shard of the master weights, m and
// v lives in its host offload tier; the gradients' shard is copied out, the updated shard copied
// back in and all-gathered on the device (stages 1-2) or kept as the device's shard (stage 3);
// checkpoints gather the tier's shards. A run cut after step 2 and resumed on the device equals
// the CPU's uninterrupted one.
TEST_F(DeviceRanks, OptimizerOffloadUnderZeroMatchesTheCpu) {
  for (int stage = 1; stage <= 3; stage++) {
    SCOPED_TRACE(::testing::Message() << "ZeRO-" << stage << " with optimizer offload");
    const std::string tag = "offload-zero" + std::to_string(stage);
    train::TrainOptions o = options("cpu-" + tag, stage, model::Precision::kFp32);
    o.offload_optimizer = true;
    o.optimizer_upload_chunk = 4096;  // the update copied back in pieces, as it is computed
    const RunOutput cpu = train::test::run_collecting(o);
    train::TrainOptions f = o;
    f.out_dir = (dir_ / ("fenced-" + tag)).string();
    const RunOutput dev = run_fenced(f);
    ASSERT_TRUE(cpu.result.is_ok()) << cpu.result.status().to_string();
    ASSERT_TRUE(dev.result.is_ok()) << dev.result.status().to_string();
    expect_same(dev, cpu);
    EXPECT_EQ(dev.result->device_bytes_peak, dev.result->planned_peak_bytes);
    const std::map<std::string, std::string> cpu_files = read_tree(dir_ / ("cpu-" + tag));
    const std::map<std::string, std::string> dev_files = read_tree(dir_ / ("fenced-" + tag));
    train::test::expect_same_files(cpu_files, dev_files);
    // Cut after step 2 on the device, resumed on the device from rank 0's checkpoint.
    train::TrainOptions a = f;
    a.out_dir = (dir_ / ("cut-" + tag)).string();
    const RunOutput first = run_fenced(a, [](const train::StepStats& s) { return s.step == 2; });
    int64_t ok = first.result.is_ok() ? 1 : 0;
    ASSERT_TRUE(world().all_reduce_min(&ok, 1).is_ok());
    ASSERT_TRUE(ok) << (first.result.is_ok() ? "another rank failed"
                                             : first.result.status().to_string());
    std::vector<char> path(4096, 0);
    if (world().rank() == 0) std::snprintf(path.data(), path.size(), "%s", a.out_dir.c_str());
    ASSERT_TRUE(world().broadcast(path.data(), int64_t(path.size()), 0).is_ok());
    train::TrainOptions b = a;
    b.eval_at_start = false;
    b.resume = path.data();
    const RunOutput second = run_fenced(b);
    ASSERT_TRUE(second.result.is_ok()) << second.result.status().to_string();
    RunOutput joined = second;
    joined.steps.insert(joined.steps.begin(), first.steps.begin(), first.steps.end());
    expect_same(joined, cpu);
  }
}

}  // namespace
}  // namespace headroom
