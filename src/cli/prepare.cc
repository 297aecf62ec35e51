// `headroom prepare`: tokenises text files into a token file.
#include "cli/common.h"

#include <cstdio>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/units.h"
#include "core/utf8.h"
#include "data/prepare.h"
#include "report/progress.h"

namespace headroom::cli {

int run_prepare(PrepareFlags& f) {
  data::PrepareOptions po;
  po.inputs = f.inputs;
  po.out = f.out;
  po.doc_separator = f.separator;
  po.vocab_dir = f.vocab;
  po.tokenizer_dir = f.tokenizer;
  po.field = f.field;
  // A progress bar on large inputs (the read, then the tokeniser), where it is worth a line.
  constexpr uint64_t kProgressBytes = 16ull << 20;
  report::ProgressBar bar;
  if (!f.json) {
    po.progress = [&bar, last = std::string(), big = false](const char* stage, uint64_t done,
                                                            uint64_t total) mutable {
      // Large by the inputs' size (the read stage comes first): JSON Lines' documents are
      // smaller than their files.
      if (std::string_view(stage) == "read") big = total >= kProgressBytes;
      if (!big) return;
      const std::string at = fmt::format("{} {}", stage, done);
      if (at == last) return;  // the same figure once
      last = at;
      bar.update(long(done >> 20), long(std::max<uint64_t>(1, total >> 20)),
                 fmt::format("MiB {}", std::string_view(stage) == "read" ? "read" : "tokenised"));
      if (done == total) bar.finish();
    };
  }
  Result<data::PrepareStats> st = data::prepare_token_file(po);
  if (!st.is_ok()) return fail(st.status());
  if (f.json) {
    json j = {{"out", f.out},
              {"files", st->files},
              {"documents", st->documents},
              {"tokens", st->tokens},
              {"bytes", st->bytes},
              {"seconds", st->seconds},
              {"tokenizer", st->tokenizer},
              {"vocab_size", st->vocab_size},
              {"eot", st->eot}};
    std::printf("%s\n", dump_json(j, 2).c_str());
  } else {
    std::printf(
        "%s: %llu documents, %llu tokens from %llu files (%s of text) in %.1f s (tokenizer %s, "
        "vocab %d)\n",
        f.out.c_str(), static_cast<unsigned long long>(st->documents),
        static_cast<unsigned long long>(st->tokens), static_cast<unsigned long long>(st->files),
        format_bytes(st->bytes).c_str(), st->seconds, st->tokenizer.c_str(), st->vocab_size);
  }
  return 0;
}

}  // namespace headroom::cli
