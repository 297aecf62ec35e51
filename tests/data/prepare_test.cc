// `prepare`: documents and eot tokens, directory walking, fortune separators, and clean failures
// (nothing written) for empty, binary and missing inputs and unwritable outputs.
#include "data/prepare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <thread>
#include <tuple>

#include "data/hf_tokenizer.h"
#include "data/token_file.h"
#include "test_util.h"

namespace headroom::data {
namespace {

using testing_util::list_dir;
using testing_util::TempDir;
using testing_util::write_file;

std::vector<int32_t> all_tokens(const TokenFile& f) {
  std::vector<int32_t> v(f.size());
  f.copy(0, f.size(), v.data());
  return v;
}

// Expected tokens: each document encoded, followed by eot.
std::vector<int32_t> packed(const Gpt2Tokenizer& tok, const std::vector<std::string>& docs) {
  std::vector<int32_t> v;
  for (const std::string& d : docs) {
    std::vector<int32_t> ids = tok.encode(d);
    v.insert(v.end(), ids.begin(), ids.end());
    v.push_back(tok.eot_token());
  }
  return v;
}

PrepareOptions options(const TempDir& out_dir, std::vector<std::string> inputs) {
  PrepareOptions o;
  o.inputs = std::move(inputs);
  o.out = out_dir.file("out.bin");
  o.vocab_dir = testing_util::vocab_dir();
  return o;
}

TEST(Prepare, OneFileIsOneDocument) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  const std::string text = "Hello there.\nGeneral Kenobi!\n";
  write_file(in.file("a.txt"), text);
  Result<PrepareStats> s = prepare_token_file(options(out, {in.file("a.txt")}));
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->files, 1u);
  EXPECT_EQ(s->documents, 1u);
  EXPECT_EQ(s->bytes, text.size());
  Result<TokenFile> f = TokenFile::open(out.file("out.bin"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(all_tokens(*f), packed(tok, {text}));
  EXPECT_EQ(s->tokens, static_cast<uint64_t>(f->size()));
  EXPECT_EQ(f->document_count(), 1u);
  EXPECT_EQ(f->vocab_size(), 50257);
  EXPECT_EQ(f->eot(), 50256);
}

TEST(Prepare, FortuneSeparatorSplitsDocuments) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  write_file(in.file("fortunes"),
             "A fortune.\n%\nTwo\nlines.\n%\n%\n   \n%\r\nLast, with CRLF.\r\n%\n");
  PrepareOptions o = options(out, {in.file("fortunes")});
  o.doc_separator = "%";
  Result<PrepareStats> s = prepare_token_file(o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->documents, 3u);  // the empty and whitespace-only ones are dropped
  Result<TokenFile> f = TokenFile::open(o.out);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(all_tokens(*f), packed(tok, {"A fortune.\n", "Two\nlines.\n", "Last, with CRLF.\r\n"}));
  EXPECT_EQ(f->document_count(), 3u);
}

TEST(Prepare, DirectoriesAreWalkedInSortedOrderSkippingIndexesAndHiddenFiles) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  write_file(in.file("b.txt"), "bee");
  write_file(in.file("a.txt"), "ay");
  write_file(in.file("sub/c"), "sea");
  write_file(in.file("a.dat"), std::string("\0\1binary index", 14));
  write_file(in.file("a.u8"), "skipped link");
  write_file(in.file(".hidden"), "hidden");
  write_file(in.file(".git/objects/x"), "hidden dir");
  write_file(out.file("extra.txt"), "extra");
  Result<PrepareStats> s = prepare_token_file(options(out, {in.path(), out.file("extra.txt")}));
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->files, 4u);
  Result<TokenFile> f = TokenFile::open(out.file("out.bin"));
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(all_tokens(*f), packed(tok, {"ay", "bee", "sea", "extra"}));
}

