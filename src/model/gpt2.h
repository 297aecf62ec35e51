// The decoder-only transformer (GPT-2 and the Llama family, model/config.h): the parameter table
// (Hugging Face names and layouts), the activation buffer table for a micro-batch shape (B, T),
// and forward/backward built from the backend's op table (backend/ops.h).
//
// Every buffer the model touches is described here, once (DESIGN.md principle 1); the caller
// allocates them (arenas) and binds them. The model allocates nothing. The file keeps GPT-2's
// name: GPT-2 came first, and the names gpt2_* / Gpt2 stay as those of the generic model.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "backend/ops.h"
#include "core/event_log.h"
#include "core/tensor.h"
#include "memory/arena.h"
#include "model/config.h"
#include "model/offload_copier.h"

namespace headroom::model {

struct ParamDesc {
  std::string name;  // Hugging Face name, e.g. "h.0.attn.c_attn.weight", "model.norm.weight"
  Shape shape;       // Hugging Face layout (GPT-2's Conv1D weights are [in, out], Linear [out, in])
  bool decay;        // AdamW weight decay applies (2-D tensors)
  int64_t offset;    // in floats, inside the flat parameter buffer (64-byte aligned, except
                     // inside a fused group: see ParamTable::Layer)
  // The executor site that owns it (BlockHooks): -1 the embedding (the token and position
  // tables), 0..n_layer-1 its block, n_layer the head (the final norm and an untied LM head; a
  // tied head reads the embedding's wte).
  int site = 0;
};

// The parameters in a fixed order (Hugging Face's), with offsets into one flat buffer.
struct ParamTable {
  std::vector<ParamDesc> params;
  int64_t total_floats = 0;    // size of the flat buffer, padding included
  int64_t num_parameters = 0;  // sum of numel, padding excluded
  // Tensors with weight decay occupy floats [0, decay_floats), the others
  // [decay_floats, total_floats).
  int64_t decay_floats = 0;

  // Indices into `params` of the tensors each op reads; kNone where the architecture has none.
  // q|k|v (Llama's q_proj, k_proj, v_proj, or GPT-2's one c_attn) and the MLP's gate|up are
  // adjacent in the flat buffer, without padding between them, so that each group is one GEMM's
  // weight ([qkv_width, C] with Linear's layout): `qkv_w` and `fc_w` name its first tensor.
  static constexpr size_t kNone = SIZE_MAX;
  struct Layer {
    size_t ln1_w, ln1_b, qkv_w, qkv_b, attproj_w, attproj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w,
        fcproj_b;
  };
  size_t wte = kNone, wpe = kNone, lnf_w = kNone, lnf_b = kNone;
  size_t head = kNone;  // the LM head's weight [V, C]: wte when tied
  std::vector<Layer> layers;

  const ParamDesc* find(std::string_view name) const;
  // ZeRO's group of a tensor: -1 the embedding site, l block l, INT32_MAX the head's (site L).
  int group_of(const ParamDesc& p) const;
  // The end of a tensor's floats in the flat buffer with its padding (a fused group's members
  // end where the next one starts, rounded up to 16 floats).
  static int64_t end_of(const ParamDesc& p);
};
// The architecture's tensors in Hugging Face's order: GPT-2's names (wte.weight, h.N.ln_1.weight,
// ...) or the Llama family's (model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight,
// ..., lm_head.weight).
ParamTable gpt2_param_table(const Gpt2Config& c);
// The configuration's rotary scaling as the op table takes it.
backend::RopeScaling backend_rope_scaling(const RopeScalingConfig& rs);

// Activation recomputation of one block (see docs/notes/recompute.md).
enum class Recompute : uint8_t {
  kNone,       // keep every activation the backward needs
  kSelective,  // recompute the cheap, large ones in backward: LayerNorm outputs, GELU output
  kFull,       // keep only the block's input; re-run its forward inside the backward
};
std::string_view recompute_name(Recompute r);

// The arithmetic of a step. kBf16 is mixed precision as torch.autocast does it: GEMMs on bf16
// operands (bf16 copies of the weights, bf16 activations around them) accumulating in fp32; the
// residual stream, LayerNorm statistics, softmax, loss, parameter gradients, master weights and
// optimizer state stay fp32. kFp16 stores the same activations in IEEE half and trains with
// dynamic loss scaling (train/loss_scale.h); its GEMMs read fp32 weights rounded to f16 values,
// cast per layer, and widen the f16 activations in a planned staging area (oneDNN 2.6 has no
// f16 matmul on x86). See docs/notes/mixed-precision.md.
enum class Precision : uint8_t { kFp32, kBf16, kFp16 };
std::string_view precision_name(Precision p);  // "fp32", "bf16", "fp16"

// Knowledge distillation (docs/notes/distillation.md): the loss (ops.h KdLoss) and the teacher,
// a model of the same vocabulary that runs forward only in its own precision (fp32 or bf16).
struct Distill {
  backend::KdLoss loss;
  Gpt2Config teacher;
  Precision teacher_precision = Precision::kFp32;
  bool operator==(const Distill&) const = default;
};

// How a micro-batch is executed: choices that change memory and time, never the mathematics
// beyond rounding (each has an invariance test against the plain path).
struct ExecOptions {
  // The row stride of the MLP's 4C-wide activations for these options on the backend `ops`.
  int64_t mlp_row_stride(int64_t four_c, const backend::Ops& ops) const;
  // The row stride of the full logits [B*T, V] (floats; their bf16 gradient's is twice it in
  // bf16 elements, each row over its own fp32 row) for these options: V rounded up to 64 elements
  // with pad_rows, so every row starts on a cache line (oneDNN's bf16 head GEMMs ran 1.4-2x faster
  // so: docs/notes/lm-head-rows.md).
  int64_t logits_row_stride(int64_t V, const backend::Ops& ops) const;

