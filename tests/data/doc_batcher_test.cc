// The bucketed document batcher (issue #5): every token of every document is trained on exactly
// once per epoch, rows never mix documents, padding stays below one bucket per row, the order is
// a function of the seed, and any position resumes exactly.
#include "data/doc_batcher.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>

#include "data/token_file.h"

namespace headroom::data {
namespace {

constexpr int32_t kVocab = 500;
constexpr int32_t kEot = kVocab - 1;

// Documents of lengths 1..90 tokens (some longer than T = 64 below), each ended by an eot.
std::string corpus(int docs, uint32_t seed, std::vector<int32_t>* tokens_out = nullptr) {
  const std::string path =
      (std::filesystem::path(testing::TempDir()) /
       ("docs_" + std::to_string(getpid()) + "_" + std::to_string(seed) + ".tok"))
          .string();
  std::mt19937 rng(seed);
  std::vector<int32_t> toks;
  for (int d = 0; d < docs; d++) {
    const int len = 1 + int(rng() % 90);
    for (int i = 0; i < len; i++) toks.push_back(int32_t(rng() % uint32_t(kEot)));
    toks.push_back(kEot);
  }
  EXPECT_TRUE(write_token_file(path, toks, kVocab, kEot, uint64_t(docs)).is_ok());
  if (tokens_out) *tokens_out = toks;
  return path;
}

TEST(DocumentPieces, EveryTokenIsTheTargetOfExactlyOnePieceOfOneDocument) {
  std::vector<int32_t> toks;
  const std::string path = corpus(200, 1, &toks);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok());
  const int T = 32;
  // A range that starts and ends inside the file (as the train part of a split does).
  const TokenRange range{0, f->size()};
  std::vector<int> covered(size_t(f->size()), 0);
  for (const Piece& p : document_pieces(*f, range, T)) {
    ASSERT_GE(p.length, 1);
    ASSERT_LE(p.length, T);
    for (int64_t i = p.begin; i < p.begin + p.length; i++) {
      covered[size_t(i)]++;
      // Only a piece's last token may be an eot: no piece crosses a document boundary.
      if (i + 1 < p.begin + p.length) {
        EXPECT_NE(toks[size_t(i)], kEot) << "piece at " << p.begin;
      }
    }
    EXPECT_EQ(p.first, p.begin == 0 || toks[size_t(p.begin - 1)] == kEot);
  }
  for (size_t i = 0; i < covered.size(); i++) ASSERT_EQ(covered[i], 1) << "token " << i;
  std::filesystem::remove(path);
}

struct Served {
  int rows, length;
  std::vector<int32_t> in, tg;
};

Served serve(DocumentBatcher* b) {
  Served s;
  std::vector<int32_t> in(size_t(b->step_tokens())), tg(size_t(b->step_tokens()));
  const DocumentBatcher::Shape sh = b->next(in.data(), tg.data());
  s.rows = sh.rows;
  s.length = sh.length;
  in.resize(size_t(sh.rows) * size_t(sh.length));
  tg.resize(in.size());
  s.in = std::move(in);
  s.tg = std::move(tg);
  return s;
}

TEST(DocumentBatcher, AnEpochTrainsOnEveryTokenOnceWithoutMixingDocuments) {
  std::vector<int32_t> toks;
  const std::string path = corpus(300, 2, &toks);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok());
  const int T = 64, bucket = 16;
  const int64_t budget = 8 * T;
  const TokenRange range{0, f->size()};
  Result<DocumentBatcher> b = DocumentBatcher::create(*f, range, T, bucket, budget, 7);
  ASSERT_TRUE(b.is_ok()) << b.status().to_string();
  // Each piece's start, for finding which piece a row holds.
  std::map<int64_t, Piece> by_target;  // first target token's index -> piece
  for (const Piece& p : b->pieces()) by_target[p.begin] = p;
  std::vector<int> seen(size_t(f->size()), 0);
  int64_t pad = 0, slots = 0;
  for (int64_t n = 0; n < b->batches_per_epoch(); n++) {
    const Served s = serve(&*b);
    ASSERT_LE(int64_t(s.rows) * s.length, budget);
    ASSERT_EQ(s.length % bucket == 0 || s.length == T, true) << s.length;
    for (int r = 0; r < s.rows; r++) {
      const int32_t* in = s.in.data() + size_t(r) * size_t(s.length);
      const int32_t* tg = s.tg.data() + size_t(r) * size_t(s.length);
      int real = 0;
      while (real < s.length && tg[real] >= 0) real++;
      for (int t = real; t < s.length; t++) ASSERT_EQ(tg[t], -1) << "padding only at the end";
      ASSERT_GT(real, 0);
      ASSERT_LT(s.length - real, bucket) << "a row padded by a whole bucket or more";
      ASSERT_EQ(s.length, b->bucket_length(real)) << "a row in the wrong bucket";
      pad += s.length - real;
      slots += s.length;
      // Find the piece: the targets are tokens [begin, begin + real) of the file.
      bool found = false;
      for (auto it = by_target.begin(); it != by_target.end() && !found; ++it) {
        const Piece& p = it->second;
        if (p.length != real || seen[size_t(p.begin)]) continue;
        if (!std::equal(tg, tg + real, toks.begin() + p.begin)) continue;
        // Inputs are the targets shifted right; a document starts after an eot. (Part of the
        // match: one-token pieces, such as the eot of a document of T + 1 tokens, look alike.)
        if (in[0] != (p.first ? kEot : toks[size_t(p.begin - 1)])) continue;
        found = true;
        for (int t = 0; t < real; t++) seen[size_t(p.begin + t)]++;
        for (int t = 1; t < real; t++) ASSERT_EQ(in[t], tg[t - 1]);
        for (int t = real; t < s.length; t++) ASSERT_EQ(in[t], kEot);
      }
      ASSERT_TRUE(found) << "a row that is not one piece of one document";
    }
  }
  for (size_t i = 0; i < seen.size(); i++) ASSERT_EQ(seen[i], 1) << "token " << i;
  // Padding: what the batcher reports, and below one bucket per row.
  EXPECT_NEAR(b->padding_fraction(), double(pad) / double(slots), 1e-12);
  EXPECT_LT(pad, int64_t(bucket) * int64_t(b->pieces().size()));
  std::filesystem::remove(path);
}

