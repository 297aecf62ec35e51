// GPT-2 parameter and activation tables, initialisation, forward and backward.
#include "model/gpt2.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <optional>
#include <random>
#include <type_traits>
#include <utility>

#include "backend/nvtx.h"
#include "core/check.h"
#include "core/cpu_time.h"

namespace headroom::model {

using memory::BufferDesc;
using memory::Category;

// The fewest rows of the LM head's dlogits^T the bf16 staging takes at once (the head's weight
// gradient goes through them in chunks): 3072, the MLP's width at GPT-2 124M, whose blocks size
// the staging for that many rows already, and a GEMM (M = 3072, K = tokens, N = C) that runs at
// full rate.
constexpr int64_t kHeadWgradRows = 3072;

std::string_view op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kGemm:
      return "gemm";
    case OpKind::kAttention:
      return "attention";
    case OpKind::kNorm:
      return "norm";
    case OpKind::kElementwise:
      return "elementwise";
    case OpKind::kLoss:
      return "loss";
    case OpKind::kEmbedding:
      return "embedding";
    case OpKind::kCount:
      break;
  }
  return "?";
}

int ParamTable::group_of(const ParamDesc& p) const {
  return p.site == int(layers.size()) ? INT32_MAX : p.site;
}

int64_t ParamTable::end_of(const ParamDesc& p) {
  return (p.offset + p.shape.numel() + 15) / 16 * 16;
}

const ParamDesc* ParamTable::find(std::string_view name) const {
  for (const ParamDesc& p : params) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

ParamTable gpt2_param_table(const Gpt2Config& c) {
  ParamTable t;
  const int64_t C = c.n_embd, L = c.n_layer;
  // `fuse`: the next tensor follows this one without padding (one GEMM's weight or bias).
  std::vector<bool> fuse_next;
  auto add = [&](std::string name, Shape shape, int site, bool fuse = false) {
    bool decay = shape.rank() >= 2;
    t.num_parameters += shape.numel();
    t.params.push_back({std::move(name), std::move(shape), decay, 0, site});
    fuse_next.push_back(fuse);
    return t.params.size() - 1;
  };
  const size_t none = ParamTable::kNone;
  if (c.is_gpt2()) {
    t.wte = add("wte.weight", {c.vocab_size, C}, -1);
    t.wpe = add("wpe.weight", {c.n_positions, C}, -1);
    for (int l = 0; l < c.n_layer; l++) {
      std::string p = "h." + std::to_string(l) + ".";
      ParamTable::Layer y;
      y.ln1_w = add(p + "ln_1.weight", {C}, l);
      y.ln1_b = add(p + "ln_1.bias", {C}, l);
      // q | k | v, each A = n_head x head_size wide (C unless head_dim says otherwise).
      const int64_t QKV = c.qkv_width();
      y.qkv_w = add(p + "attn.c_attn.weight", {C, QKV}, l);
      y.qkv_b = add(p + "attn.c_attn.bias", {QKV}, l);
      y.attproj_w = add(p + "attn.c_proj.weight", {c.attn_width(), C}, l);
      y.attproj_b = add(p + "attn.c_proj.bias", {C}, l);
      y.ln2_w = add(p + "ln_2.weight", {C}, l);
      y.ln2_b = add(p + "ln_2.bias", {C}, l);
      // The MLP's width: 4C unless config.json's n_inner says otherwise (a pruned MLP).
      const int64_t I = c.mlp_width();
      y.fc_w = add(p + "mlp.c_fc.weight", {C, I}, l);
      y.fc_b = add(p + "mlp.c_fc.bias", {I}, l);
      y.fcproj_w = add(p + "mlp.c_proj.weight", {I, C}, l);
      y.fcproj_b = add(p + "mlp.c_proj.bias", {C}, l);
      t.layers.push_back(y);
    }
    t.lnf_w = add("ln_f.weight", {C}, int(L));
    t.lnf_b = add("ln_f.bias", {C}, int(L));
    t.head = t.wte;
  } else {
    // The Llama family (Hugging Face's LlamaForCausalLM names; Linear weights [out, in]).
    const int64_t HS = c.head_size(), Q = c.n_head * HS, KV = int64_t(c.kv_heads()) * HS;
    const int64_t I = c.mlp_width();
    t.wte = add("model.embed_tokens.weight", {c.vocab_size, C}, -1);
    // An untied head sits next to the embedding in the buffer but in the head's site: ZeRO-3
    // makes it a unit of its own (the head site's decayed unit, ln_f its other), gathered for
    // the head into the embedding's window, which the embedding releases after its forward
    // (docs/notes/zero.md, "An untied head").
    t.head = c.tied_head ? t.wte : add("lm_head.weight", {c.vocab_size, C}, int(L));
    for (int l = 0; l < c.n_layer; l++) {
      std::string p = "model.layers." + std::to_string(l) + ".";
      ParamTable::Layer y{};
      y.ln1_w = add(p + "input_layernorm.weight", {C}, l);
      y.ln1_b = none;
      y.qkv_w = add(p + "self_attn.q_proj.weight", {Q, C}, l, true);
      add(p + "self_attn.k_proj.weight", {KV, C}, l, true);
      add(p + "self_attn.v_proj.weight", {KV, C}, l);
      y.qkv_b = none;
      if (c.qkv_bias) {
        y.qkv_b = add(p + "self_attn.q_proj.bias", {Q}, l, true);
        add(p + "self_attn.k_proj.bias", {KV}, l, true);
        add(p + "self_attn.v_proj.bias", {KV}, l);
      }
      y.attproj_w = add(p + "self_attn.o_proj.weight", {C, Q}, l);
      y.attproj_b = none;
      y.ln2_w = add(p + "post_attention_layernorm.weight", {C}, l);
      y.ln2_b = none;
      y.fc_w = add(p + "mlp.gate_proj.weight", {I, C}, l, true);
      add(p + "mlp.up_proj.weight", {I, C}, l);
      y.fc_b = none;
      y.fcproj_w = add(p + "mlp.down_proj.weight", {C, I}, l);
      y.fcproj_b = none;
      t.layers.push_back(y);
    }
    t.lnf_w = add("model.norm.weight", {C}, int(L));
  }
  // Offsets: decayed tensors first, then the rest, so the optimizer and the gradient norm run
  // over two contiguous ranges instead of one call per tensor. 64-byte alignment per tensor
  // (a fused group's first); the padding stays zero in parameters and gradients.
  for (bool decay : {true, false}) {
    if (!decay) t.decay_floats = t.total_floats;
    for (size_t i = 0; i < t.params.size(); i++) {
      ParamDesc& p = t.params[i];
      if (p.decay != decay) continue;
      p.offset = t.total_floats;
      const bool fused = fuse_next[i];
      HR_CHECK(!fused || (i + 1 < t.params.size() && t.params[i + 1].decay == decay));
      t.total_floats += fused ? p.shape.numel() : (p.shape.numel() + 15) / 16 * 16;
    }
  }
  return t;
}

int64_t ExecOptions::mlp_row_stride(int64_t four_c, const backend::Ops& ops) const {
  // bf16 rows of 4C = 3072 are 6 KiB apart, not a multiple of 4 KiB: no padding, and oneDNN's
  // AMX kernels take dense rows (padded ones fell back to its slower gemm:jit path).
  const int64_t elem = precision == Precision::kFp32 ? 4 : 2;
  return pad_rows ? ops.activation_row_stride(four_c, elem) : four_c;
}

int64_t ExecOptions::logits_row_stride(int64_t V, const backend::Ops& ops) const {
  return pad_rows ? ops.logits_row_stride(V) : V;
}

std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "?";
}

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone:
      return "none";
    case Recompute::kSelective:
      return "selective";
    case Recompute::kFull:
      return "full";
  }
  return "?";
}

const OffloadBlock* ActivationTable::offload_of(int layer) const {
  for (const OffloadBlock& b : offloaded) {
    if (b.layer == layer) return &b;
  }
  return nullptr;
}

namespace {
// Moves every id of `id` by `by` (a table appended to another's buffers); SIZE_MAX stays.
void shift_ids(Gpt2ActivationIds& id, size_t by) {
  auto mv = [by](size_t& i) {
    if (i != SIZE_MAX) i += by;
  };
  for (size_t* f : {&id.encoded,
                    &id.rope,
                    &id.lnf,
                    &id.lnf_mean,
                    &id.lnf_rstd,
                    &id.logits,
                    &id.head_lse,
                    &id.head_scratch,
                    &id.kd_teacher_logits,
                    &id.losses,
                    &id.att_fwd_scratch,
                    &id.dresidual,
                    &id.d_c,
                    &id.d_3c,
                    &id.d_4c,
                    &id.att_scratch,
                    &id.dresidual_low,
                    &id.block_weights_bf16,
                    &id.head_weights_bf16,
                    &id.f16_staging,
                    &id.bf16_wgrad_staging}) {
    mv(*f);
  }
  for (std::vector<Gpt2ActivationIds::Layer>* v : {&id.fwd, &id.bwd}) {
    for (Gpt2ActivationIds::Layer& L : *v) {
      for (size_t* f : {&L.ln1, &L.ln1_mean, &L.ln1_rstd, &L.qkv, &L.atty, &L.att, &L.residual2,
                        &L.ln2, &L.ln2_mean, &L.ln2_rstd, &L.fch, &L.fch_gelu, &L.residual3}) {
        mv(*f);
      }
    }
  }
}

// The teacher's execution: forward only, to its final norm; tiled attention (no T x T
// probabilities); in bf16 its GEMM weights cast per layer into its working set (there is no
// persistent bf16 copy of a teacher).
ExecOptions teacher_exec(const Distill& d, bool pad_rows) {
  ExecOptions e;
  e.tiled_attention = true;
  e.head_chunk = 0;
  e.hidden_only = true;
  e.pad_rows = pad_rows;
  e.precision = d.teacher_precision;
  e.bf16_weight_copy = false;
  return e;
}
}  // namespace