// Issue #26: JSON Lines, one object per line, its --field the document (default "text").
TEST(Prepare, JsonLinesFieldIsOneDocumentPerLine) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  write_file(in.file("a.jsonl"),
             "{\"text\": \"First line.\\nwith a newline\", \"id\": 1}\n"
             "\n"
             "  {\"id\": 2, \"text\": \"caf\\u00e9 \\\"quoted\\\"\"}\r\n"
             "{\"text\": \"   \"}\n"
             "{\"text\": \"last, no newline\"}");
  PrepareOptions o = options(out, {in.file("a.jsonl")});
  Result<PrepareStats> s = prepare_token_file(o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->documents, 3u);  // the blank line and the whitespace-only text are dropped
  Result<TokenFile> f = TokenFile::open(o.out);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(all_tokens(*f), packed(tok, {"First line.\nwith a newline", "caf\u00e9 \"quoted\"",
                                         "last, no newline"}));
  // Another field by name.
  write_file(in.file("b.ndjson"), "{\"body\": \"one\"}\n{\"body\": \"two\"}\n");
  PrepareOptions ob = options(out, {in.file("b.ndjson")});
  ob.field = "body";
  ob.out = out.file("b.bin");
  ASSERT_TRUE(prepare_token_file(ob).is_ok());
  Result<TokenFile> fb = TokenFile::open(ob.out);
  ASSERT_TRUE(fb.is_ok());
  EXPECT_EQ(all_tokens(*fb), packed(tok, {"one", "two"}));
}

TEST(Prepare, DirectoryMixesTextAndJsonLinesByName) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  write_file(in.file("a.txt"), "plain");
  write_file(in.file("b.jsonl"), "{\"text\": \"from json\"}\n{\"text\": \"again\"}\n");
  write_file(in.file("c.json"), "{\"text\": \"a .json file is text\"}");
  Result<PrepareStats> s = prepare_token_file(options(out, {in.path()}));
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->files, 3u);
  Result<TokenFile> f = TokenFile::open(out.file("out.bin"));
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(all_tokens(*f),
            packed(tok, {"plain", "from json", "again", "{\"text\": \"a .json file is text\"}"}));
}

// Every bad line names the file, the line number and what is wrong, and nothing is written.
TEST(Prepare, BadJsonLinesNameTheFileTheLineAndTheProblem) {
  TempDir in, out;
  struct Case {
    const char* text;
    const char* field;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"{\"text\": \"ok\"}\n\n{\"text\": \"broken}\n", "text", ":3: not valid JSON ("},
      {"{\"text\": \"ok\"}\n[1, 2]\n", "text",
       ":2: expected a JSON object with a \"text\" "
       "string, found an array"},
      {"{\"body\": \"x\", \"id\": 3}\n", "text",
       ":1: no field \"text\" (the object has \"body\", \"id\"); name the text's field with "
       "--field"},
      {"{\"text\": 42}\n", "text", ":1: field \"text\" is a number, not a string"},
      {"{\"text\": null}\n", "text", ":1: field \"text\" is null, not a string"},
      {"{\"text\": \"a\"}\n{\"text\": {\"nested\": 1}}\n", "text",
       ":2: field \"text\" is an object, not a string"},
      {"{\"text\": \"x\"}\n", "content", ":1: no field \"content\""},
      {"\n\n", "text", "' is empty (no line with a non-blank \"text\")"},
  };
  for (const Case& c : cases) {
    write_file(in.file("bad.jsonl"), c.text);
    PrepareOptions o = options(out, {in.file("bad.jsonl")});
    o.field = c.field;
    Result<PrepareStats> s = prepare_token_file(o);
    ASSERT_FALSE(s.is_ok()) << c.text;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find(in.file("bad.jsonl")), std::string::npos)
        << s.status().message();
    EXPECT_NE(s.status().message().find(c.want), std::string::npos)
        << s.status().message() << "\nwanted: " << c.want;
    EXPECT_TRUE(list_dir(out.path()).empty());
  }
}