  bool tiled_attention = true;  // online-softmax attention: no T x T probabilities are kept
  int head_chunk = 0;  // > 0: fused LM head + cross-entropy over chunks of this many tokens
                       // (the B x T x V logits never exist); 0: full logits buffer
  std::vector<Recompute> recompute;  // per block; empty means kNone everywhere
  bool pad_rows = true;  // pad the 4C-wide activations' rows off 4 KiB multiples and the logits'
                         // to 64 elements (speed only)
  Precision precision = Precision::kFp32;  // kBf16 and kFp16 need tiled attention
  // bf16 only: true keeps a persistent bf16 copy of the parameters (2 bytes each; AdamW refreshes
  // it); false casts each block's GEMM weights (and the LM head's) into step buffers just before
  // they are used, forward and backward: less memory, a cast pass per use.
  bool bf16_weight_copy = true;

  // Activation offload per block (empty: none). An offloaded block's saved activations are
  // copied to the offload tier after its forward and prefetched back before its backward (see
  // docs/notes/offload-activations.md). Combines with kNone and kSelective (what the block keeps
  // is what moves); a fully recomputed block keeps nothing to offload, so kFull + offload is
  // refused by the planner.
  std::vector<bool> offload;

  // Knowledge distillation (docs/notes/distillation.md). A teacher runs forward only with
  // hidden_only: no head, no loss; the forward stops after the final norm, whose output (lnf) is
  // what the student's head reads (Gpt2::kd_teacher). A student with `distill` has the teacher's
  // forward-only working set in its own table (ActivationTable::teacher) and fuses the KD loss
  // into its chunked head (needs head_chunk > 0) whenever a teacher is bound
  // (Gpt2::set_teacher); head_lse then holds the KD head's 4 x B x T statistics. Without a
  // teacher bound (validation) the same table runs the plain CE head.
  bool hidden_only = false;
  std::optional<Distill> distill;