ActivationTable gpt2_activation_table(const Gpt2Config& c, int B, int T, bool training,
                                      const ExecOptions& options, const backend::Ops& ops) {
  HR_CHECK(options.recompute.empty() || int(options.recompute.size()) == c.n_layer);
  HR_CHECK(options.offload.empty() || int(options.offload.size()) == c.n_layer);
  for (int l = 0; l < c.n_layer; l++) {
    HR_CHECK_MSG(!(options.offload_at(l) && options.recompute_at(l) == Recompute::kFull),
                 "a fully recomputed block keeps nothing to offload");
  }
  HR_CHECK_MSG(options.precision == Precision::kFp32 || options.tiled_attention,
               "bf16 and fp16 precision need tiled attention");
  ActivationTable t;
  t.options = options;
  // The GEMM-side activations (and their gradients) take the precision's storage type; the
  // residual stream, statistics, losses and scratch of fp32 arithmetic stay fp32.
  const DType low = options.precision == Precision::kBf16   ? DType::kBF16
                    : options.precision == Precision::kFp16 ? DType::kF16
                                                            : DType::kF32;
  auto add_as = [&](DType dtype, std::string name, Shape shape, Category cat) {
    t.buffers.push_back({std::move(name), dtype, std::move(shape), cat});
    return t.buffers.size() - 1;
  };
  auto add = [&](std::string name, Shape shape, Category cat) {
    return add_as(DType::kF32, std::move(name), std::move(shape), cat);
  };
  auto add_low = [&](std::string name, Shape shape, Category cat) {
    return add_as(low, std::move(name), std::move(shape), cat);
  };
  const int64_t C = c.n_embd, NH = c.n_head, V = c.vocab_size;
  const int NKV = c.kv_heads();
  const Category A = Category::kActivations;
  const bool tiled = options.tiled_attention;
  const bool rms = c.norm == NormKind::kRmsNorm;
  // The MLP's wide activations get padded rows (cpu::activation_row_stride): its first GEMM's
  // output (4C, or gate | up) and the activation's (4C, or the intermediate size).
  const int64_t ld_fc = options.mlp_row_stride(c.fc_width(), ops);
  const int64_t ld_act = options.mlp_row_stride(c.mlp_width(), ops);
  const int64_t QKV = c.qkv_width();
  // The attention's width (Note [Attention width] in docs/notes/pruning.md): its output and the
  // output projection's input, C unless head_dim says otherwise.
  const int64_t AW = c.attn_width();
  // One block's GEMM weights, in floats: q|k|v, the attention's projection, the MLP's two.
  const int64_t block_gemm = C * QKV + AW * C + C * c.fc_width() + int64_t(c.mlp_width()) * C;
  auto att_shape = [&]() { return tiled ? Shape{B, NH, T} : Shape{B, NH, T, T}; };
  // Every buffer of one block, named by `prefix`, tagged `cat`.
  auto block = [&](const std::string& p, Category cat, bool with_output) {
    Gpt2ActivationIds::Layer L;
    L.ln1 = add_low(p + "ln1", {B, T, C}, cat);
    L.ln1_mean = rms ? SIZE_MAX : add(p + "ln1_mean", {B, T}, cat);
    L.ln1_rstd = add(p + "ln1_rstd", {B, T}, cat);
    L.qkv = add_low(p + "qkv", {B, T, QKV}, cat);
    L.atty = add_low(p + "atty", {B, T, AW}, cat);
    L.att = add(p + (tiled ? "att_lse" : "att"), att_shape(), cat);
    L.residual2 = add(p + "residual2", {B, T, C}, cat);
    L.ln2 = add_low(p + "ln2", {B, T, C}, cat);
    L.ln2_mean = rms ? SIZE_MAX : add(p + "ln2_mean", {B, T}, cat);
    L.ln2_rstd = add(p + "ln2_rstd", {B, T}, cat);
    L.fch = add_low(p + "fch", {B, T, ld_fc}, cat);
    L.fch_gelu = add_low(p + "fch_gelu", {B, T, ld_act}, cat);
    L.residual3 = with_output ? add(p + "residual3", {B, T, C}, cat) : SIZE_MAX;
    return L;
  };
  t.ids.encoded = add("encoded", {B, T, C}, A);
  t.ids.rope = SIZE_MAX;
  if (c.positions == PositionKind::kRope) {
    const int64_t HS = c.head_size();
    t.ids.rope = add("rope_cos_sin", {int64_t(T) * HS + HS / 2}, A);
  }
  t.ids.block_weights_bf16 = t.ids.head_weights_bf16 = SIZE_MAX;
  if (low == DType::kBF16 && !options.bf16_weight_copy) {
    t.ids.block_weights_bf16 = add_low("block_weights_bf16", {block_gemm}, Category::kWeights);
    t.ids.head_weights_bf16 = add_low("head_weights_bf16", {V, C}, Category::kWeights);
  }
  t.ids.f16_staging = SIZE_MAX;
  if (low == DType::kF16) {
    // fp16 GEMMs read fp32 weights rounded to f16 values, cast per layer (no persistent copy:
    // see Note [fp16 GEMMs]), and widen their f16 activation operands into one staging area
    // sized for the largest: the MLP's [N, C] x [C, 4C] (the heads' need N x C at most).
    t.ids.block_weights_bf16 = add("block_weights_f16", {block_gemm}, Category::kWeights);
    t.ids.head_weights_bf16 = add("head_weights_f16", {V, C}, Category::kWeights);
    const int64_t N = int64_t(B) * T;
    size_t staging = 0;
    for (auto [ic, oc] : std::initializer_list<std::pair<int64_t, int64_t>>{
             {C, QKV}, {AW, C}, {C, c.fc_width()}, {c.mlp_width(), C}}) {
      staging = std::max(staging, ops.f16_matmul_staging_floats(N, ic, oc));
    }
    t.ids.f16_staging = add("f16_gemm_staging", {int64_t(staging)}, Category::kWorkspace);
  }
  for (int l = 0; l < c.n_layer; l++)
    t.ids.fwd.push_back(block("h." + std::to_string(l) + ".", A, true));
  t.ids.lnf = add_low("lnf", {B, T, C}, A);
  t.ids.lnf_mean = rms ? SIZE_MAX : add("lnf_mean", {B, T}, A);
  t.ids.lnf_rstd = add("lnf_rstd", {B, T}, A);
  t.ids.logits = t.ids.head_scratch = t.ids.head_lse = t.ids.losses = SIZE_MAX;
  HR_CHECK_MSG(!options.distill || options.head_chunk > 0,
               "distillation fuses its loss into the chunked LM head: it needs head_chunk > 0");
  HR_CHECK_MSG(!(options.hidden_only && (training || options.distill)),
               "a forward-only teacher (hidden_only) neither trains nor distils");
  if (!options.hidden_only) {  // a teacher's table stops at the final norm
    // Each row's log-sum-exp, saved by the loss's forward for its one-pass backward (both
    // heads); with distillation the KD head's four statistics per row (distill_kernels.h).
    t.ids.head_lse =
        add("head_lse", options.distill ? Shape{4, B, T} : Shape{B, T}, Category::kLogits);
    if (options.head_chunk > 0) {
      const int chunk = std::min(options.head_chunk, B * T);
      t.ids.head_scratch =
          add("head_logits_chunk", {int64_t(ops.lm_head_ce_scratch_floats(chunk, int(V), low))},
              Category::kLogits);
      if (options.distill) {  // the teacher's chunk of logits beside the student's
        t.ids.kd_teacher_logits =
            add_as(DType::kF32, "teacher.logits_chunk", {int64_t(chunk) * ops.logits_row_stride(V)},
                   Category::kTeacher);
      }
    } else {
      t.ids.logits = add("logits", {B, T, options.logits_row_stride(V, ops)}, Category::kLogits);
    }
    t.ids.losses = add("losses", {B, T}, Category::kLogits);
  }
  t.ids.att_fwd_scratch =
      tiled ? add("attention_forward_scratch",
                  {int64_t(ops.attention_tiled_scratch_floats(B, T, int(AW), c.n_head, NKV, low))},
                  Category::kWorkspace)
            : SIZE_MAX;
  if (!training) {
    t.ids.bwd = t.ids.fwd;
    t.ids.dresidual = t.ids.d_c = t.ids.d_3c = t.ids.d_4c = t.ids.att_scratch = SIZE_MAX;
    t.ids.dresidual_low = t.ids.bf16_wgrad_staging = SIZE_MAX;
    return t;
  }
  const Category W = Category::kWorkspace;
  t.ids.dresidual = add("d_residual", {B, T, C}, W);
  // d_c holds d(ln) (C wide) and the attention output's gradient (A wide) in turn.
  t.ids.d_c = add_low("d_c", {B, T, std::max(C, AW)}, W);
  t.ids.d_3c = add_low("d_3c", {B, T, QKV}, W);
  // The gradient of the MLP's activation output (GELU's runs in place there; SwiGLU's writes
  // gate|up's gradient over fch, which its backward no longer reads).
  t.ids.d_4c = add_low("d_4c", {B, T, ld_act}, W);
  t.ids.att_scratch = add(
      "attention_backward_scratch",
      {int64_t(tiled
                   ? ops.attention_tiled_backward_scratch_floats(B, T, int(AW), c.n_head, NKV, low)
                   : ops.attention_backward_scratch_floats(B, T, c.n_head, NKV))},
      W);
  // bf16: the transposed operands of the weight gradients, sized for the largest GEMM that
  // takes them (a block's inp^T + dout^T; the head's inp^T and at least kHeadWgradRows rows of
  // dlogits^T, which go through the rest in chunks; the fused head's GEMMs do not take them).
  t.ids.bf16_wgrad_staging = SIZE_MAX;
  if (low == DType::kBF16) {
    const int64_t N = int64_t(B) * T;
    int64_t elems = 0;
    for (auto [ic, oc] : std::initializer_list<std::pair<int64_t, int64_t>>{
             {C, QKV}, {AW, C}, {C, c.fc_width()}, {c.mlp_width(), C}}) {
      if (ops.bf16_wgrad_transposes(int(N), int(ic), int(oc))) {
        elems = std::max(elems, N * (ic + oc));
      }
    }
    if (t.ids.logits != SIZE_MAX && ops.bf16_wgrad_transposes(int(N), int(C), int(V))) {
      elems = std::max(elems, N * (C + std::min<int64_t>(V, kHeadWgradRows)));
    }
    if (elems > 0) t.ids.bf16_wgrad_staging = add_low("bf16_wgrad_staging", {elems}, W);
  }
  t.ids.dresidual_low =
      low == DType::kF32
          ? SIZE_MAX
          : add_low(low == DType::kF16 ? "d_residual_f16" : "d_residual_bf16", {B, T, C}, W);
  // Recomputation: backward reads recomputed values from buffers shared by all blocks.
  bool any_full = false, any_selective = false;
  for (Recompute r : options.recompute) {
    any_full |= r == Recompute::kFull;
    any_selective |= r == Recompute::kSelective;
  }
  std::optional<Gpt2ActivationIds::Layer> rc;
  // A recomputation stops before the block's output (block_forward's with_output).
  if (any_full) rc = block("recompute.", Category::kRecompute, false);
  size_t rc_ln1 = rc ? rc->ln1 : SIZE_MAX, rc_ln2 = rc ? rc->ln2 : SIZE_MAX;
  size_t rc_gelu = rc ? rc->fch_gelu : SIZE_MAX;
  if (any_selective && !rc) {
    rc_ln1 = add_low("recompute.ln1", {B, T, C}, Category::kRecompute);
    rc_ln2 = add_low("recompute.ln2", {B, T, C}, Category::kRecompute);
    rc_gelu = add_low("recompute.fch_gelu", {B, T, ld_act}, Category::kRecompute);
  }
  for (int l = 0; l < c.n_layer; l++) {
    Gpt2ActivationIds::Layer L = t.ids.fwd[size_t(l)];
    switch (options.recompute_at(l)) {
      case Recompute::kNone:
        break;
      case Recompute::kSelective:
        L.ln1 = rc_ln1;
        L.ln2 = rc_ln2;
        L.fch_gelu = rc_gelu;
        break;
      case Recompute::kFull: {
        const size_t out = L.residual3;  // the block's output stays the next block's input
        L = *rc;
        L.residual3 = out;
        break;
      }
    }
    t.ids.bwd.push_back(L);
  }
  // Activation offload (see docs/notes/offload-activations.md): every buffer the block's
  // backward reads from its own forward moves out to the offload tier and back into a landing
  // buffer of its own; the backward reads the landing buffers.
  for (int l = 0; l < c.n_layer; l++) {
    if (!options.offload_at(l)) continue;
    const Gpt2ActivationIds::Layer& F = t.ids.fwd[size_t(l)];
    Gpt2ActivationIds::Layer& Bw = t.ids.bwd[size_t(l)];
    OffloadBlock ob;
    ob.layer = l;
    for (size_t Gpt2ActivationIds::Layer::*field :
         {&Gpt2ActivationIds::Layer::ln1, &Gpt2ActivationIds::Layer::ln1_mean,
          &Gpt2ActivationIds::Layer::ln1_rstd, &Gpt2ActivationIds::Layer::qkv,
          &Gpt2ActivationIds::Layer::atty, &Gpt2ActivationIds::Layer::att,
          &Gpt2ActivationIds::Layer::residual2, &Gpt2ActivationIds::Layer::ln2,
          &Gpt2ActivationIds::Layer::ln2_mean, &Gpt2ActivationIds::Layer::ln2_rstd,
          &Gpt2ActivationIds::Layer::fch, &Gpt2ActivationIds::Layer::fch_gelu}) {
      const size_t saved = F.*field;
      if (saved == SIZE_MAX) continue;        // not in this architecture (RMSNorm's mean)
      if (Bw.*field != saved) continue;       // recomputed, not kept
      const BufferDesc d = t.buffers[saved];  // a copy: add_as below may reallocate
      const std::string base = d.name.substr(d.name.find('.', 2) + 1);  // "ln1" of "h.3.ln1"
      const std::string prefix = "h." + std::to_string(l) + ".";
      const size_t landing =
          add_as(d.dtype, prefix + "prefetch." + base, d.shape, Category::kStaging);
      t.offload_buffers.push_back({prefix + base, d.dtype, d.shape, Category::kOffload});
      ob.moves.push_back({saved, landing, t.offload_buffers.size() - 1});
      ob.bytes += d.bytes();
      Bw.*field = landing;
    }
    t.offloaded.push_back(std::move(ob));
  }
  if (options.distill) {
    // The teacher's forward-only working set, appended: the planner places it with the
    // student's buffers, so the teacher's layers reuse each other's memory and, once it has run,
    // the student's activations reuse it too (only its final norm's output stays live).
    HR_CHECK_MSG(options.distill->teacher_precision != Precision::kFp16,
                 "a teacher runs in fp32 or bf16");
    auto teacher = std::make_shared<ActivationTable>(
        gpt2_activation_table(options.distill->teacher, B, T, false,
                              teacher_exec(*options.distill, options.pad_rows), ops));
    const size_t base = t.buffers.size();
    for (BufferDesc b : teacher->buffers) {
      b.name = "teacher." + b.name;
      b.category = Category::kTeacher;
      t.buffers.push_back(std::move(b));
    }
    shift_ids(teacher->ids, base);
    teacher->buffers = t.buffers;  // its ids index the whole list
    t.teacher = std::move(teacher);
  }
  return t;
}

