// Tests for the safetensors reader and writer: a round trip, and for every kind of corruption the
// reader must catch, a file written byte by byte that has exactly that defect.
#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace headroom::model {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) /
           ("hr_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes an 8-byte little-endian length, `header` and `data` to `name`; returns the path.
  std::string write_raw(const std::string& name, const std::string& header,
                        const std::string& data = "", uint64_t header_length = UINT64_MAX) {
    if (header_length == UINT64_MAX) header_length = header.size();
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; i++) bytes[i] = char((header_length >> (8 * i)) & 0xff);
    bytes += header;
    bytes += data;
    return write_bytes(name, bytes);
  }

  std::string write_bytes(const std::string& name, const std::string& bytes) {
    std::string p = path(name);
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    EXPECT_TRUE(f.good());
    return p;
  }

  // Opens `p`, expects `code`, and that the message names each of `parts`.
  void expect_error(const std::string& p, StatusCode code, std::vector<std::string> parts) {
    Result<SafetensorsFile> r = SafetensorsFile::open(p);
    ASSERT_FALSE(r.is_ok()) << p << " opened but should not have";
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    parts.push_back(p);  // every error names the file
    for (const std::string& part : parts) {
      EXPECT_NE(r.status().message().find(part), std::string::npos)
          << "message does not mention '" << part << "': " << r.status().to_string();
    }
  }
  void expect_corrupt(const std::string& p, std::vector<std::string> parts) {
    expect_error(p, StatusCode::kCorrupt, std::move(parts));
  }

  size_t files_in_dir() const {
    return size_t(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()));
  }

  fs::path dir_;
};

std::string eight_bytes() { return std::string(8, '\x01'); }

TEST_F(SafetensorsTest, RoundTripKeepsDtypesShapesDataAndMetadata) {
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7f80, 0x0001, 0xffff};  // odd count: 10 bytes
  std::vector<int32_t> scalar = {-7};
  std::vector<int64_t> i64 = {INT64_MIN, INT64_MAX};
  std::vector<uint16_t> f16 = {0x3c00, 0x7bff, 0x8001};
  std::vector<SafetensorsTensor> in = {
      {"weights.f32", DType::kF32, Shape{2, 3}, f32.data(), f32.size() * 4},
      {"b.bf16", DType::kBF16, Shape{5}, bf16.data(), bf16.size() * 2},
      {"scalar", DType::kI32, Shape{}, scalar.data(), 4},
      {"empty", DType::kF32, Shape{0, 4}, nullptr, 0},
      {"i64", DType::kI64, Shape{1, 2}, i64.data(), 16},
      {"half", DType::kF16, Shape{3, 1}, f16.data(), 6},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "ünïcode \"quoted\""}};
  const std::string p = path("round.safetensors");
  ASSERT_TRUE(write_safetensors(p, in, meta).is_ok());
  EXPECT_EQ(files_in_dir(), 1u) << "the temporary file must be gone after the rename";

  Result<SafetensorsFile> r = SafetensorsFile::open(p);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const SafetensorsFile& file = *r;
  EXPECT_EQ(file.metadata(), meta);
  ASSERT_EQ(file.tensors().size(), in.size());
  for (size_t i = 1; i < file.tensors().size(); i++) {
    EXPECT_LT(file.tensors()[i - 1].name, file.tensors()[i].name) << "tensors() is sorted";
  }
  for (const SafetensorsTensor& t : in) {
    const SafetensorsTensor* got = file.find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    EXPECT_EQ(got->dtype, t.dtype) << t.name;
    EXPECT_EQ(got->shape, t.shape) << t.name;
    EXPECT_EQ(got->bytes, t.bytes) << t.name;
    if (t.bytes) {
      EXPECT_EQ(std::memcmp(got->data, t.data, t.bytes), 0) << t.name;
    }
  }
  EXPECT_EQ(file.find("scalar")->shape.rank(), 0u);
  EXPECT_EQ(file.find("scalar")->shape.numel(), 1);
  EXPECT_EQ(file.find("nope"), nullptr);
  EXPECT_EQ(file.find(""), nullptr);

  // Laid out in the order given, contiguously, from an 8-byte-aligned data section.
  const auto* first = static_cast<const char*>(file.find("weights.f32")->data);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 8, 0u);
  const char* expect = first;
  for (const SafetensorsTensor& t : in) {
    EXPECT_EQ(static_cast<const char*>(file.find(t.name)->data), expect) << t.name;
    expect += t.bytes;
  }
  // The last tensor ends the file, and what precedes the data (length + header) is a multiple of 8.
  const size_t data_bytes = size_t(expect - first);
  EXPECT_EQ((file.file_bytes() - data_bytes) % 8, 0u);
  EXPECT_EQ(file.file_bytes(), fs::file_size(p));
}