TEST(DocumentBatcher, TheOrderIsAFunctionOfTheSeedAndEveryPositionResumesExactly) {
  const std::string path = corpus(150, 3);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok());
  const TokenRange range{0, f->size()};
  auto make = [&](uint64_t seed) {
    Result<DocumentBatcher> b = DocumentBatcher::create(*f, range, 32, 8, 4 * 32, seed);
    EXPECT_TRUE(b.is_ok());
    return std::move(b).value();
  };
  DocumentBatcher a = make(11), again = make(11), other = make(12);
  const int64_t n = 2 * a.batches_per_epoch() + 3;  // across two epoch boundaries
  std::vector<Served> stream;
  bool differs = false;
  for (int64_t i = 0; i < n; i++) {
    stream.push_back(serve(&a));
    const Served s = serve(&again);
    ASSERT_EQ(s.tg, stream.back().tg) << "batch " << i;
    ASSERT_EQ(s.in, stream.back().in) << "batch " << i;
    const Served o = serve(&other);
    differs |= o.tg != stream.back().tg;
  }
  EXPECT_TRUE(differs) << "another seed gave the same order";
  // Epochs differ from each other (reshuffled), but serve the same multiset of rows.
  bool epochs_differ = false;
  for (int64_t i = 0; i < a.batches_per_epoch(); i++)
    epochs_differ |= stream[size_t(i)].tg != stream[size_t(i + a.batches_per_epoch())].tg;
  EXPECT_TRUE(epochs_differ);
  // Resume at every position: a fresh batcher set there serves what the original served next.
  for (int64_t pos = 0; pos < n; pos++) {
    DocumentBatcher r = make(11);
    ASSERT_TRUE(r.valid_position(pos));
    r.set_position(pos);
    const Served s = serve(&r);
    ASSERT_EQ(s.rows, stream[size_t(pos)].rows);
    ASSERT_EQ(s.tg, stream[size_t(pos)].tg) << "resumed at " << pos;
    ASSERT_EQ(r.position(), pos + 1);
  }
  EXPECT_FALSE(a.valid_position(-1));
  std::filesystem::remove(path);
}

TEST(DocumentBatcher, ShapesCoverEveryBatchServed) {
  const std::string path = corpus(120, 4);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok());
  Result<DocumentBatcher> b = DocumentBatcher::create(*f, {0, f->size()}, 64, 32, 3 * 64, 5);
  ASSERT_TRUE(b.is_ok());
  const auto shapes = b->batch_shapes();
  for (int64_t i = 0; i < b->batches_per_epoch(); i++) {
    const Served s = serve(&*b);
    EXPECT_NE(std::find(shapes.begin(), shapes.end(), std::make_pair(s.rows, s.length)),
              shapes.end())
        << s.rows << " x " << s.length;
  }
  std::filesystem::remove(path);
}

TEST(DocumentBatcher, BadArgumentsNameTheFlag) {
  const std::string path = corpus(10, 5);
  Result<TokenFile> f = TokenFile::open(path);
  ASSERT_TRUE(f.is_ok());
  const TokenRange all{0, f->size()};
  Result<DocumentBatcher> bucket = DocumentBatcher::create(*f, all, 32, 0, 128, 1);
  ASSERT_FALSE(bucket.is_ok());
  EXPECT_NE(bucket.status().message().find("--bucket 0"), std::string::npos);
  EXPECT_FALSE(DocumentBatcher::create(*f, all, 32, 8, 16, 1).is_ok());  // budget < T
  EXPECT_FALSE(DocumentBatcher::create(*f, {5, 5}, 32, 8, 128, 1).is_ok());
  Result<Batching> mode = parse_batching("sorted");
  ASSERT_FALSE(mode.is_ok());
  EXPECT_NE(mode.status().message().find("--batching 'sorted'"), std::string::npos);
  EXPECT_EQ(*parse_batching("bucketed"), Batching::kBucketed);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace headroom::data