  bool operator==(const ExecOptions&) const = default;
  Recompute recompute_at(int layer) const {
    return recompute.empty() ? Recompute::kNone : recompute[size_t(layer)];
  }
  bool offload_at(int layer) const { return !offload.empty() && offload[size_t(layer)]; }
};

// Indices into the activation buffer table for one micro-batch shape.
struct Gpt2ActivationIds {
  struct Layer {
    // att: the softmax probabilities [B,NH,T,T] (plain attention) or the log-sum-exp per row
    // [B,NH,T] (tiled attention). ln*_mean: SIZE_MAX with RMSNorm. qkv [B,T,qkv_width] holds the
    // rotated q and k with rotary embeddings; fch [B,T,fc_width] the MLP's first GEMM (gate|up
    // for SwiGLU), fch_gelu [B,T,mlp_width] its activation (GELU or SwiGLU).
    size_t ln1, ln1_mean, ln1_rstd, qkv, atty, att, residual2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, residual3;
  };
  size_t encoded;
  // Rotary embeddings: cos [T, HS/2], sin [T, HS/2] and inv_freq [HS/2], fp32, filled by the
  // forward's embedding op; SIZE_MAX with learned positions.
  size_t rope = SIZE_MAX;
  std::vector<Layer> fwd;  // where each block's forward writes
  std::vector<Layer> bwd;  // where its backward reads: the same buffers, except that recomputed
                           // ones are the shared "recompute.*" buffers
  size_t lnf, lnf_mean, lnf_rstd;
  size_t logits;        // [B,T,logits_row_stride(V)]; SIZE_MAX with the fused head
  size_t head_lse;      // [B,T] each row's log-sum-exp, saved by the loss's forward (both heads)
  size_t head_scratch;  // [chunk,V] logits chunk of the fused head; SIZE_MAX otherwise
  // Distillation: the teacher's [chunk, V] logits chunk in the KD head (category teacher);
  // SIZE_MAX otherwise.
  size_t kd_teacher_logits = SIZE_MAX;
  size_t losses;
  size_t att_fwd_scratch;  // tiled attention's forward scratch; SIZE_MAX for plain attention
  // Backward-only workspace (SIZE_MAX when not training). d_c, d_3c, d_4c hold the activations'
  // dtype; dresidual is fp32, and with bf16 dresidual_low is its bf16 rounding that the GEMMs
  // read (SIZE_MAX in fp32).
  size_t dresidual, d_c, d_3c, d_4c, att_scratch, dresidual_low;
  // bf16 without the persistent weight copy: one block's GEMM weights cast to bf16
  // ([qkv | attproj | fc | fcproj], 12 C^2 in GPT-2) and the LM head's (V x C); SIZE_MAX
  // otherwise.
  // fp16 (always cast per layer): the same buffers in fp32 holding f16-rounded values.
  size_t block_weights_bf16, head_weights_bf16;
  // fp16: the staging area of the f16 GEMMs (cpu::F16GemmStaging); SIZE_MAX otherwise.
  size_t f16_staging;
  // bf16 training: the transposed operands of the weight-gradient GEMMs that take them
  // (cpu::Bf16WgradStaging, cpu::bf16_wgrad_transposes): inp^T then dout^T of one block's GEMM,
  // and the LM head's inp^T and its dlogits^T in chunks of rows (at least 3072 rows, or V);
  // SIZE_MAX when no GEMM takes them.
  size_t bf16_wgrad_staging;
};

// Activation offload of one block: each saved buffer moves from the forward's step buffer
// (`saved`) to the offload tier (`host`, an index into ActivationTable::offload_buffers) and back
// into a step buffer of its own (`landing`, category staging) that the block's backward reads.
struct OffloadMove {
  size_t saved, landing, host;
};
struct OffloadBlock {
  int layer;
  std::vector<OffloadMove> moves;
  uint64_t bytes = 0;  // one direction
};

struct ActivationTable {
  std::vector<memory::BufferDesc> buffers;
  Gpt2ActivationIds ids;
  ExecOptions options;
  // The offload tier's buffers (category offload; one region, laid out sequentially) and the
  // offloaded blocks in layer order. Empty without offload (and when not training).
  std::vector<memory::BufferDesc> offload_buffers;
  std::vector<OffloadBlock> offloaded;
  const OffloadBlock* offload_of(int layer) const;
  // Distillation (ExecOptions::distill): the teacher's forward-only table (hidden_only), whose
  // buffers are the last ones of `buffers` above (category teacher, named "teacher.*") and whose
  // ids index `buffers` as a whole, so that the teacher's Gpt2 binds the student's arena with
  // it. Its ops come first in gpt2_step_ops; its final norm's output (the KD head's input) and,
  // in bf16, its head's cast weight live on to the student's head backward. Null otherwise.
  std::shared_ptr<const ActivationTable> teacher;
};
// Buffers for forward+backward of a (B, T) micro-batch. With training == false, the
// backward-only workspace is left out (inference and validation).
// REQUIRES: options.recompute and options.offload are empty or have n_layer entries; no block
// is both fully recomputed and offloaded.
// Scratch sizes come from the backend that will run it.
ActivationTable gpt2_activation_table(const Gpt2Config& c, int B, int T, bool training = true,
                                      const ExecOptions& options = {},
                                      const backend::Ops& ops = backend::cpu_ops());

// One op of a micro-batch's training step, in execution order, with every activation-table
// buffer it reads or writes. The planner derives each buffer's lifetime from these (first and
// last op that touches it); Gpt2::forward/backward run exactly these ops in this order.
struct OpDesc {
  std::string name;  // "forward h.3", "backward head", ...
  enum class Phase { kForward, kBackward } phase;
  int layer;  // -1 for embedding and head
  std::vector<size_t> buffers;
};
// The ops of forward + backward (training == true) or forward only, for the table.
// An offloaded block's saved buffers are also touched by the next forward op (the copy out
// overlaps it; the executor waits for the copy at that op's end), and its landing buffers by
// the backward op before its own (the prefetch overlaps it).
std::vector<OpDesc> gpt2_step_ops(const Gpt2Config& c, const ActivationTable& table,
                                  bool training = true);

// GPT-2's initialisation, for every architecture (normal(0, 0.02); the projections into the
// residual stream 0.02/sqrt(2L); biases 0; norm weights 1) from a seed, into the flat parameter
// buffer. Deterministic.
void gpt2_init_params(const Gpt2Config& c, const ParamTable& table, float* params, uint64_t seed);

// Time spent per kind of op, for `headroom bench --breakdown` (milliseconds, accumulated).
enum class OpKind { kGemm, kAttention, kNorm, kElementwise, kLoss, kEmbedding, kCount };
std::string_view op_kind_name(OpKind k);
// With `record`, also every kernel call and every op of gpt2_step_ops (op = its index there),
// in microseconds since `origin` (for `headroom train --profile`).
struct KernelSpan {
  OpKind kind;
  int op;
  double start_us, dur_us;
};
struct OpSpan {
  int op;
  double start_us, dur_us;
};
struct OpTimes {
  std::array<double, size_t(OpKind::kCount)> ms{};
  // The same calls' process CPU time (every thread's: two busy threads count twice their wall
  // time), which a shared host's scheduling does not inflate.
  std::array<double, size_t(OpKind::kCount)> cpu_ms{};
  bool record = false;
  std::chrono::steady_clock::time_point origin;
  std::vector<KernelSpan> kernels;
  std::vector<OpSpan> ops;
  // With `record`: every op boundary also goes to this recorder (memory events of the plan).
  EventRecorder* events = nullptr;
};

// Per-block hooks of the executor (docs/notes/zero.md, "Executor hooks"): where each op reads its
// parameters and writes its gradients, and calls around every op. ZeRO-3 gathers a block's
// parameters in before() and releases them in after(); ZeRO-2/3 hand a block's finished gradients
// to the communication thread in after() of its backward, while backward continues. Without hooks
// the executor reads and writes the bound flat buffers.
//
// Sites: layer -1 is the embedding (wte, wpe; its backward writes their gradients), 0..n_layer-1
// the blocks, n_layer the head (ln_f and the tied wte or the untied head; its backward writes
// their gradients). The
// executor calls before(phase, layer) and after(phase, layer) around every op of gpt2_step_ops, in
// that order; an op reads param(i) and writes grad(i) only for tensors i of its site (the head
// also reads wte). Hooks run on the training thread between the op's kernels, never inside them.
class BlockHooks {
 public:
  static constexpr int kEmbedding = -1;
  virtual ~BlockHooks() = default;
  virtual void before(OpDesc::Phase phase, int layer) = 0;
  virtual void after(OpDesc::Phase phase, int layer) = 0;
  // Tensor i of the ParamTable (its numel floats). Valid from before() to after() of an op that
  // uses it.
  virtual float* param(size_t tensor) = 0;
  virtual float* grad(size_t tensor) = 0;
};

// The element type of the GEMM weights for activations of type T: T itself, except for f16,
// whose GEMMs read fp32 weights holding f16 values (cpu kernels.h, fp16 section).
template <typename T>
using GemmWeightT = backend::Ops::GemmWeight<T>;

// Forward and backward over bound buffers, through the backend's ops. Not thread-safe (the
// kernels use OpenMP inside).
class Gpt2 {
 public:
  Gpt2(const Gpt2Config& config, const ParamTable* table,
       const backend::Ops& ops = backend::cpu_ops())
      : config_(config), table_(table), ops_(&ops) {}