// The progress callback: each stage from 0 to its total, never backwards, on the calling thread.
TEST(Prepare, ProgressGoesFromZeroToTheTotalPerStage) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  std::string big;
  for (int i = 0; i < 20000; i++) big += "line " + std::to_string(i) + " of some text\n%\n";
  write_file(in.file("big"), big);
  PrepareOptions o = options(out, {in.file("big")});
  o.doc_separator = "%";
  std::vector<std::tuple<std::string, uint64_t, uint64_t>> calls;
  const std::thread::id me = std::this_thread::get_id();
  bool other_thread = false;
  o.progress = [&](const char* stage, uint64_t done, uint64_t total) {
    if (std::this_thread::get_id() != me) other_thread = true;
    calls.emplace_back(stage, done, total);
  };
  Result<PrepareStats> s = prepare_token_file(o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_FALSE(other_thread);
  for (const char* stage : {"read", "tokenise"}) {
    std::vector<std::pair<uint64_t, uint64_t>> seen;
    for (const auto& [st, d, t] : calls) {
      if (st == stage) seen.emplace_back(d, t);
    }
    ASSERT_GE(seen.size(), 2u) << stage;
    EXPECT_EQ(seen.front().first, 0u) << stage;
    EXPECT_EQ(seen.back().first, seen.back().second) << stage;
    EXPECT_GT(seen.back().second, 0u) << stage;
    for (size_t i = 1; i < seen.size(); i++) EXPECT_GE(seen[i].first, seen[i - 1].first);
  }
  EXPECT_EQ(std::get<2>(calls.front()), uint64_t(big.size()));  // read: the file's bytes
}

TEST(Prepare, OutputInsideAnInputDirectoryIsNotReadBack) {
  HR_TEST_TOKENIZER(tok);
  TempDir dir;
  write_file(dir.file("a.txt"), "some text");
  PrepareOptions o = options(dir, {dir.path()});
  ASSERT_TRUE(prepare_token_file(o).is_ok());
  Result<PrepareStats> again = prepare_token_file(o);  // out.bin now sits in the input directory
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->files, 1u);
}

TEST(Prepare, LatinOneTextIsKeptByteForByte) {
  HR_TEST_TOKENIZER(tok);
  TempDir in, out;
  const std::string text = "caf\xE9 cr\xE8me br\xFBl\xE9\x65 is a dessert in French cooking.\n";
  write_file(in.file("latin1.txt"), text);
  ASSERT_TRUE(prepare_token_file(options(out, {in.file("latin1.txt")})).is_ok());
  Result<TokenFile> f = TokenFile::open(out.file("out.bin"));
  ASSERT_TRUE(f.is_ok());
  std::vector<int32_t> t = all_tokens(*f);
  t.pop_back();  // eot
  EXPECT_EQ(tok.decode(t), text);
}

TEST(Prepare, EmptyInputFailsAndWritesNothing) {
  TempDir in, out;
  write_file(in.file("empty.txt"), "");
  write_file(in.file("blank.txt"), " \n\n\t\n");
  for (const char* name : {"empty.txt", "blank.txt"}) {
    Result<PrepareStats> s = prepare_token_file(options(out, {in.file(name)}));
    ASSERT_FALSE(s.is_ok());
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("input '" + in.file(name) + "' is empty"),
              std::string::npos)
        << s.status().message();
    EXPECT_TRUE(list_dir(out.path()).empty());
  }
  // Only separators: also empty.
  write_file(in.file("seps"), "%\n%\n");
  PrepareOptions o = options(out, {in.file("seps")});
  o.doc_separator = "%";
  EXPECT_NE(prepare_token_file(o).status().message().find("is empty"), std::string::npos);
}

TEST(Prepare, BinaryInputFailsAndWritesNothing) {
  TempDir in, out;
  write_file(in.file("good.txt"), "fine text");
  write_file(in.file("nul.bin"), std::string("text\0more", 9));
  std::string high(1000, '\0');
  for (size_t i = 0; i < high.size(); ++i) high[i] = static_cast<char>(0x80 + (i * 37) % 0x7F);
  write_file(in.file("high.bin"), high);
  for (const char* name : {"nul.bin", "high.bin"}) {
    Result<PrepareStats> s = prepare_token_file(options(out, {in.file("good.txt"), in.file(name)}));
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.status().message().find("input '" + in.file(name) + "' looks binary, not text"),
              std::string::npos)
        << s.status().message();
    EXPECT_TRUE(list_dir(out.path()).empty());
  }
}

