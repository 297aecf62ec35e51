// Token file: write/read round trips and every way a file can be damaged.
#include "data/token_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <numeric>

#include "test_util.h"

namespace headroom::data {
namespace {

using testing_util::list_dir;
using testing_util::read_file;
using testing_util::TempDir;
using testing_util::write_file;

std::vector<int32_t> iota_tokens(int n, int32_t vocab) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7919) % vocab;
  return t;
}

TEST(TokenFile, RoundTripTwoByteTokens) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  std::vector<int32_t> tokens = iota_tokens(1000, 50257);
  tokens.back() = 50256;
  ASSERT_TRUE(write_token_file(path, tokens, 50257, 50256, 3).is_ok());
  EXPECT_EQ(std::filesystem::file_size(path), 64u + 2 * 1000);
  EXPECT_EQ(list_dir(dir.path()), std::vector<std::string>{"t.bin"});  // no temp file left

  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->size(), 1000);
  EXPECT_EQ(f->vocab_size(), 50257);
  EXPECT_EQ(f->eot(), 50256);
  EXPECT_EQ(f->document_count(), 3u);
  EXPECT_EQ(f->token_bytes(), 2);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(f->at(i), tokens[i]);
  std::vector<int32_t> out(500);
  f->copy(250, 500, out.data());
  EXPECT_TRUE(std::equal(out.begin(), out.end(), tokens.begin() + 250));
}

TEST(TokenFile, HeaderLayoutIsLittleEndianAndZeroPadded) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  std::vector<int32_t> tokens{0x1234, 5};
  ASSERT_TRUE(write_token_file(path, tokens, 50257, 50256, 1).is_ok());
  const std::string b = read_file(path);
  ASSERT_EQ(b.size(), 68u);
  EXPECT_EQ(b.substr(0, 8), "HRTOKENS");
  EXPECT_EQ(b[8], 1);   // version
  EXPECT_EQ(b[12], 2);  // token_bytes
  EXPECT_EQ(b[16], 2);  // token_count
  EXPECT_EQ(static_cast<unsigned char>(b[24]), 50257 & 0xFF);
  EXPECT_EQ(static_cast<unsigned char>(b[28]), 50256 & 0xFF);
  EXPECT_EQ(b[32], 1);  // document_count
  for (int i = 40; i < 64; ++i) EXPECT_EQ(b[i], 0) << i;
  EXPECT_EQ(static_cast<unsigned char>(b[64]), 0x34);
  EXPECT_EQ(static_cast<unsigned char>(b[65]), 0x12);
}

TEST(TokenFile, RoundTripFourByteTokensForLargeVocabularies) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  std::vector<int32_t> tokens = iota_tokens(300, 100000);
  tokens[7] = 99999;
  ASSERT_TRUE(write_token_file(path, tokens, 100000, 1, 1).is_ok());
  EXPECT_EQ(std::filesystem::file_size(path), 64u + 4 * 300);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->token_bytes(), 4);
  std::vector<int32_t> out(300);
  f->copy(0, 300, out.data());
  EXPECT_EQ(out, tokens);
  EXPECT_EQ(f->at(7), 99999);
}

TEST(TokenFile, EmptyTokenListIsValid) {
  TempDir dir;
  ASSERT_TRUE(write_token_file(dir.file("e.bin"), {}, 50257, 50256, 0).is_ok());
  Result<TokenFile> f = TokenFile::open(dir.file("e.bin"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->size(), 0);
}

TEST(TokenFile, MoveTransfersTheMapping) {
  TempDir dir;
  std::vector<int32_t> tokens = iota_tokens(10, 100);
  ASSERT_TRUE(write_token_file(dir.file("t.bin"), tokens, 100, 99, 1).is_ok());
  Result<TokenFile> f = TokenFile::open(dir.file("t.bin"));
  ASSERT_TRUE(f.is_ok());
  TokenFile a = std::move(*f);
  TokenFile b = std::move(a);
  EXPECT_EQ(a.size(), 0);  // NOLINT: checking the moved-from state on purpose
  EXPECT_EQ(b.size(), 10);
  EXPECT_EQ(b.at(9), tokens[9]);
  a = std::move(b);
  EXPECT_EQ(a.at(3), tokens[3]);
}

TEST(TokenFile, WriterRejectsOutOfRangeTokensAndLeavesNothing) {
  TempDir dir;
  std::vector<int32_t> tokens{1, 2, 300, 4};
  Status s = write_token_file(dir.file("t.bin"), tokens, 256, 255, 1);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token 2 is 300"), std::string::npos) << s.message();
  EXPECT_TRUE(list_dir(dir.path()).empty());
  std::vector<int32_t> negative{-1};
  EXPECT_FALSE(write_token_file(dir.file("t.bin"), negative, 256, 255, 1).is_ok());
  EXPECT_FALSE(write_token_file(dir.file("t.bin"), tokens, 256, 256, 1).is_ok());  // eot
  EXPECT_FALSE(write_token_file(dir.file("t.bin"), tokens, 0, 0, 1).is_ok());
  EXPECT_TRUE(list_dir(dir.path()).empty());
}

TEST(TokenFile, WriterFailsCleanlyInMissingDirectory) {
  TempDir dir;
  Status s = write_token_file(dir.file("no/such/dir/t.bin"), iota_tokens(4, 10), 10, 9, 1);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("no/such/dir/t.bin"), std::string::npos);
  EXPECT_TRUE(list_dir(dir.path()).empty());
}