  // params: flat buffer of table->total_floats; grads: the same shape, or null for inference.
  // With bf16 precision, params_bf16 is the bf16 copy of params (same offsets) that the GEMMs
  // read; params stay the fp32 master weights (embeddings, biases and LayerNorm read them).
  void bind_params(float* params, float* grads, const bf16_t* params_bf16 = nullptr);
  // With hooks (not owned; null = none), parameters and gradients come from them instead of the
  // bound buffers (which may then be null). The persistent bf16 copy indexes the bound fp32
  // buffer, so hooks that move parameters need the per-layer cast (bf16_weight_copy false).
  void set_block_hooks(BlockHooks* hooks) { hooks_ = hooks; }
  // The arena must hold the buffers of `table` (from gpt2_activation_table for B, T) in order.
  void bind_activations(const memory::Arena* arena, const ActivationTable* table, int B, int T);

  // Runs the forward pass on inputs[B*T] (token ids < vocab_size). With targets (-1 = ignore),
  // also computes the per-token losses; returns their sum and sets *valid to the count of
  // non-ignored targets. Without targets returns 0. Logits stay in logits() until backward
  // (plain head only: the fused head never holds them, and needs targets), or, after
  // set_next_dloss and with targets, are replaced by their gradient in this forward.
  double forward(const int32_t* inputs, const int32_t* targets, int64_t* valid = nullptr,
                 int T_used = 0);
  // Backward of dloss * sum(losses) after forward() with the same inputs and targets; adds the
  // parameter gradients into the bound grads. Overwrites the logits with their gradient.
  void backward(const int32_t* inputs, const int32_t* targets, float dloss);
  // A training step's loss gradient, given before its forward (Note [One-pass loss and gradient]
  // in docs/notes/loss.md). For the next forward() only: with targets and a head that keeps the
  // full logits, that forward turns them into their gradient in the same pass as the loss (the
  // logits are read from memory once, not twice), logits() hold the gradient from then on, and
  // the backward() after it must be given the same dloss (checked: it aborts otherwise) and
  // finds that gradient ready. Every loss and gradient is the same bits as without it. Without it
  // (evaluation, generation, a caller that learns dloss later) the forward keeps the logits and
  // the backward computes their gradient in a second pass. No effect with the fused head.
  void set_next_dloss(float dloss) { next_dloss_ = dloss; }
  // Distillation (ExecOptions::distill): the teacher the next forward/backward pairs read (not
  // owned; valid until both ran); null: the plain CE head. The CE part of the last forward's
  // loss sum (equal to forward()'s return without a teacher).
  void set_teacher(const backend::KdTeacher* teacher) { teacher_ = teacher; }
  double last_ce_sum() const { return last_ce_sum_; }
  // After a hidden_only forward (a teacher): the KD head's teacher side, its final norm's output
  // [B*T, C] and its head's weight in its precision (fp32, or the bf16 cast in its step buffer).
  backend::KdTeacher kd_teacher() const;

