// Token-budget batching of variable-length documents (issue #5): documents cut at the end-of-text
// token, grouped into length buckets, and served as one rows x length batch per optimizer step
// that fills a token budget, with padding instead of packing. See docs/notes/batching.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "data/batcher.h"
#include "data/token_file.h"

namespace headroom::data {

// "packed" (fixed T-token windows of the concatenated stream, PackedBatcher) or "bucketed"
// (one document per row, rows of one length bucket, DocumentBatcher).
enum class Batching { kPacked, kBucketed };
// Errors: InvalidArgument naming --batching and the value.
Result<Batching> parse_batching(const std::string& name);
const char* batching_name(Batching b);

// A piece of a document: the targets are tokens [begin, begin + length) of the file. Its inputs
// are the same tokens shifted right by one, with the end-of-text token as the first input of a
// document's first piece (a document starts after an eot, as GPT-2 saw it) and the preceding
// token of the document for later pieces of a document longer than T.
struct Piece {
  int64_t begin = 0;
  int32_t length = 0;  // 1..T
  bool first = true;   // the document's first piece (its first input is the eot token)
};

// The pieces of `range`: each document (its tokens up to and including the eot that ends it; the
// range's last document may lack the eot) cut into pieces of at most T tokens, in file order.
// Every token of the range is the target of exactly one piece.
std::vector<Piece> document_pieces(const TokenFile& file, TokenRange range, int T);

// Serves one batch per optimizer step: `rows` pieces of one length bucket, each padded to the
// bucket's length (a multiple of `bucket`, at most T), rows x length <= step_tokens. An epoch is
// every piece of the range exactly once: the pieces are shuffled (seed, epoch), grouped by bucket
// in that order, each bucket cut into batches of step_tokens / length rows (its last batch may
// have fewer), and the batches shuffled (seed, epoch). Epoch e + 1 follows epoch e.
//
// The state is one integer, position() (batches served since the start of epoch 0), so a
// checkpoint restores the exact stream with set_position(). The batches of an epoch depend only
// on (file range, T, bucket, step_tokens, seed, epoch), never on the micro-batch the trainer cuts
// them into, so an optimizer step holds the same documents whatever the micro-batch.
//
// The TokenFile must outlive the batcher. Not thread-safe: one batcher per consumer thread.
class DocumentBatcher {
 public:
  // Errors: InvalidArgument (naming the flag) if T, bucket or step_tokens are not positive,
  // step_tokens < T, or the range holds no token.
  static Result<DocumentBatcher> create(const TokenFile& file, TokenRange range, int T, int bucket,
                                        int64_t step_tokens, uint64_t seed);

  struct Shape {
    int rows = 0;
    int length = 0;           // the bucket's length
    int64_t real_tokens = 0;  // targets that are not padding
  };
  // Fills inputs[rows * length] and targets[rows * length] (row-major), padding with the eot
  // token as input and -1 (ignored) as target, and advances by one batch.
  Shape next(int32_t* inputs, int32_t* targets);

  int64_t position() const { return position_; }
  // REQUIRES: valid_position(position).
  void set_position(int64_t position);
  bool valid_position(int64_t position) const { return position >= 0; }

  // One entry per batch of an epoch, in serving order.
  struct Batch {
    int length = 0;
    int64_t first = 0;  // index into the epoch's piece order (order())
    int rows = 0;
  };
  // The batches of `epoch` and the piece indices (into pieces()) they take, in order.
  void epoch_plan(int64_t epoch, std::vector<Batch>* batches, std::vector<int64_t>* order) const;

  const std::vector<Piece>& pieces() const { return pieces_; }
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // Over one epoch: padding tokens / (rows x length summed over its batches).
  double padding_fraction() const { return padding_fraction_; }
  // The shapes (rows, length) an epoch's batches can take: every bucket's full batch and its
  // last, shorter one.
  std::vector<std::pair<int, int>> batch_shapes() const;
  int seq() const { return T_; }
  int bucket() const { return bucket_; }
  int64_t step_tokens() const { return step_tokens_; }
  TokenRange range() const { return range_; }

  // The bucket length of a piece of `length` tokens.
  int bucket_length(int length) const;

 private:
  DocumentBatcher(const TokenFile* file, TokenRange range, int T, int bucket, int64_t step_tokens,
                  uint64_t seed);
  void load_epoch(int64_t epoch);

  const TokenFile* file_;
  TokenRange range_;
  int T_, bucket_;
  int64_t step_tokens_;
  uint64_t seed_;
  std::vector<Piece> pieces_;
  int64_t batches_per_epoch_ = 0;
  double padding_fraction_ = 0;
  int64_t position_ = 0;
  int64_t loaded_epoch_ = -1;
  std::vector<Batch> batches_;
  std::vector<int64_t> order_;
};

}  // namespace headroom::data