TEST(Prepare, MissingInputAndBadOutputs) {
  TempDir in, out;
  write_file(in.file("a.txt"), "text");
  Result<PrepareStats> s = prepare_token_file(options(out, {in.file("missing.txt")}));
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("missing.txt"), std::string::npos);

  PrepareOptions o = options(out, {in.file("a.txt")});
  o.out = out.file("no/such/dir/out.bin");
  s = prepare_token_file(o);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("does not exist"), std::string::npos) << s.status().message();

  o.out = out.path();
  s = prepare_token_file(o);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("is a directory"), std::string::npos);

  if (geteuid() != 0) {  // root writes anywhere
    std::filesystem::permissions(out.path(), std::filesystem::perms::owner_write,
                                 std::filesystem::perm_options::remove);
    o.out = out.file("out.bin");
    s = prepare_token_file(o);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.status().message().find("not writable"), std::string::npos);
  }

  EXPECT_FALSE(prepare_token_file(options(out, {})).is_ok());
  write_file(in.file("empty_dir/.hidden"), "x");
  s = prepare_token_file(options(out, {in.file("empty_dir")}));
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("has no text files"), std::string::npos);
}

TEST(Prepare, DefaultCorpusIsTheFortuneTextFiles) {
  std::vector<std::string> files = default_corpus_inputs();
  if (!std::filesystem::is_directory("/usr/share/games/fortunes")) {
    EXPECT_TRUE(files.empty());
    return;
  }
  ASSERT_FALSE(files.empty());
  EXPECT_TRUE(std::is_sorted(files.begin(), files.end()));
  for (const std::string& f : files) {
    std::string name = std::filesystem::path(f).filename().string();
    EXPECT_EQ(name.find('.'), std::string::npos) << f;
  }
}

// --tokenizer: a tokenizer.json (here Llama 3's, from scripts/get-tokenizers) instead of GPT-2;
// documents end with its eos, and the header records its vocabulary size.
TEST(Prepare, TokenizerDirectoryReplacesGpt2) {
  const std::string dir = HEADROOM_SOURCE_DIR "/third_party/tokenizers/llama3";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) {
    GTEST_SKIP() << dir << " is missing; run scripts/get-tokenizers (needs npm)";
  }
  TempDir in, out;
  const std::vector<std::string> docs = {"Hello there, 你好!\n", "Second document: 12345.\n"};
  write_file(in.file("a.txt"), docs[0] + "%\n" + docs[1]);
  PrepareOptions o = options(out, {in.file("a.txt")});
  o.vocab_dir.clear();
  o.tokenizer_dir = dir;
  o.doc_separator = "%";
  Result<PrepareStats> s = prepare_token_file(o);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->tokenizer, "llama3");
  EXPECT_EQ(s->vocab_size, 128256);
  EXPECT_EQ(s->eot, 128001);
  Result<TokenFile> f = TokenFile::open(out.file("out.bin"));
  ASSERT_TRUE(f.is_ok()) << f.status().to_string();
  EXPECT_EQ(f->vocab_size(), 128256);
  EXPECT_EQ(f->token_bytes(), 4);
  EXPECT_EQ(f->eot(), 128001);
  EXPECT_EQ(f->document_count(), 2u);
  Result<HfTokenizer> tok = HfTokenizer::load(dir + "/tokenizer.json", "", "llama3");
  ASSERT_TRUE(tok.is_ok());
  std::vector<int32_t> want;
  for (const std::string& d : docs) {
    for (int32_t id : tok->encode(d)) want.push_back(id);
    want.push_back(128001);
  }
  EXPECT_EQ(all_tokens(*f), want);
}

TEST(Prepare, TokenizerAndVocabTogetherAreRefused) {
  TempDir in, out;
  write_file(in.file("a.txt"), "text\n");
  PrepareOptions o = options(out, {in.file("a.txt")});
  o.tokenizer_dir = in.path();
  Result<PrepareStats> s = prepare_token_file(o);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("not both"), std::string::npos);
  o.vocab_dir.clear();
  s = prepare_token_file(o);  // the directory holds no tokenizer
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find(in.path()), std::string::npos);
  EXPECT_TRUE(list_dir(out.path()).empty());
}

}  // namespace
}  // namespace headroom::data