std::vector<OpDesc> gpt2_step_ops(const Gpt2Config& c, const ActivationTable& table,
                                  bool training) {
  using Phase = OpDesc::Phase;
  const Gpt2ActivationIds& id = table.ids;
  std::vector<OpDesc> ops;
  const int L = c.n_layer;
  auto input_of = [&](int l) { return l == 0 ? id.encoded : id.fwd[size_t(l - 1)].residual3; };
  auto fields = [](const Gpt2ActivationIds::Layer& s) {
    return std::vector<size_t>{s.ln1,       s.ln1_mean, s.ln1_rstd, s.qkv,      s.atty, s.att,
                               s.residual2, s.ln2,      s.ln2_mean, s.ln2_rstd, s.fch,  s.fch_gelu};
  };
  auto push = [&](std::string name, Phase ph, int layer, std::vector<size_t> bufs) {
    std::erase(bufs, SIZE_MAX);
    ops.push_back({std::move(name), ph, layer, std::move(bufs)});
  };
  // Distillation: the teacher's forward first (op names "teacher ...", layer -1), and its
  // outputs that the student's head reads on to that head's backward.
  std::vector<size_t> teacher_out;
  if (table.teacher) {
    const Distill& d = *table.options.distill;
    for (OpDesc op : gpt2_step_ops(d.teacher, *table.teacher, false)) {
      op.name = "teacher " + op.name;
      op.layer = -1;
      ops.push_back(std::move(op));
    }
    teacher_out = {table.teacher->ids.lnf, table.teacher->ids.head_weights_bf16,
                   id.kd_teacher_logits};
    std::erase(teacher_out, SIZE_MAX);
  }
  push("forward embedding", Phase::kForward, -1, {id.encoded, id.rope});
  // Offload: block l's saved buffers stay live through the next forward op (the copy out runs
  // during it), and its landing buffers from the backward op before its own (the prefetch).
  auto saved_of = [&](int l) {
    std::vector<size_t> b;
    if (const OffloadBlock* ob = l >= 0 && l < L ? table.offload_of(l) : nullptr) {
      for (const OffloadMove& m : ob->moves) b.push_back(m.saved);
    }
    return b;
  };
  auto landing_of = [&](int l) {
    std::vector<size_t> b;
    if (const OffloadBlock* ob = l >= 0 && l < L ? table.offload_of(l) : nullptr) {
      for (const OffloadMove& m : ob->moves) b.push_back(m.landing);
    }
    return b;
  };
  for (int l = 0; l < L; l++) {
    std::vector<size_t> b = fields(id.fwd[size_t(l)]);
    b.insert(b.end(), {input_of(l), id.fwd[size_t(l)].residual3, id.att_fwd_scratch,
                       id.block_weights_bf16, id.f16_staging, id.rope});
    if (training) std::ranges::copy(saved_of(l - 1), std::back_inserter(b));
    push("forward h." + std::to_string(l), Phase::kForward, l, std::move(b));
  }
  std::vector<size_t> head = {
      input_of(L), id.lnf,          id.lnf_mean, id.lnf_rstd,          id.logits,
      id.head_lse, id.head_scratch, id.losses,   id.head_weights_bf16, id.f16_staging};
  if (training) std::ranges::copy(saved_of(L - 1), std::back_inserter(head));
  std::ranges::copy(teacher_out, std::back_inserter(head));
  push("forward head", Phase::kForward, -1, std::move(head));
  if (!training) return ops;
  std::vector<size_t> bhead = {input_of(L),          id.lnf,         id.lnf_mean,
                               id.lnf_rstd,          id.logits,      id.head_lse,
                               id.head_scratch,      id.d_c,         id.dresidual,
                               id.head_weights_bf16, id.f16_staging, id.bf16_wgrad_staging};
  std::ranges::copy(landing_of(L - 1), std::back_inserter(bhead));
  std::ranges::copy(teacher_out, std::back_inserter(bhead));
  push("backward head", Phase::kBackward, -1, std::move(bhead));
  const size_t dres_low = id.dresidual_low;
  for (int l = L - 1; l >= 0; l--) {
    // The backward of block l reads its saved (or recomputed) buffers but not its own output,
    // which block l+1 already consumed. Selective recomputation also reads the saved
    // buffers that the recomputed ones are made from (e.g. fch for fch_gelu).
    std::vector<size_t> b = fields(id.bwd[size_t(l)]);
    if (table.options.recompute_at(l) == Recompute::kSelective) {
      b.insert(b.end(), {id.bwd[size_t(l)].fch, id.bwd[size_t(l)].residual2});
    }
    if (table.options.recompute_at(l) == Recompute::kFull) b.push_back(id.att_fwd_scratch);
    b.insert(b.end(),
             {input_of(l), id.dresidual, id.d_c, id.d_3c, id.d_4c, id.att_scratch, dres_low,
              id.block_weights_bf16, id.f16_staging, id.bf16_wgrad_staging, id.rope});
    std::ranges::copy(landing_of(l - 1), std::back_inserter(b));  // block l-1's prefetch
    push("backward h." + std::to_string(l), Phase::kBackward, l, std::move(b));
  }
  push("backward embedding", Phase::kBackward, -1, {id.dresidual});
  return ops;
}