  // The logits [B*T, V] of the last forward, row r at logits() + r * logits_row_stride(). Holding
  // their gradient in bf16 (see set_next_dloss), row r's bf16 values start at the same place.
  const float* logits() const;
  int64_t logits_row_stride() const;
  // Columns the head's forward GEMM (full or fused) computes for the weight wte, with T the
  // activations' storage: V, or (bf16 with the weight copy) logits_row_stride() where the
  // weight's memory holds that many rows (Note [The head's padded columns] in gpt2.cc). Columns
  // past V are never read.
  template <typename T>
  int head_forward_columns(const float* wte) const;
  // The offload tier (an arena of table->offload_buffers, laid out as the plan's offload
  // region) and the copy thread, for a table with offloaded blocks; null to unbind. Both must
  // outlive the forward/backward calls.
  void bind_offload(const memory::Arena* tier, OffloadCopier* copier) {
    offload_tier_ = tier;
    copier_ = copier;
  }
  // With a non-null `times`, every kernel call is timed into it (costs two clock reads a call).
  void set_op_times(OpTimes* times) { times_ = times; }
  int B() const { return B_; }
  int T() const { return T_; }
  const Gpt2Config& config() const { return config_; }
  const backend::Ops& ops() const { return *ops_; }

 private:
  struct LayerParams {
    float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *attproj_w, *attproj_b, *ln2_w, *ln2_b, *fc_w, *fc_b,
        *fcproj_w, *fcproj_b;
  };
  // Block l's parameters (grads == false) or gradients, from the hooks or the bound buffers.
  LayerParams layer_params(int l, bool grads) const;
  float* param_ptr(size_t tensor) const;
  float* grad_ptr(size_t tensor) const;
  void hook_before(OpDesc::Phase phase, int layer) {
    if (hooks_) hooks_->before(phase, layer);
  }
  void hook_after(OpDesc::Phase phase, int layer) {
    if (hooks_) hooks_->after(phase, layer);
  }
  template <typename F>
  void timed(OpKind kind, F&& f);
  // Runs block l's forward from input x into the buffers `s`; with_output == false stops before
  // the MLP projection (a recomputation does not need the block's output). T is the storage type
  // of the GEMM-side activations (float, or bf16_t with bf16 precision).
  template <typename T>
  void block_forward(int l, const Gpt2ActivationIds::Layer& s, const float* x, bool with_output);
  template <typename T>
  double forward_t(const int32_t* inputs, const int32_t* targets, int64_t* valid);
  template <typename T>
  void backward_t(const int32_t* inputs, const int32_t* targets, float dloss);
  // The GEMM copy of a weight: itself in fp32, its bf16 copy with bf16 precision (from the
  // persistent copy, or from the step buffer it was last cast into).
  template <typename T>
  const GemmWeightT<T>* gemm_weight(const float* w) const;
  // Without the persistent bf16 copy: casts block l's GEMM weights (the LM head's) into their
  // step buffer; gemm_weight then finds them there. No-ops otherwise.
  void cast_block_weights(int l);
  void cast_head_weights();
  // Ends the current op's span and starts op `next` (-1: none), when recording.
  void op_boundary(int next);
  // Activation offload: queue block l's copy to the offload tier / back to its landing buffers
  // (no-ops for a block that is not offloaded), and wait for them.
  void offload_out(int l);
  void prefetch_in(int l);
  void wait_out(int l);
  void wait_in(int l);