TEST(TokenFile, WriterReplacesAnExistingFileAtomically) {
  TempDir dir;
  const std::string path = dir.file("t.bin");
  ASSERT_TRUE(write_token_file(path, iota_tokens(100, 1000), 1000, 999, 1).is_ok());
  Result<TokenFile> old = TokenFile::open(path);  // a reader keeps its mapping
  ASSERT_TRUE(old.is_ok());
  ASSERT_TRUE(write_token_file(path, iota_tokens(5, 1000), 1000, 999, 1).is_ok());
  EXPECT_EQ(old->size(), 100);
  EXPECT_EQ(old->at(99), iota_tokens(100, 1000)[99]);
  Result<TokenFile> fresh = TokenFile::open(path);
  ASSERT_TRUE(fresh.is_ok());
  EXPECT_EQ(fresh->size(), 5);
}

// Writes a valid file of `n` tokens and returns its bytes for a test to damage.
std::string valid_bytes(const TempDir& dir, int n) {
  const std::string path = dir.file("valid.bin");
  EXPECT_TRUE(write_token_file(path, iota_tokens(n, 50257), 50257, 50256, 1).is_ok());
  std::string b = read_file(path);
  std::filesystem::remove(path);
  return b;
}

Status open_bytes(const TempDir& dir, const std::string& bytes) {
  write_file(dir.file("bad.bin"), bytes);
  return TokenFile::open(dir.file("bad.bin")).status();
}

TEST(TokenFile, TruncatedFileNamesExpectedAndActualSizes) {
  TempDir dir;
  std::string b = valid_bytes(dir, 100);
  b.resize(b.size() - 3);
  Status s = open_bytes(dir, b);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("truncated"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("expected 264 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("actual 261 bytes"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("bad.bin"), std::string::npos);
}

TEST(TokenFile, TrailingBytesAreCorrupt) {
  TempDir dir;
  Status s = open_bytes(dir, valid_bytes(dir, 10) + "xx");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("actual 86 bytes"), std::string::npos) << s.message();
}

TEST(TokenFile, ShorterThanHeader) {
  TempDir dir;
  Status s = open_bytes(dir, "HRTOK");
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("5 bytes"), std::string::npos) << s.message();
}

TEST(TokenFile, BadMagic) {
  TempDir dir;
  std::string b = valid_bytes(dir, 10);
  b[0] = 'X';
  Status s = open_bytes(dir, b);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("magic 'XRTOKENS'"), std::string::npos) << s.message();
}

TEST(TokenFile, UnknownVersion) {
  TempDir dir;
  std::string b = valid_bytes(dir, 10);
  b[8] = 2;
  Status s = open_bytes(dir, b);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_NE(s.message().find("version 2"), std::string::npos) << s.message();
}

TEST(TokenFile, BadTokenBytesVocabAndEot) {
  TempDir dir;
  std::string b = valid_bytes(dir, 10);
  std::string bad = b;
  bad[12] = 3;
  EXPECT_NE(open_bytes(dir, bad).message().find("token_bytes is 3"), std::string::npos);
  bad = b;
  bad[26] = 2;  // vocab_size 50257 + 2^17 does not fit two-byte tokens
  EXPECT_NE(open_bytes(dir, bad).message().find("vocab_size"), std::string::npos);
  bad = b;
  bad[29] = static_cast<char>(0xFF);  // eot far above vocab_size
  EXPECT_NE(open_bytes(dir, bad).message().find("eot_token"), std::string::npos);
  bad = b;
  bad[50] = 1;
  EXPECT_NE(open_bytes(dir, bad).message().find("offset 50"), std::string::npos);
}

TEST(TokenFile, OutOfRangeTokenNamesIndexAndValue) {
  TempDir dir;
  std::string b = valid_bytes(dir, 10);
  b[64 + 2 * 4] = static_cast<char>(0xFF);  // token 4 = 0xFFFF = 65535 >= 50257
  b[64 + 2 * 4 + 1] = static_cast<char>(0xFF);
  Status s = open_bytes(dir, b);
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("token 4 (byte offset 72) is 65535"), std::string::npos)
      << s.message();
}

TEST(TokenFile, MissingFile) {
  TempDir dir;
  Result<TokenFile> f = TokenFile::open(dir.file("nope.bin"));
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("headroom prepare"), std::string::npos);
}

}  // namespace
}  // namespace headroom::data