void gpt2_init_params(const Gpt2Config& c, const ParamTable& table, float* params, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const float residual_std = 0.02f / std::sqrt(2.0f * float(c.n_layer));
  for (const ParamDesc& p : table.params) {
    float* w = params + p.offset;
    const int64_t n = p.shape.numel();
    const bool is_bias = p.name.ends_with(".bias");
    const bool is_ln = p.shape.rank() == 1 && !is_bias;  // a norm's weight
    if (is_ln) {
      for (int64_t i = 0; i < n; i++) w[i] = 1.0f;
    } else if (is_bias) {
      for (int64_t i = 0; i < n; i++) w[i] = 0.0f;
    } else {
      const bool residual = p.name.ends_with("c_proj.weight") ||
                            p.name.ends_with("o_proj.weight") ||
                            p.name.ends_with("down_proj.weight");
      std::normal_distribution<float> dist(0.0f, residual ? residual_std : 0.02f);
      for (int64_t i = 0; i < n; i++) w[i] = dist(rng);
    }
  }
}

void Gpt2::bind_params(float* params, float* grads, const bf16_t* params_bf16) {
  params_ = params;
  grads_ = grads;
  params_bf16_ = params_bf16;
}

template <typename T>
const GemmWeightT<T>* Gpt2::gemm_weight(const float* w) const {
  if constexpr (std::is_same_v<T, float>) {
    return w;
  } else {
    if (std::is_same_v<T, bf16_t> && acts_->options.bf16_weight_copy) {
      HR_CHECK_MSG(params_bf16_ != nullptr && params_ != nullptr,
                   "bf16 precision needs the bf16 weight copy bound");
      return reinterpret_cast<const GemmWeightT<T>*>(params_bf16_ + (w - params_));
    }
    for (const Cast& c : casts_) {
      if (c.src == w) return static_cast<const GemmWeightT<T>*>(c.dst);
    }
    HR_CHECK_MSG(false, "a low-precision GEMM weight was used before it was cast");
    return nullptr;
  }
}

void Gpt2::cast_block_weights(int l) {
  const Gpt2ActivationIds& id = acts_->ids;
  if (id.block_weights_bf16 == SIZE_MAX) return;
  const int64_t C = config_.n_embd;
  const LayerParams w = layer_params(l, false);
  const bool f16 = acts_->options.precision == Precision::kFp16;
  char* dst = static_cast<char*>(arena_->data(id.block_weights_bf16));
  const std::array<std::pair<const float*, int64_t>, 4> parts = {
      {{w.qkv_w, C * config_.qkv_width()},
       {w.attproj_w, config_.attn_width() * C},
       {w.fc_w, C * config_.fc_width()},
       {w.fcproj_w, int64_t(config_.mlp_width()) * C}}};
  timed(OpKind::kElementwise, [&] {
    for (size_t i = 0; i < parts.size(); i++) {
      if (f16) {
        ops_->round_to_f16_values(reinterpret_cast<float*>(dst), parts[i].first, parts[i].second);
      } else {
        ops_->cast_to_bf16(reinterpret_cast<bf16_t*>(dst), parts[i].first, parts[i].second);
      }
      casts_[i] = {parts[i].first, dst};
      dst += parts[i].second * (f16 ? 4 : 2);
    }
  });
}

void Gpt2::cast_head_weights() {
  const Gpt2ActivationIds& id = acts_->ids;
  if (id.head_weights_bf16 == SIZE_MAX) return;
  const float* wte = head_weight();
  void* dst = arena_->data(id.head_weights_bf16);
  const int64_t n = int64_t(config_.vocab_size) * config_.n_embd;
  timed(OpKind::kElementwise, [&] {
    if (acts_->options.precision == Precision::kFp16) {
      ops_->round_to_f16_values(static_cast<float*>(dst), wte, n);
    } else {
      ops_->cast_to_bf16(static_cast<bf16_t*>(dst), wte, n);
    }
  });
  casts_[4] = {wte, dst};
}

void Gpt2::bind_activations(const memory::Arena* arena, const ActivationTable* table, int B,
                            int T) {
  arena_ = arena;
  acts_ = table;
  B_ = B;
  T_ = T;
  // A teacher's forward ops come first in the step's schedule (gpt2_step_ops).
  op_base_ =
      table->teacher && table->options.distill ? table->options.distill->teacher.n_layer + 2 : 0;
  dlogits_dloss_.reset();  // a gradient in the old arena
}

float* Gpt2::param_ptr(size_t tensor) const {
  return hooks_ ? hooks_->param(tensor) : params_ + table_->params[tensor].offset;
}

float* Gpt2::grad_ptr(size_t tensor) const {
  return hooks_ ? hooks_->grad(tensor) : grads_ + table_->params[tensor].offset;
}

Gpt2::LayerParams Gpt2::layer_params(int l, bool grads) const {
  const ParamTable::Layer& y = table_->layers[size_t(l)];
  auto at = [&](size_t i) -> float* {
    if (i == ParamTable::kNone) return nullptr;
    return grads ? grad_ptr(i) : param_ptr(i);
  };
  return {at(y.ln1_w), at(y.ln1_b), at(y.qkv_w), at(y.qkv_b), at(y.attproj_w), at(y.attproj_b),
          at(y.ln2_w), at(y.ln2_b), at(y.fc_w),  at(y.fc_b),  at(y.fcproj_w),  at(y.fcproj_b)};
}