  // The norm ops of the architecture (LayerNorm or RMSNorm; bias and mean null for RMSNorm).
  template <typename S>
  void norm_forward(S* out, float* mean, float* rstd, const float* inp, const float* w,
                    const float* b, int N);
  // The fused LM head's weight (wte when tied) and its table index.
  const float* head_weight() const { return param_ptr(table_->head); }
  void fill_rope();

  Gpt2Config config_;
  const ParamTable* table_;
  const backend::Ops* ops_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  const bf16_t* params_bf16_ = nullptr;
  BlockHooks* hooks_ = nullptr;
  // Weights cast on the fly: master pointer -> its bf16 cast, or its f16-valued fp32 copy (at
  // most 5: a block's 4 and wte).
  struct Cast {
    const float* src;
    const void* dst;
  };
  std::array<Cast, 5> casts_{};
  const memory::Arena* arena_ = nullptr;
  const ActivationTable* acts_ = nullptr;
  int B_ = 0, T_ = 0;
  int T_used_ = 0;  // the T of the last forward (<= T_), for inference on shorter prompts
  // set_next_dloss's value until a forward takes it; then, where that forward turned the logits
  // into their gradient, the dloss it used, until the backward that takes it.
  std::optional<float> next_dloss_, dlogits_dloss_;
  const memory::Arena* offload_tier_ = nullptr;
  OffloadCopier* copier_ = nullptr;
  std::vector<uint64_t> out_tickets_, in_tickets_;  // per block; 0: nothing pending
  OpTimes* times_ = nullptr;
  const backend::KdTeacher* teacher_ = nullptr;
  double last_ce_sum_ = 0;
  int op_base_ = 0;  // the index of this model's first op in gpt2_step_ops (after a teacher's)
  int cur_op_ = -1;
  std::chrono::steady_clock::time_point cur_op_start_;
  bool nvtx_op_open_ = false;  // an op's NVTX range is pushed (op_boundary pops it)
};

// The generic names (GPT-2's stay for the code written first).
using Transformer = Gpt2;
using TransformerActivationIds = Gpt2ActivationIds;
inline ParamTable param_table(const TransformerConfig& c) { return gpt2_param_table(c); }

}  // namespace headroom::model
