// Generation with a KV cache (decode.h; docs/notes/generation.md).
#include "model/decode.h"

#include <algorithm>

#include "core/check.h"

namespace headroom::model {

uint64_t DecodeTable::cache_bytes() const {
  uint64_t b = 0;
  for (const memory::BufferDesc& d : cache) b += d.bytes();
  return b;
}

uint64_t DecodeTable::work_bytes() const {
  uint64_t b = 0;
  for (const memory::BufferDesc& d : work) b += d.bytes();
  return b;
}

DecodeTable decode_table(const TransformerConfig& c, int context, int rows) {
  HR_CHECK_MSG(1 <= rows && rows <= context && context <= c.n_positions,
               "decode_table: 1 <= rows <= context <= n_positions");
  using memory::Category;
  const int64_t C = c.n_embd, HS = c.head_size(), R = rows;
  const int64_t kv = int64_t(c.n_layer) * c.kv_heads() * context * HS;
  DecodeTable t;
  t.context = context;
  t.rows = rows;
  t.cache = {{"kv_cache.k", DType::kF32, Shape{kv}, Category::kKvCache},
             {"kv_cache.v", DType::kF32, Shape{kv}, Category::kKvCache}};
  auto add = [&](std::string name, int64_t floats, Category cat = Category::kActivations) {
    t.work.push_back({std::move(name), DType::kF32, Shape{floats}, cat});
    return t.work.size() - 1;
  };
  t.x = add("decode.residual", R * C);
  t.xn = add("decode.norm_out", R * C);  // also each projection's output before its residual
  t.qkv = add("decode.qkv", R * c.qkv_width());
  t.att = add("decode.attention_out", R * c.n_head * HS);
  t.fc = add("decode.mlp_in", R * c.fc_width());
  t.fc_act = add("decode.mlp_act", R * c.mlp_width());
  t.stats = add("decode.norm_stats", 2 * R);  // mean, rstd
  t.rope = c.positions == PositionKind::kRope ? add("decode.rope", R * HS + HS / 2) : SIZE_MAX;
  t.logits = add("decode.logits", c.vocab_size, Category::kLogits);
  return t;
}

Decoder::Decoder(const TransformerConfig& config, const ParamTable* table, const float* params,
                 const DecodeTable* decode, memory::Arena* cache, memory::Arena* work,
                 const backend::Ops& ops)
    : config_(config),
      table_(table),
      params_(params),
      decode_(decode),
      cache_(cache),
      work_(work),
      ops_(&ops) {
  HR_CHECK(table_ && params_ && decode_ && cache_ && work_);
  HR_CHECK_MSG(config_.head_size() <= ops_->max_cached_head_size(),
               "Decoder: the head size is above the backend's cached attention's");
}

const float* Decoder::prefill(const int32_t* tokens, int n) {
  HR_CHECK(n >= 1 && n <= decode_->rows);
  pos_ = 0;
  return pass(tokens, n);
}

const float* Decoder::step(int32_t token) {
  HR_CHECK_MSG(pos_ < decode_->context, "Decoder::step: the cache is full");
  return pass(&token, 1);
}

void Decoder::norm(float* out, const float* inp, const float* w, const float* b, int n) {
  float* stats = work_->f32(decode_->stats);
  if (config_.norm == NormKind::kRmsNorm) {
    ops_->rmsnorm_forward(out, stats + decode_->rows, inp, w, n, config_.n_embd,
                          config_.layer_norm_epsilon);
  } else {
    ops_->layernorm_forward(out, stats, stats + decode_->rows, inp, w, b, n, config_.n_embd);
  }
}

const float* Decoder::pass(const int32_t* tokens, int n) {
  HR_CHECK(pos_ + n <= decode_->context);
  const int C = config_.n_embd, NH = config_.n_head, NKV = config_.kv_heads(),
            HS = config_.head_size(), L = config_.n_layer, V = config_.vocab_size;
  const int QKV = int(config_.qkv_width()), FC = int(config_.fc_width()),
            I = int(config_.mlp_width()), Q = NH * HS, ctx = decode_->context;
  const backend::WeightLayout layout =
      config_.is_gpt2() ? backend::WeightLayout::kInOut : backend::WeightLayout::kOutIn;
  auto param = [&](size_t i) -> const float* {
    return i == ParamTable::kNone ? nullptr : params_ + table_->params[i].offset;
  };
  const memory::Arena& w = *work_;
  float* x = w.f32(decode_->x);
  float* xn = w.f32(decode_->xn);
  float* qkv = w.f32(decode_->qkv);
  float* att = w.f32(decode_->att);
  float* fc = w.f32(decode_->fc);
  float* act = w.f32(decode_->fc_act);

  // Positions pos_ .. pos_ + n - 1: the learned table from row pos_, or the rotary tables there.
  const float* wpe = table_->wpe == ParamTable::kNone ? nullptr : param(table_->wpe) + pos_ * C;
  ops_->embedding_forward(x, tokens, param(table_->wte), wpe, 1, n, C);
  const float* cos = nullptr;
  const float* sin = nullptr;
  if (decode_->rope != SIZE_MAX) {
    float* rope = w.f32(decode_->rope);
    float* inv_freq = rope + int64_t(decode_->rows) * HS;
    const backend::RopeScaling scaling = backend_rope_scaling(config_.rope_scaling);
    ops_->rope_inv_freq(inv_freq, HS, config_.rope_theta, scaling);
    ops_->rope_table(rope, rope + int64_t(n) * HS / 2, inv_freq, HS, pos_, n);
    cos = rope;
    sin = rope + int64_t(n) * HS / 2;
  }
  const int64_t per_layer = int64_t(NKV) * ctx * HS;
  for (int l = 0; l < L; l++) {
    const ParamTable::Layer& y = table_->layers[size_t(l)];
    norm(xn, x, param(y.ln1_w), param(y.ln1_b), n);
    ops_->matmul_forward(qkv, xn, param(y.qkv_w), param(y.qkv_b), n, C, QKV, layout, {});
    if (cos) ops_->rope_forward(qkv, cos, sin, 1, n, NH, NKV, HS);
    ops_->attention_cached_forward(att, cache_->f32(0) + l * per_layer,
                                   cache_->f32(1) + l * per_layer, qkv, n, pos_, ctx, NH, NKV, HS);
    ops_->matmul_forward(xn, att, param(y.attproj_w), param(y.attproj_b), n, Q, C, layout, {});
    ops_->residual_forward(x, x, xn, int64_t(n) * C);
    norm(xn, x, param(y.ln2_w), param(y.ln2_b), n);
    ops_->matmul_forward(fc, xn, param(y.fc_w), param(y.fc_b), n, C, FC, layout, {});
    if (config_.mlp == MlpKind::kSwiGlu) {
      ops_->swiglu_forward(act, fc, n, I, I, FC);
    } else {
      ops_->gelu_forward(act, fc, int64_t(n) * FC);
    }
    ops_->matmul_forward(xn, act, param(y.fcproj_w), param(y.fcproj_b), n, I, C, layout, {});
    ops_->residual_forward(x, x, xn, int64_t(n) * C);
  }
  pos_ += n;
  // Only the last token's logits are sampled from.
  const float* last = x + int64_t(n - 1) * C;
  norm(xn, last, param(table_->lnf_w), param(table_->lnf_b), 1);
  float* logits = w.f32(decode_->logits);
  ops_->matmul_forward(logits, xn, param(table_->head), nullptr, 1, C, V,
                       backend::WeightLayout::kOutIn, {});
  return logits;
}

}  // namespace headroom::model