template <typename F>
void Gpt2::timed(OpKind kind, F&& f) {
  if (!times_) {
    f();
    return;
  }
  const double c0 = process_cpu_ms();
  auto t0 = std::chrono::steady_clock::now();
  f();
  auto t1 = std::chrono::steady_clock::now();
  times_->cpu_ms[size_t(kind)] += process_cpu_ms() - c0;
  times_->ms[size_t(kind)] += std::chrono::duration<double, std::milli>(t1 - t0).count();
  if (times_->record) {
    using us = std::chrono::duration<double, std::micro>;
    times_->kernels.push_back(
        {kind, cur_op_, us(t0 - times_->origin).count(), us(t1 - t0).count()});
  }
}

// The name of op `i` of gpt2_step_ops for an L-block model (the same names, without building
// the table): the NVTX range of each op.
static std::string step_op_name(int L, int i) {
  if (i == 0) return "forward embedding";
  if (i <= L) return "forward h." + std::to_string(i - 1);
  if (i == L + 1) return "forward head";
  if (i == L + 2) return "backward head";
  if (i <= 2 * L + 2) return "backward h." + std::to_string(L - 1 - (i - L - 3));
  return "backward embedding";
}

void Gpt2::op_boundary(int next) {
  // Nsight Systems: one NVTX range per op of the schedule, whether or not times are kept.
  if constexpr (backend::nvtx::kEnabled) {
    if (nvtx_op_open_) backend::nvtx::pop();
    nvtx_op_open_ = next >= 0;
    if (nvtx_op_open_) backend::nvtx::push(step_op_name(config_.n_layer, next).c_str());
  }
  if (!times_ || !times_->record) return;
  if (next >= 0) next += op_base_;
  auto now = std::chrono::steady_clock::now();
  using us = std::chrono::duration<double, std::micro>;
  if (cur_op_ >= 0) {
    times_->ops.push_back(
        {cur_op_, us(cur_op_start_ - times_->origin).count(), us(now - cur_op_start_).count()});
  }
  if (times_->events) times_->events->op_boundary(cur_op_, next, us(now - times_->origin).count());
  cur_op_ = next;
  cur_op_start_ = now;
}

void Gpt2::offload_out(int l) {
  const OffloadBlock* ob = acts_->offload_of(l);
  if (!ob) return;
  HR_CHECK_MSG(offload_tier_ != nullptr, "an offloaded block needs the offload tier bound");
  std::vector<OffloadCopier::Copy> copies;
  for (const OffloadMove& m : ob->moves) {
    copies.push_back({offload_tier_->data(m.host), arena_->data(m.saved),
                      acts_->buffers[m.saved].bytes(), OffloadCopier::Direction::kToHost});
  }
  if (!copier_) {  // no copy thread: copy in place, nothing overlaps
    for (const OffloadCopier::Copy& c : copies) OffloadCopier::copy(ops_, c);
    return;
  }
  out_tickets_[size_t(l)] = copier_->submit(std::move(copies));
}

void Gpt2::prefetch_in(int l) {
  const OffloadBlock* ob = l >= 0 ? acts_->offload_of(l) : nullptr;
  if (!ob) return;
  HR_CHECK_MSG(offload_tier_ != nullptr, "an offloaded block needs the offload tier bound");
  std::vector<OffloadCopier::Copy> copies;
  for (const OffloadMove& m : ob->moves) {
    copies.push_back({arena_->data(m.landing), offload_tier_->data(m.host),
                      acts_->buffers[m.saved].bytes(), OffloadCopier::Direction::kToDevice});
  }
  if (!copier_) {
    for (const OffloadCopier::Copy& c : copies) OffloadCopier::copy(ops_, c);
    return;
  }
  in_tickets_[size_t(l)] = copier_->submit(std::move(copies));
}

void Gpt2::wait_out(int l) {
  if (l < 0 || size_t(l) >= out_tickets_.size() || !out_tickets_[size_t(l)]) return;
  copier_->wait(out_tickets_[size_t(l)]);
  out_tickets_[size_t(l)] = 0;
}

void Gpt2::wait_in(int l) {
  if (l < 0 || size_t(l) >= in_tickets_.size() || !in_tickets_[size_t(l)]) return;
  copier_->wait(in_tickets_[size_t(l)]);
  in_tickets_[size_t(l)] = 0;
}

// Note [The head's padded columns]: in bf16, oneDNN 2.6 runs the head's forward GEMM with its
// AMX brgemm kernel only when the output's rows are dense (N = ldc). With N = V = 50257 into rows
// of 50304 it takes gemm:jit, 1.3-1.4x slower (docs/notes/lm-head-rows.md). So the forward
// computes all ldv columns where the weight's memory holds ldv rows: wte [V, C] is the first
// tensor of the flat parameter buffer and its bf16 copy (same offsets), so rows [V, ldv) are the
// next tensors' values (wpe's in GPT-2). Columns [V, ldv) of the logits then hold finite
// products nobody reads: the loss, its gradient, the backward GEMMs (K = V) and sampling take
// columns [0, V) only. The fused head's chunk GEMMs do the same (its wte_rows argument).
// Elsewhere (fp32: no gain measured; the per-layer cast; parameters from hooks) the GEMM computes
// V columns.
template <typename T>
int Gpt2::head_forward_columns(const float* wte) const {
  const int V = config_.vocab_size;
  if constexpr (!std::is_same_v<T, bf16_t>) {
    return V;
  } else {
    const int64_t ldv = acts_->options.logits_row_stride(V, *ops_);
    const ParamDesc& p = table_->params[table_->head];
    const bool flat = acts_->options.bf16_weight_copy && params_ != nullptr &&
                      params_bf16_ != nullptr && wte == params_ + p.offset;
    const bool rows_inside = p.offset + ldv * config_.n_embd <= table_->total_floats;
    return flat && rows_inside ? int(ldv) : V;
  }
}

template int Gpt2::head_forward_columns<float>(const float*) const;
template int Gpt2::head_forward_columns<bf16_t>(const float*) const;

int64_t Gpt2::logits_row_stride() const {
  HR_CHECK(acts_ != nullptr);
  return acts_->options.logits_row_stride(config_.vocab_size, *ops_);
}

const float* Gpt2::logits() const {
  HR_CHECK_MSG(acts_->ids.logits != SIZE_MAX, "the fused LM head never holds the logits");
  return arena_->f32(acts_->ids.logits);
}

backend::KdTeacher Gpt2::kd_teacher() const {
  HR_CHECK_MSG(acts_ != nullptr && arena_ != nullptr && acts_->options.hidden_only,
               "kd_teacher: a teacher's forward-only table must be bound");
  backend::KdTeacher t;
  t.x = arena_->data(acts_->ids.lnf);
  t.C = config_.n_embd;
  switch (acts_->options.precision) {
    case Precision::kBf16:
      t.dtype = DType::kBF16;
      t.w = gemm_weight<bf16_t>(head_weight());  // cast by the forward (cast_head_weights)
      break;
    case Precision::kFp32:
      t.w = head_weight();
      break;
    case Precision::kFp16:
      HR_CHECK_MSG(false, "a teacher runs in fp32 or bf16");
  }
  return t;
}

namespace {
// The arena buffer `id` as a T*.
template <typename T>
T* buf(const memory::Arena& a, size_t id) {
  return static_cast<T*>(a.data(id));
}
// The dtype of activations of type T (float, bf16_t, f16_t).
template <typename T>
constexpr DType dtype_of_storage() {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return DType::kBF16;
  } else if constexpr (std::is_same_v<T, f16_t>) {
    return DType::kF16;
  } else {
    return DType::kF32;
  }
}
}  // namespace

template <typename S>
void Gpt2::norm_forward(S* out, float* mean, float* rstd, const float* inp, const float* w,
                        const float* b, int N) {
  const int C = config_.n_embd;
  if (config_.norm == NormKind::kRmsNorm) {
    ops_->rmsnorm_forward(out, rstd, inp, w, N, C, config_.layer_norm_epsilon);
  } else {
    ops_->layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  }
}

backend::RopeScaling backend_rope_scaling(const RopeScalingConfig& rs) {
  backend::RopeScaling scaling;
  scaling.kind = rs.kind == RopeScalingConfig::Kind::kLlama3 ? backend::RopeScaling::Kind::kLlama3
                                                             : backend::RopeScaling::Kind::kNone;
  scaling.factor = rs.factor;
  scaling.low_freq_factor = rs.low_freq_factor;
  scaling.high_freq_factor = rs.high_freq_factor;
  scaling.original_max_position_embeddings = rs.original_max_position_embeddings;
  return scaling;
}

void Gpt2::fill_rope() {
  const size_t id = acts_->ids.rope;
  if (id == SIZE_MAX) return;
  const int HS = config_.head_size(), T = T_used_;
  float* cos = arena_->f32(id);
  float* sin = cos + int64_t(T_) * HS / 2;
  float* inv_freq = cos + int64_t(T_) * HS;
  const backend::RopeScaling scaling = backend_rope_scaling(config_.rope_scaling);
  timed(OpKind::kElementwise, [&] {
    ops_->rope_inv_freq(inv_freq, HS, config_.rope_theta, scaling);
    ops_->rope_table(cos, sin, inv_freq, HS, 0, T);
  });
}