TEST_F(SafetensorsTest, HeaderIsPaddedWithSpacesToEightBytes) {
  std::vector<float> x = {1.0f};
  for (int name_len = 1; name_len <= 9; name_len++) {
    SafetensorsTensor t{std::string(size_t(name_len), 'a'), DType::kF32, Shape{1}, x.data(), 4};
    const std::string p = path("pad.safetensors");
    ASSERT_TRUE(write_safetensors(p, std::span(&t, 1)).is_ok());
    std::ifstream f(p, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | uint8_t(bytes[size_t(i)]);
    EXPECT_EQ(n % 8, 0u);
    EXPECT_EQ(bytes.size(), 8 + n + 4);
    const std::string header = bytes.substr(8, n);
    EXPECT_EQ(header.front(), '{');
    EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
    ASSERT_TRUE(SafetensorsFile::open(p).is_ok());
  }
}

TEST_F(SafetensorsTest, MoveKeepsTheMappingAlive) {
  std::vector<int32_t> v = {1, 2, 3};
  SafetensorsTensor t{"v", DType::kI32, Shape{3}, v.data(), 12};
  const std::string p = path("move.safetensors");
  ASSERT_TRUE(write_safetensors(p, std::span(&t, 1), {{"k", "v"}}).is_ok());
  Result<SafetensorsFile> r = SafetensorsFile::open(p);
  ASSERT_TRUE(r.is_ok());
  SafetensorsFile a = std::move(r).value();
  SafetensorsFile b = std::move(a);
  EXPECT_TRUE(a.tensors().empty());  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.find("v"), nullptr);
  Result<SafetensorsFile> r2 = SafetensorsFile::open(p);
  ASSERT_TRUE(r2.is_ok());
  b = std::move(r2).value();  // unmaps b's old mapping
  ASSERT_NE(b.find("v"), nullptr);
  EXPECT_EQ(static_cast<const int32_t*>(b.find("v")->data)[2], 3);
  EXPECT_EQ(b.metadata().at("k"), "v");
}

TEST_F(SafetensorsTest, WriteReplacesAnExistingFile) {
  std::vector<float> one = {1.0f}, two = {2.0f, 3.0f};
  const std::string p = path("replace.safetensors");
  SafetensorsTensor a{"x", DType::kF32, Shape{1}, one.data(), 4};
  SafetensorsTensor b{"x", DType::kF32, Shape{2}, two.data(), 8};
  ASSERT_TRUE(write_safetensors(p, std::span(&a, 1)).is_ok());
  ASSERT_TRUE(write_safetensors(p, std::span(&b, 1)).is_ok());
  Result<SafetensorsFile> r = SafetensorsFile::open(p);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->find("x")->shape, (Shape{2}));
  EXPECT_EQ(files_in_dir(), 1u);
}

TEST_F(SafetensorsTest, WriteRejectsBadTensorsAndLeavesNothingBehind) {
  std::vector<float> x = {1.0f, 2.0f};
  const std::string p = path("bad.safetensors");
  auto write = [&](std::vector<SafetensorsTensor> ts) { return write_safetensors(p, ts); };
  EXPECT_EQ(
      write({{"a", DType::kF32, Shape{2}, x.data(), 8}, {"a", DType::kF32, Shape{2}, x.data(), 8}})
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"a", DType::kF32, Shape{3}, x.data(), 8}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"a", DType::kF32, Shape{-2}, x.data(), 8}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"__metadata__", DType::kF32, Shape{2}, x.data(), 8}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"", DType::kF32, Shape{2}, x.data(), 8}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"a", DType::kF32, Shape{2}, nullptr, 8}}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"\xff\xfe", DType::kF32, Shape{2}, x.data(), 8}}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(files_in_dir(), 0u);

  // A directory that does not exist: IoError, and no temporary file anywhere.
  SafetensorsTensor t{"a", DType::kF32, Shape{2}, x.data(), 8};
  Status s = write_safetensors(path("no/such/dir/x.safetensors"), std::span(&t, 1));
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_EQ(files_in_dir(), 0u);
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  expect_error(path("missing.safetensors"), StatusCode::kNotFound, {});
}

TEST_F(SafetensorsTest, DirectoryIsAnIoError) {
  fs::create_directories(path("d"));
  expect_error(path("d"), StatusCode::kIoError, {});
}

TEST_F(SafetensorsTest, ShorterThanEightBytes) {
  expect_corrupt(write_bytes("empty.safetensors", ""), {"0 bytes"});
  expect_corrupt(write_bytes("short.safetensors", std::string("\x05\0\0\0\0", 5)), {"5 bytes"});
}

TEST_F(SafetensorsTest, HeaderLengthBeyondTheFile) {
  expect_corrupt(write_raw("beyond.safetensors", "{}", "", 1000), {"1000", "truncated"});
}

TEST_F(SafetensorsTest, HeaderLengthAbsurd) {
  expect_corrupt(write_raw("absurd.safetensors", "{}", "", 200'000'000), {"200000000", "absurd"});
  expect_corrupt(write_raw("absurd2.safetensors", "{}", "", UINT64_MAX - 1), {"absurd"});
}

TEST_F(SafetensorsTest, HeaderNotJson) {
  expect_corrupt(write_raw("json.safetensors", "{\"a\": {\"dtype\": "), {"not valid JSON"});
  expect_corrupt(write_raw("json2.safetensors", "{} trailing"), {"not valid JSON"});
  expect_corrupt(write_raw("json3.safetensors", "[1, 2]"), {"array", "expected an object"});
  expect_corrupt(write_raw("json4.safetensors", ""), {"not valid JSON"});
}

