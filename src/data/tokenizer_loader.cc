// load_tokenizer(): picks the reader by the files a directory holds.
#include <filesystem>

#include "data/byte_tokenizer.h"
#include "data/hf_tokenizer.h"
#include "data/spm_tokenizer.h"
#include "data/tokenizer.h"
#include "data/tokenizer_util.h"

namespace headroom::data {

Result<std::unique_ptr<Tokenizer>> load_tokenizer(const std::string& dir,
                                                  const TokenizerOptions& options) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir == kByteTokenizerName && !fs::is_directory(dir, ec)) {
    return std::unique_ptr<Tokenizer>(std::make_unique<ByteTokenizer>());
  }
  if (!fs::is_directory(dir, ec)) {
    return Status::not_found("tokenizer directory '" + dir +
                             "' does not exist or is not a directory; pass a directory holding "
                             "tokenizer.json, tokenizer.model or encoder.json + vocab.bpe, or "
                             "`bytes` (one token a byte)");
  }
  // The directory's own name ("llama3"), also for "dir/" and ".".
  std::string name = fs::path(dir).lexically_normal().filename().string();
  if (name.empty() || name == ".") {
    name = fs::weakly_canonical(fs::path(dir), ec).filename().string();
  }
  if (name.empty()) name = "tokenizer";
  const std::string config = dir + "/tokenizer_config.json";
  using tok_util::file_exists;
  if (file_exists(dir + "/tokenizer.json")) {
    HR_ASSIGN_OR_RETURN(HfTokenizer t,
                        HfTokenizer::load(dir + "/tokenizer.json", config, name, options));
    return std::unique_ptr<Tokenizer>(std::make_unique<HfTokenizer>(std::move(t)));
  }
  if (file_exists(dir + "/tokenizer.model")) {
    HR_ASSIGN_OR_RETURN(SpmTokenizer t,
                        SpmTokenizer::load(dir + "/tokenizer.model", config, name, options));
    return std::unique_ptr<Tokenizer>(std::make_unique<SpmTokenizer>(std::move(t)));
  }
  if ((file_exists(dir + "/encoder.json") && file_exists(dir + "/vocab.bpe")) ||
      (file_exists(dir + "/vocab.json") && file_exists(dir + "/merges.txt"))) {
    HR_ASSIGN_OR_RETURN(Gpt2Tokenizer t, Gpt2Tokenizer::load(dir));
    return std::unique_ptr<Tokenizer>(std::make_unique<Gpt2Tokenizer>(std::move(t)));
  }
  return Status::not_found("no tokenizer in '" + dir +
                           "': expected tokenizer.json (Hugging Face), tokenizer.model "
                           "(SentencePiece), or encoder.json + vocab.bpe / vocab.json + merges.txt "
                           "(GPT-2); scripts/get-tokenizers fetches some into "
                           "third_party/tokenizers/");
}

}  // namespace headroom::data