template <typename T>
void Gpt2::block_forward(int l, const Gpt2ActivationIds::Layer& s, const float* x,
                         bool with_output) {
  const int B = B_, Tu = T_used_, C = config_.n_embd, NH = config_.n_head, N = B * Tu;
  const int NKV = config_.kv_heads(), HS = config_.head_size(), AW = int(config_.attn_width());
  const int QKV = int(config_.qkv_width()), FC = int(config_.fc_width()),
            I = int(config_.mlp_width());
  const int64_t ld_fc = acts_->options.mlp_row_stride(FC, *ops_);
  const int64_t ld_act = acts_->options.mlp_row_stride(I, *ops_);
  const backend::WeightLayout layout =
      config_.is_gpt2() ? backend::WeightLayout::kInOut : backend::WeightLayout::kOutIn;
  const memory::Arena& a = *arena_;
  const LayerParams w = layer_params(l, false);
  T* ln1 = buf<T>(a, s.ln1);
  T* qkv = buf<T>(a, s.qkv);
  T* atty = buf<T>(a, s.atty);
  T* ln2 = buf<T>(a, s.ln2);
  T* fch = buf<T>(a, s.fch);
  T* fch_gelu = buf<T>(a, s.fch_gelu);
  auto mean_of = [&](size_t id) { return id == SIZE_MAX ? nullptr : a.f32(id); };
  // A recomputation (with_output == false) runs inside the block's backward, which cast first.
  if (with_output) cast_block_weights(l);
  timed(OpKind::kNorm,
        [&] { norm_forward(ln1, mean_of(s.ln1_mean), a.f32(s.ln1_rstd), x, w.ln1_w, w.ln1_b, N); });
  timed(OpKind::kGemm, [&] {
    ops_->matmul_forward(qkv, ln1, gemm_weight<T>(w.qkv_w), w.qkv_b, N, C, QKV, layout, {});
  });
  if (acts_->ids.rope != SIZE_MAX) {
    const float* cos = a.f32(acts_->ids.rope);
    const float* sin = cos + int64_t(T_) * HS / 2;
    timed(OpKind::kElementwise, [&] { ops_->rope_forward(qkv, cos, sin, B, Tu, NH, NKV, HS); });
  }
  timed(OpKind::kAttention, [&] {
    if constexpr (std::is_same_v<T, float>) {
      if (!acts_->options.tiled_attention) {
        ops_->attention_forward(atty, a.f32(s.att), qkv, B, Tu, AW, NH, NKV);
        return;
      }
    }
    ops_->attention_tiled_forward(atty, a.f32(s.att), qkv, B, Tu, AW, NH, NKV,
                                  a.f32(acts_->ids.att_fwd_scratch));
  });
  // The projection is written straight into residual2 (fp32), then the residual is added in place.
  timed(OpKind::kGemm, [&] {
    ops_->matmul_forward(a.f32(s.residual2), atty, gemm_weight<T>(w.attproj_w), w.attproj_b, N, AW,
                         C, layout, {});
  });
  timed(OpKind::kElementwise,
        [&] { ops_->residual_forward(a.f32(s.residual2), a.f32(s.residual2), x, int64_t(N) * C); });
  timed(OpKind::kNorm, [&] {
    norm_forward(ln2, mean_of(s.ln2_mean), a.f32(s.ln2_rstd), a.f32(s.residual2), w.ln2_w, w.ln2_b,
                 N);
  });
  timed(OpKind::kGemm, [&] {
    ops_->matmul_forward(fch, ln2, gemm_weight<T>(w.fc_w), w.fc_b, N, C, FC, layout,
                         {.inp = 0, .out = ld_fc});
  });
  timed(OpKind::kElementwise, [&] {
    if (config_.mlp == MlpKind::kSwiGlu) {
      ops_->swiglu_forward(fch_gelu, fch, N, I, ld_act, ld_fc);
    } else {
      ops_->gelu_forward(fch_gelu, fch, int64_t(N) * ld_fc);
    }
  });
  if (!with_output) return;
  timed(OpKind::kGemm, [&] {
    ops_->matmul_forward(a.f32(s.residual3), fch_gelu, gemm_weight<T>(w.fcproj_w), w.fcproj_b, N, I,
                         C, layout, {.inp = ld_act, .out = 0});
  });
  timed(OpKind::kElementwise, [&] {
    ops_->residual_forward(a.f32(s.residual3), a.f32(s.residual3), a.f32(s.residual2),
                           int64_t(N) * C);
  });
}

double Gpt2::forward(const int32_t* inputs, const int32_t* targets, int64_t* valid, int T_used) {
  HR_CHECK((params_ || hooks_) && arena_);
  const int T = T_used > 0 ? T_used : T_;
  HR_CHECK(T <= T_ && T <= config_.n_positions);
  HR_CHECK_MSG(targets || acts_->ids.logits != SIZE_MAX || acts_->options.hidden_only,
               "the fused LM head needs targets");
  HR_CHECK_MSG(!teacher_ || (acts_->options.distill && targets),
               "a teacher is bound but the activation table has no distillation (or no targets)");
  T_used_ = T;
  dlogits_dloss_.reset();  // forward_t sets it again where it uses next_dloss_
  switch (acts_->options.precision) {
    case Precision::kBf16:
      return forward_t<bf16_t>(inputs, targets, valid);
    case Precision::kFp16: {
      const backend::F16StagingScope staging(*ops_, arena_->f32(acts_->ids.f16_staging),
                                             arena_->buffers()[acts_->ids.f16_staging].bytes() / 4);
      return forward_t<f16_t>(inputs, targets, valid);
    }
    case Precision::kFp32:
      break;
  }
  return forward_t<float>(inputs, targets, valid);
}

template <typename T>
double Gpt2::forward_t(const int32_t* inputs, const int32_t* targets, int64_t* valid) {
  const Gpt2ActivationIds& id = acts_->ids;
  const int B = B_, Tu = T_used_, C = config_.n_embd, V = config_.vocab_size, L = config_.n_layer;
  const int64_t ldv = acts_->options.logits_row_stride(V, *ops_);  // the logits' row stride
  const int N = B * Tu;
  const memory::Arena& a = *arena_;
  const std::optional<float> dloss = std::exchange(next_dloss_, std::nullopt);  // this one only
  // The fused head's chunk as the table sized its scratch (gpt2_activation_table): at most the
  // micro-batch's tokens. The kernels place the bf16 dlogits at scratch + chunk x ld, so a chunk
  // larger than the planned one would write past the buffer.
  const int planned_chunk = std::min(acts_->options.head_chunk, B_ * T_);
  using Phase = OpDesc::Phase;

  // Op indices follow gpt2_step_ops: embedding, blocks, head; then backward.
  op_boundary(0);
  out_tickets_.assign(size_t(L), 0);
  in_tickets_.assign(size_t(L), 0);
  hook_before(Phase::kForward, BlockHooks::kEmbedding);
  {
    const float* wte = param_ptr(table_->wte);
    const float* wpe = table_->wpe == ParamTable::kNone ? nullptr : param_ptr(table_->wpe);
    timed(OpKind::kEmbedding,
          [&] { ops_->embedding_forward(a.f32(id.encoded), inputs, wte, wpe, B, Tu, C); });
    fill_rope();
  }
  hook_after(Phase::kForward, BlockHooks::kEmbedding);
  const float* x = a.f32(id.encoded);
  for (int l = 0; l < L; l++) {
    op_boundary(1 + l);
    hook_before(Phase::kForward, l);
    block_forward<T>(l, id.fwd[size_t(l)], x, true);
    // Offload: block l's copy out runs during the next op; block l-1's, queued during this one,
    // must be done before its step buffers are given to the ops after it (gpt2_step_ops).
    offload_out(l);
    wait_out(l - 1);
    hook_after(Phase::kForward, l);
    x = a.f32(id.fwd[size_t(l)].residual3);
  }
  op_boundary(L + 1);
  hook_before(Phase::kForward, L);
  const float* wte = head_weight();
  const float* lnf_w = param_ptr(table_->lnf_w);
  const float* lnf_b = table_->lnf_b == ParamTable::kNone ? nullptr : param_ptr(table_->lnf_b);
  T* lnf = buf<T>(a, id.lnf);
  cast_head_weights();
  timed(OpKind::kNorm, [&] {
    norm_forward(lnf, id.lnf_mean == SIZE_MAX ? nullptr : a.f32(id.lnf_mean), a.f32(id.lnf_rstd), x,
                 lnf_w, lnf_b, N);
  });
  if (acts_->options.hidden_only) {  // a teacher: lnf is the output (Gpt2::hidden)
    wait_out(L - 1);
    hook_after(Phase::kForward, L);
    op_boundary(-1);
    return 0.0;
  }
  float* losses = a.f32(id.losses);
  if (teacher_ != nullptr) {  // distillation: CE + KL in the chunked head (distill_kernels.h)
    backend::KdTeacher kt = *teacher_;
    kt.logits_chunk = a.f32(id.kd_teacher_logits);
    timed(OpKind::kLoss, [&] {
      ops_->lm_head_kd_forward(losses, a.f32(id.head_lse), lnf, gemm_weight<T>(wte), kt, targets, N,
                               C, V, planned_chunk, acts_->options.distill->loss,
                               a.f32(id.head_scratch), head_forward_columns<T>(wte));
    });
  } else if (id.logits == SIZE_MAX) {
    timed(OpKind::kLoss, [&] {  // Note [The head's padded columns]
      ops_->lm_head_ce_forward(losses, a.f32(id.head_lse), lnf, gemm_weight<T>(wte), targets, N, C,
                               V, planned_chunk, a.f32(id.head_scratch),
                               head_forward_columns<T>(wte));
    });
  } else {
    const int head_cols = head_forward_columns<T>(wte);
    timed(OpKind::kGemm, [&] {
      ops_->matmul_forward(a.f32(id.logits), lnf, gemm_weight<T>(wte), nullptr, N, C, head_cols,
                           backend::WeightLayout::kOutIn, {.inp = 0, .out = ldv});
    });
    if (!targets) {
      wait_out(L - 1);
      hook_after(Phase::kForward, L);
      op_boundary(-1);
      return 0.0;
    }
    if (dloss) {  // Note [One-pass loss and gradient]: dlogits now, as backward_t would
      timed(OpKind::kLoss, [&] {
        ops_->cross_entropy_forward_backward_inplace(losses, a.f32(id.head_lse), a.f32(id.logits),
                                                     targets, N, V, *dloss, dtype_of_storage<T>(),
                                                     ldv);
      });
      dlogits_dloss_ = dloss;
    } else {
      timed(OpKind::kLoss, [&] {
        ops_->cross_entropy_forward(losses, a.f32(id.head_lse), a.f32(id.logits), targets, N, V,
                                    ldv);
      });
    }
  }
  int64_t count = 0;
  const double sum = ops_->masked_loss_sum(losses, targets, N, &count);
  last_ce_sum_ = sum;
  if (teacher_ != nullptr) {  // the CE part alone, the KD head's fourth statistic
    const float* ce = a.f32(id.head_lse) + 3 * int64_t(N);
    last_ce_sum_ = ops_->masked_loss_sum(ce, targets, N, nullptr);
  }
  if (valid) *valid = count;
  wait_out(L - 1);
  hook_after(Phase::kForward, L);
  op_boundary(-1);
  return sum;
}