TEST_F(SafetensorsTest, EntryNotAnObject) {
  expect_corrupt(write_raw("entry.safetensors", R"({"w": [1, 2]})"), {"'w'", "expected an object"});
  expect_corrupt(write_raw("entry2.safetensors", R"({"w": {"dtype": "F32", "shape": [2]}})"),
                 {"'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, MetadataNotStrings) {
  expect_corrupt(write_raw("meta.safetensors", R"({"__metadata__": {"n": 3}})"),
                 {"__metadata__", "'n'"});
  expect_corrupt(write_raw("meta2.safetensors", R"({"__metadata__": "x"})"), {"__metadata__"});
}

TEST_F(SafetensorsTest, UnknownDtype) {
  expect_corrupt(
      write_raw("dtype.safetensors",
                R"({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}})", eight_bytes()),
      {"'w'", "unknown dtype 'F33'"});
  // F64 is valid safetensors that headroom does not compute in: Unsupported, not Corrupt.
  expect_error(
      write_raw("f64.safetensors",
                R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", eight_bytes()),
      StatusCode::kUnsupported, {"'w'", "F64"});
}

TEST_F(SafetensorsTest, NegativeOrHugeOrFractionalDims) {
  expect_corrupt(
      write_raw("neg.safetensors",
                R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", eight_bytes()),
      {"'w'", "negative"});
  expect_corrupt(
      write_raw(
          "huge.safetensors",
          R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})",
          eight_bytes()),
      {"'w'", "too large"});
  expect_corrupt(
      write_raw(
          "huge2.safetensors",
          R"({"w": {"dtype": "F32", "shape": [18446744073709551615], "data_offsets": [0, 8]}})",
          eight_bytes()),
      {"'w'", "too large"});
  // numel fits in uint64 but numel * 4 bytes does not.
  expect_corrupt(
      write_raw(
          "huge3.safetensors",
          R"({"w": {"dtype": "F32", "shape": [4611686018427387905], "data_offsets": [0, 8]}})",
          eight_bytes()),
      {"'w'", "too large"});
  expect_corrupt(write_raw("frac.safetensors",
                           R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})",
                           eight_bytes()),
                 {"'w'", "non-integer"});
}

TEST_F(SafetensorsTest, SizeDoesNotMatchShape) {
  expect_corrupt(
      write_raw("size.safetensors",
                R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", eight_bytes()),
      {"'w'", "needs 12 bytes", "span 8"});
}

TEST_F(SafetensorsTest, OffsetsBeyondTheDataSection) {
  expect_corrupt(
      write_raw("off.safetensors",
                R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", eight_bytes()),
      {"'w'", "beyond the data section"});
  expect_corrupt(
      write_raw("off2.safetensors",
                R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", eight_bytes()),
      {"'w'", "begin after end"});
  expect_corrupt(
      write_raw("off3.safetensors",
                R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", eight_bytes()),
      {"'w'", "data_offsets"});
}

TEST_F(SafetensorsTest, OverlappingRanges) {
  expect_corrupt(write_raw("overlap.safetensors",
                           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                           std::string(12, '\0')),
                 {"'a'", "'b'", "overlap"});
  // Identical ranges overlap too.
  expect_corrupt(write_raw("same.safetensors",
                           R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})",
                           eight_bytes()),
                 {"overlap"});
}

TEST_F(SafetensorsTest, GapsAndTrailingBytes) {
  expect_corrupt(write_raw("gap.safetensors",
                           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
                           std::string(12, '\0')),
                 {"'b'", "gap"});
  expect_corrupt(
      write_raw("trail.safetensors",
                R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", eight_bytes()),
      {"8 bytes", "cover only 4"});
}

TEST_F(SafetensorsTest, DuplicateNames) {
  expect_corrupt(write_raw("dup.safetensors",
                           R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                               "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                           eight_bytes()),
                 {"'a'", "twice"});
}

TEST_F(SafetensorsTest, TruncatedFile) {
  std::vector<float> x(64, 1.0f);
  SafetensorsTensor t{"x", DType::kF32, Shape{8, 8}, x.data(), x.size() * 4};
  const std::string p = path("full.safetensors");
  ASSERT_TRUE(write_safetensors(p, std::span(&t, 1)).is_ok());
  const uintmax_t full = fs::file_size(p);

  fs::resize_file(p, full - 3);  // loses the end of the data
  expect_corrupt(p, {"'x'", "beyond the data section", "truncated"});
  fs::resize_file(p, 20);  // loses the end of the header
  expect_corrupt(p, {"extends beyond the end of the file"});
}

TEST_F(SafetensorsTest, EmptyHeaderIsAnEmptyFile) {
  Result<SafetensorsFile> r = SafetensorsFile::open(write_raw("none.safetensors", "{}"));
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_TRUE(r->tensors().empty());
  EXPECT_TRUE(r->metadata().empty());
}

}  // namespace
}  // namespace headroom::model
