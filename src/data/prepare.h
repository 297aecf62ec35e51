// `headroom prepare`: text files in, one packed token file out (documents joined by eot tokens).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"

namespace headroom::data {

struct PrepareOptions {
  // Files or directories. A directory contributes its regular files, recursively, sorted by path;
  // hidden entries (names starting with '.') and names ending in .dat or .u8 (fortune indexes
  // and links) are skipped. A file whose name ends in .jsonl or .ndjson (given or found in a
  // directory) is JSON Lines: one JSON object per line, each line's `field` one document (blank
  // lines skipped); every other file is text.
  std::vector<std::string> inputs;
  // JSON Lines: the member of each line's object that holds the document's text (a string).
  std::string field = "text";
  std::string out;        // the token file to write (atomically)
  std::string vocab_dir;  // GPT-2 vocabulary; empty = find_vocab_dir()
  // A directory for load_tokenizer() (tokenizer.json, tokenizer.model or GPT-2's files); empty =
  // GPT-2 from vocab_dir. Not both. Documents are then separated by the tokenizer's eos token.
  std::string tokenizer_dir;
  // A line that separates documents inside a file, e.g. "%" for fortune files (compared without
  // its line ending). Empty = each file is one document. Text files only: in JSON Lines every
  // line is a document.
  std::string doc_separator;
  // Called from the calling thread as the work goes on: `stage` is "read" (bytes of the inputs
  // read) or "tokenise" (bytes of the documents tokenised), `done` of `total` bytes; at least
  // once at the start and once at the end of each stage, and at most every 100 ms in between
  // while tokenising. Empty: no calls.
  std::function<void(const char* stage, uint64_t done, uint64_t total)> progress;
};

struct PrepareStats {
  uint64_t files = 0;      // text files read
  uint64_t documents = 0;  // documents written (each followed by one eot)
  uint64_t tokens = 0;     // tokens written, eot tokens included
  uint64_t bytes = 0;      // bytes of text read
  double seconds = 0;      // wall time of the whole call
  std::string tokenizer;   // the tokenizer's name() ("gpt2", "llama3", ...)
  int32_t vocab_size = 0;  // recorded in the token file's header
  int32_t eot = 0;         // the document separator, recorded in the header
};

// Reads, tokenises (GPT-2 BPE or options.tokenizer_dir's tokenizer, on all cores) and writes
// `options.out`; the header records the tokenizer's vocab_size and eos id (the format has no
// field for its name). Documents that hold only
// whitespace are dropped. Every input is checked before the tokenizer runs, and the output is
// written atomically, so on error nothing is left behind at `out`.
// Errors: InvalidArgument for no inputs or no --out, an empty input ("INPUT is empty"), a binary
// input ("INPUT looks binary, not text": a NUL byte, or over 10% of bytes not valid UTF-8), a
// JSON Lines line that is not valid JSON, not an object, lacks `field` or holds a non-string
// there ("INPUT:LINE: ..."), or an
// output path that is a directory / in a missing or read-only directory, both vocab_dir and
// tokenizer_dir, or a tokenizer without an eos token; NotFound for a missing input or vocabulary;
// IoError if reading or writing fails.
// Text that is not valid UTF-8 in a few places (e.g. Latin-1 accents) is kept byte for byte.
Result<PrepareStats> prepare_token_file(const PrepareOptions& options);

// The fortune text files of Debian's `fortunes` package (/usr/share/games/fortunes, the files
// without an extension), sorted; empty if the package is not installed. Their documents are
// separated by "%" lines: the caller sets PrepareOptions::doc_separator.
std::vector<std::string> default_corpus_inputs();

}  // namespace headroom::data