void Gpt2::backward(const int32_t* inputs, const int32_t* targets, float dloss) {
  HR_CHECK((grads_ || hooks_) && acts_->ids.dresidual != SIZE_MAX);
  switch (acts_->options.precision) {
    case Precision::kBf16:
      backward_t<bf16_t>(inputs, targets, dloss);
      return;
    case Precision::kFp16: {
      const backend::F16StagingScope staging(*ops_, arena_->f32(acts_->ids.f16_staging),
                                             arena_->buffers()[acts_->ids.f16_staging].bytes() / 4);
      backward_t<f16_t>(inputs, targets, dloss);
      return;
    }
    case Precision::kFp32:
      backward_t<float>(inputs, targets, dloss);
      return;
  }
}

template <typename T>
void Gpt2::backward_t(const int32_t* inputs, const int32_t* targets, float dloss) {
  const Gpt2ActivationIds& id = acts_->ids;
  const int B = B_, Tu = T_used_, C = config_.n_embd, NH = config_.n_head, V = config_.vocab_size,
            L = config_.n_layer;
  const int NKV = config_.kv_heads(), HS = config_.head_size(), AW = int(config_.attn_width());
  const int QKV = int(config_.qkv_width()), FC = int(config_.fc_width()),
            I = int(config_.mlp_width());
  const bool rms = config_.norm == NormKind::kRmsNorm;
  const backend::WeightLayout layout =
      config_.is_gpt2() ? backend::WeightLayout::kInOut : backend::WeightLayout::kOutIn;
  const int N = B * Tu;
  const int64_t ldv = acts_->options.logits_row_stride(V, *ops_);
  const memory::Arena& a = *arena_;
  using Phase = OpDesc::Phase;
  const int planned_chunk = std::min(acts_->options.head_chunk, B_ * T_);  // as forward_t's
  float* dres = a.f32(id.dresidual);
  T* dc = buf<T>(a, id.d_c);
  T* d3c = buf<T>(a, id.d_3c);
  T* d4c = buf<T>(a, id.d_4c);
  T* lnf = buf<T>(a, id.lnf);
  const int64_t ld_fc = acts_->options.mlp_row_stride(FC, *ops_);
  const int64_t ld_act = acts_->options.mlp_row_stride(I, *ops_);
  auto mean_of = [&](size_t i) { return i == SIZE_MAX ? nullptr : a.f32(i); };
  // The residual stream's gradient as the GEMMs read it: itself in fp32; in bf16 / f16 its
  // rounding (dresidual_low), which every norm backward inside the blocks refreshes in the
  // same pass (ln_backward_dres). The last block's first GEMM casts it (`cast`) after the final
  // norm's backward instead: dresidual_low is not live during the head's ops (the plan's
  // peak), so that norm must not write it.
  // bf16: the transposed operands of the weight-gradient GEMMs that take them (see
  // cpu::Bf16WgradStaging): inp^T then dout^T in the planned staging (the LM head's dlogits^T in
  // chunks of its rows there). Empty otherwise.
  auto wgrad_staging = [&](int ic, int oc) -> backend::WgradStaging {
    if (id.bf16_wgrad_staging == SIZE_MAX || !ops_->bf16_wgrad_transposes(N, ic, oc)) return {};
    bf16_t* area = buf<bf16_t>(a, id.bf16_wgrad_staging);
    const size_t elems = a.buffers()[id.bf16_wgrad_staging].bytes() / sizeof(bf16_t);
    const size_t in_elems = size_t(N) * size_t(ic);
    HR_CHECK_MSG(in_elems <= elems, "bf16_wgrad_staging is smaller than this GEMM's inp^T");
    return {area, in_elems, area + in_elems, elems - in_elems};
  };
  // A block's matmul_backward, through the transposed operands in bf16.
  auto block_matmul_backward = [&](T* dinp, float* dweight, float* dbias, const T* dout,
                                   const T* inp, const GemmWeightT<T>* weight, int ic, int oc,
                                   backend::MatmulStrides st) {
    if constexpr (std::is_same_v<T, bf16_t>) {
      ops_->matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, ic, oc, layout, st,
                            wgrad_staging(ic, oc));
    } else {
      ops_->matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, ic, oc, layout, st);
    }
  };
  auto dres_for_gemm = [&](bool cast) -> const T* {
    if constexpr (std::is_same_v<T, float>) {
      return dres;
    } else {
      T* low = buf<T>(a, id.dresidual_low);
      if (cast) {
        timed(OpKind::kElementwise, [&] {
          if constexpr (std::is_same_v<T, f16_t>) {
            ops_->cast_to_f16(low, dres, int64_t(N) * C);
          } else {
            ops_->cast_to_bf16(low, dres, int64_t(N) * C);
          }
        });
      }
      return low;
    }
  };
  // dres += the norm's backward; `low`: also round the result into dresidual_low for the next
  // GEMM (not after the first block's ln1, whose gradient only the embedding reads, in fp32).
  auto ln_backward_dres = [&](float* dw, float* db, const T* dout, const float* inp, const float* w,
                              const float* mean, const float* rstd, bool low) {
    if constexpr (std::is_same_v<T, float>) {
      if (rms) {
        ops_->rmsnorm_backward(dres, dw, dout, inp, w, rstd, N, C);
      } else {
        ops_->layernorm_backward(dres, dw, db, dout, inp, w, mean, rstd, N, C);
      }
    } else {
      if (low) {
        T* dlow = buf<T>(a, id.dresidual_low);
        if (rms) {
          ops_->rmsnorm_backward(dres, dlow, dw, dout, inp, w, rstd, N, C);
        } else {
          ops_->layernorm_backward(dres, dlow, dw, db, dout, inp, w, mean, rstd, N, C);
        }
      } else {
        if (rms) {
          ops_->rmsnorm_backward(dres, dw, dout, inp, w, rstd, N, C);
        } else {
          ops_->layernorm_backward(dres, dw, db, dout, inp, w, mean, rstd, N, C);
        }
      }
    }
  };
  const float* rope_cos = id.rope == SIZE_MAX ? nullptr : a.f32(id.rope);
  const float* rope_sin = rope_cos ? rope_cos + int64_t(T_) * HS / 2 : nullptr;

  // Loss and LM head into dc = d(lnf).
  op_boundary(L + 2);
  if (out_tickets_.size() != size_t(L)) {  // backward without a forward of this binding
    out_tickets_.assign(size_t(L), 0);
    in_tickets_.assign(size_t(L), 0);
  }
  prefetch_in(L - 1);  // overlaps the head's backward
  hook_before(Phase::kBackward, L);
  const float* wte = head_weight();
  float* dwte = grad_ptr(table_->head);
  if (teacher_ != nullptr) {
    backend::KdTeacher kt = *teacher_;
    kt.logits_chunk = a.f32(id.kd_teacher_logits);
    timed(OpKind::kLoss, [&] {
      ops_->lm_head_kd_backward(dc, dwte, lnf, gemm_weight<T>(wte), kt, targets, a.f32(id.head_lse),
                                N, C, V, planned_chunk, acts_->options.distill->loss, dloss,
                                a.f32(id.head_scratch), head_forward_columns<T>(wte));
    });
  } else if (id.logits == SIZE_MAX) {
    timed(OpKind::kLoss, [&] {
      ops_->lm_head_ce_backward(dc, dwte, lnf, gemm_weight<T>(wte), targets, a.f32(id.head_lse), N,
                                C, V, planned_chunk, dloss, a.f32(id.head_scratch),
                                head_forward_columns<T>(wte));
    });
  } else {
    // The logits buffer becomes dlogits in place, in one pass from the saved log-sum-exp,
    // stored as the head's GEMM reads them: fp32; fp32 holding f16 values (as the f16 GEMMs of
    // autocast read them); or, in bf16, their bf16 rounding over the first half of each row
    // (row stride 2 ldv bf16 elements; Note [The bf16 gradient over its own row]).
    // (Already done where the forward was given this dloss: Note [One-pass loss and gradient].)
    float* dlogits = a.f32(id.logits);
    if (dlogits_dloss_) {
      HR_CHECK_MSG(std::bit_cast<uint32_t>(*dlogits_dloss_) == std::bit_cast<uint32_t>(dloss),
                   "Gpt2::backward: dloss differs from the one given to set_next_dloss before the "
                   "forward, which computed the logits' gradient with it");
    } else {
      timed(OpKind::kLoss, [&] {
        ops_->cross_entropy_backward_inplace(dlogits, a.f32(id.head_lse), targets, N, V, dloss,
                                             dtype_of_storage<T>(), ldv);
      });
    }
    dlogits_dloss_.reset();
    timed(OpKind::kGemm, [&] {
      if constexpr (std::is_same_v<T, float>) {
        ops_->matmul_backward(dc, dwte, nullptr, dlogits, lnf, wte, N, C, V,
                              backend::WeightLayout::kOutIn, {.inp = 0, .out = ldv});
      } else if constexpr (std::is_same_v<T, f16_t>) {
        ops_->matmul_backward(dc, dwte, nullptr, static_cast<const float*>(dlogits), lnf,
                              gemm_weight<T>(wte), N, C, V, backend::WeightLayout::kOutIn,
                              {.inp = 0, .out = ldv});
      } else {
        ops_->matmul_backward(dc, dwte, nullptr, reinterpret_cast<const T*>(dlogits), lnf,
                              gemm_weight<T>(wte), N, C, V, backend::WeightLayout::kOutIn,
                              {.inp = 0, .out = 2 * ldv}, wgrad_staging(C, V));
      }
    });
  }
  const float* last = L > 0 ? a.f32(id.fwd[size_t(L - 1)].residual3) : a.f32(id.encoded);
  timed(OpKind::kElementwise, [&] { ops_->zero(dres, int64_t(N) * C); });
  timed(OpKind::kNorm, [&] {
    ln_backward_dres(grad_ptr(table_->lnf_w),
                     table_->lnf_b == ParamTable::kNone ? nullptr : grad_ptr(table_->lnf_b), dc,
                     last, param_ptr(table_->lnf_w), mean_of(id.lnf_mean), a.f32(id.lnf_rstd),
                     false);
  });
  hook_after(Phase::kBackward, L);
  // dres now holds the gradient of the last block's output; walk the blocks backwards.
  for (int l = L - 1; l >= 0; l--) {
    op_boundary(L + 3 + (L - 1 - l));
    // Offload: the next block's prefetch overlaps this block's backward; this block's, queued
    // one op earlier, must have landed.
    prefetch_in(l - 1);
    wait_in(l);
    hook_before(Phase::kBackward, l);
    const LayerParams w = layer_params(l, false);
    const LayerParams g = layer_params(l, true);
    const Gpt2ActivationIds::Layer& s = id.bwd[size_t(l)];
    const Recompute rc = acts_->options.recompute_at(l);
    const float* x = l > 0 ? a.f32(id.fwd[size_t(l - 1)].residual3) : a.f32(id.encoded);
    T* ln1 = buf<T>(a, s.ln1);
    T* qkv = buf<T>(a, s.qkv);
    T* atty = buf<T>(a, s.atty);
    T* ln2 = buf<T>(a, s.ln2);
    T* fch = buf<T>(a, s.fch);
    T* fch_gelu = buf<T>(a, s.fch_gelu);
    cast_block_weights(l);
    if (rc == Recompute::kFull) block_forward<T>(l, s, x, false);
    if (rc == Recompute::kSelective) {
      timed(OpKind::kNorm, [&] {
        norm_forward(ln2, mean_of(s.ln2_mean), a.f32(s.ln2_rstd), a.f32(s.residual2), w.ln2_w,
                     w.ln2_b, N);
      });
      timed(OpKind::kElementwise, [&] {
        if (config_.mlp == MlpKind::kSwiGlu) {
          ops_->swiglu_forward(fch_gelu, fch, N, I, ld_act, ld_fc);
        } else {
          ops_->gelu_forward(fch_gelu, fch, int64_t(N) * ld_fc);
        }
      });
    }
    // MLP: residual3 = residual2 + fcproj(act(fc(ln2(residual2)))).
    const T* dres3 = dres_for_gemm(l == L - 1);
    timed(OpKind::kGemm, [&] {
      block_matmul_backward(d4c, g.fcproj_w, g.fcproj_b, dres3, fch_gelu,
                            gemm_weight<T>(w.fcproj_w), I, C, {.inp = ld_act, .out = 0});
    });
    // The activation's backward: GELU's in place in d4c; SwiGLU's writes d(gate | up) over fch,
    // which nothing reads after it.
    T* dfc = config_.mlp == MlpKind::kSwiGlu ? fch : d4c;
    timed(OpKind::kElementwise, [&] {
      if (config_.mlp == MlpKind::kSwiGlu) {
        ops_->swiglu_backward(fch, fch, d4c, N, I, ld_fc, ld_act);
      } else {
        ops_->gelu_backward(d4c, fch, d4c, int64_t(N) * ld_fc);
      }
    });
    timed(OpKind::kGemm, [&] {
      block_matmul_backward(dc, g.fc_w, g.fc_b, dfc, ln2, gemm_weight<T>(w.fc_w), C, FC,
                            {.inp = 0, .out = ld_fc});
    });
    timed(OpKind::kNorm, [&] {
      ln_backward_dres(g.ln2_w, g.ln2_b, dc, a.f32(s.residual2), w.ln2_w, mean_of(s.ln2_mean),
                       a.f32(s.ln2_rstd), true);
    });
    // Attention: residual2 = x + attproj(attention(rope(qkv(ln1(x))))).
    const T* dres2 = dres_for_gemm(false);
    timed(OpKind::kGemm, [&] {
      block_matmul_backward(dc, g.attproj_w, g.attproj_b, dres2, atty, gemm_weight<T>(w.attproj_w),
                            AW, C, {});
    });
    timed(OpKind::kAttention, [&] {
      if constexpr (std::is_same_v<T, float>) {
        if (!acts_->options.tiled_attention) {
          ops_->attention_backward(d3c, a.f32(id.att_scratch), dc, qkv, a.f32(s.att), B, Tu, AW, NH,
                                   NKV);
          return;
        }
      }
      ops_->attention_tiled_backward(d3c, dc, qkv, atty, a.f32(s.att), B, Tu, AW, NH, NKV,
                                     a.f32(id.att_scratch));
    });
    if (rope_cos) {
      timed(OpKind::kElementwise,
            [&] { ops_->rope_backward(d3c, rope_cos, rope_sin, B, Tu, NH, NKV, HS); });
    }
    if (rc == Recompute::kSelective) {
      timed(OpKind::kNorm, [&] {
        norm_forward(ln1, mean_of(s.ln1_mean), a.f32(s.ln1_rstd), x, w.ln1_w, w.ln1_b, N);
      });
    }
    timed(OpKind::kGemm, [&] {
      block_matmul_backward(dc, g.qkv_w, g.qkv_b, d3c, ln1, gemm_weight<T>(w.qkv_w), C, QKV, {});
    });
    timed(OpKind::kNorm, [&] {
      ln_backward_dres(g.ln1_w, g.ln1_b, dc, x, w.ln1_w, mean_of(s.ln1_mean), a.f32(s.ln1_rstd),
                       l > 0);
    });
    hook_after(Phase::kBackward, l);
  }
  op_boundary(2 * L + 3);
  hook_before(Phase::kBackward, BlockHooks::kEmbedding);
  {
    float* dwte_e = grad_ptr(table_->wte);
    float* dwpe = table_->wpe == ParamTable::kNone ? nullptr : grad_ptr(table_->wpe);
    timed(OpKind::kEmbedding,
          [&] { ops_->embedding_backward(dwte_e, dwpe, dres, inputs, B, Tu, C); });
  }
  hook_after(Phase::kBackward, BlockHooks::kEmbedding);
  op_boundary(-1);
}

}  // namespace headroom::model
