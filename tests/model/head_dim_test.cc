// An explicit head_dim (Note [Attention width] in docs/notes/pruning.md): an attention that is
// n_head x head_dim wide, not n_embd, trains correctly. Narrower (pruned heads): the pruned model's
// loss and gradients are the unpruned model's with those heads' output projection zeroed. Wider:
// its gradients agree with finite differences. Both in plain and tiled attention, and bf16 / fp16
// agree with fp32 to their rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "memory/host_resource.h"
#include "model/gpt2.h"
#include "model/prune.h"

namespace headroom::model {
namespace {

TransformerConfig gpt2_small() {
  TransformerConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  c.vocab_size = 40;
  c.n_positions = 16;
  return c;
}

// Grouped-query attention (4 query heads in 2 groups), with q, k, v biases (Qwen2's) so that the
// biases a group owns are exercised too.
TransformerConfig llama_small() {
  TransformerConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 16;
  c.vocab_size = 40;
  c.n_positions = 16;
  c.model_type = "qwen2";
  c.norm = NormKind::kRmsNorm;
  c.positions = PositionKind::kRope;
  c.mlp = MlpKind::kSwiGlu;
  c.n_kv_head = 2;
  c.intermediate_size = 24;
  c.qkv_bias = true;
  c.other_bias = false;
  c.tied_head = false;
  return c;
}

// Initialised, with biases and norm weights perturbed so that every parameter matters.
std::vector<float> init(const TransformerConfig& c, const ParamTable& t, uint64_t seed) {
  std::vector<float> p(size_t(t.total_floats), 0.0f);
  gpt2_init_params(c, t, p.data(), seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> nd(0.0f, 0.05f);
  for (const ParamDesc& d : t.params) {
    // Larger weights than the 0.02 initialisation, so that attention patterns (and errors in
    // them) are far from uniform.
    const float scale = d.shape.rank() == 2 ? 5.0f : 1.0f;
    for (int64_t i = 0; i < d.shape.numel(); i++) {
      float& w = p[size_t(d.offset + i)];
      w = d.shape.rank() == 2 ? w * scale : w + nd(rng);
    }
  }
  return p;
}

struct Pass {
  double loss = 0;           // mean over the valid targets
  std::vector<float> grads;  // of the mean loss
};

// Every buffer followed by a guard band of kGuard bytes: a buffer sized for the wrong width
// (activations, scratch) shows as a write into its band.
constexpr uint64_t kGuard = 64 << 10;
memory::Layout guarded_layout(const std::vector<memory::BufferDesc>& buffers) {
  memory::Layout l;
  for (const memory::BufferDesc& b : buffers) {
    l.offsets.push_back(l.size);
    l.size += (b.bytes() + 63) / 64 * 64 + kGuard;
  }
  return l;
}

// One forward + backward of B x T tokens, activations in an arena poisoned with NaN (a kernel
// that reads what nothing wrote shows as NaN in the loss or the gradients) whose buffers are
// followed by guard bands that must stay untouched.
Pass run(const TransformerConfig& c, const ParamTable& t, const std::vector<float>& params,
         const ExecOptions& exec, int B = 2, int T = 8) {
  Pass r;
  std::vector<float> p = params;
  std::vector<bf16_t> copy;
  r.grads.assign(size_t(t.total_floats), 0.0f);
  Gpt2 net(c, &t);
  if (exec.precision == Precision::kBf16 && exec.bf16_weight_copy) {
    copy.resize(size_t(t.total_floats));
    backend::cpu_ops().cast_to_bf16(copy.data(), p.data(), t.total_floats);
  }
  net.bind_params(p.data(), r.grads.data(), copy.empty() ? nullptr : copy.data());
  const ActivationTable acts = gpt2_activation_table(c, B, T, /*training=*/true, exec);
  memory::HostResource host;
  const memory::Layout layout = guarded_layout(acts.buffers);
  Result<memory::Arena> arena =
      memory::Arena::create(&host, acts.buffers, layout, memory::Category::kActivations);
  EXPECT_TRUE(arena.is_ok());
  if (!arena.is_ok()) return r;
  std::fill_n(static_cast<float*>(arena->base()), arena->size() / 4, NAN);
  net.bind_activations(&*arena, &acts, B, T);
  std::vector<int32_t> in(size_t(B * T)), tg(size_t(B * T));
  for (int i = 0; i < B * T; i++) {
    in[size_t(i)] = (i * 7 + 3) % c.vocab_size;
    tg[size_t(i)] = i % 9 == 4 ? -1 : (i * 13 + 1) % c.vocab_size;
  }
  int64_t valid = 0;
  r.loss = net.forward(in.data(), tg.data(), &valid) / double(valid);
  net.backward(in.data(), tg.data(), 1.0f / float(valid));
  const uint32_t nan_bits = std::bit_cast<uint32_t>(NAN);
  for (size_t i = 0; i < acts.buffers.size(); i++) {
    const uint64_t end = i + 1 < acts.buffers.size() ? layout.offsets[i + 1] : layout.size;
    const uint64_t from = (layout.offsets[i] + acts.buffers[i].bytes() + 3) / 4 * 4;
    const auto* base = static_cast<const char*>(arena->base());
    for (uint64_t o = from; o < end; o += 4) {
      uint32_t bits;
      std::memcpy(&bits, base + o, 4);
      if (bits != nan_bits) {
        ADD_FAILURE() << "a write past " << acts.buffers[i].name << " (" << acts.buffers[i].bytes()
                      << " bytes), at byte " << o - layout.offsets[i];
        break;
      }
    }
  }
  return r;
}

ExecOptions plain() {
  ExecOptions e;
  e.tiled_attention = false;
  return e;
}

ExecOptions tiled() { return ExecOptions{}; }

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

// The exactness test of an explicit head_dim narrower than n_embd / n_head: prune half the
// heads (GPT-2) or KV groups (GQA); in the unpruned model zero only those heads' output
// projection, which makes them contribute nothing. The two models compute the same loss and the
// same gradients for every kept weight (the GEMMs reduce over fewer zeros: equal up to their
// summation order).
TEST(HeadDim, PrunedHeadsTrainAsTheFullModelWithTheirOutputZeroed) {
  for (const TransformerConfig& c : {gpt2_small(), llama_small()}) {
    for (const ExecOptions& e : {plain(), tiled()}) {
      SCOPED_TRACE(c.model_type + (e.tiled_attention ? " tiled" : " plain"));
      const ParamTable t = gpt2_param_table(c);
      const std::vector<float> params = init(c, t, 17);
      Result<StructuredPrune> sp = prune_attention_heads(c, t, params.data(), 0.5);
      ASSERT_TRUE(sp.is_ok()) << sp.status().to_string();
      ASSERT_EQ(sp->config.n_head, 2);
      ASSERT_EQ(sp->config.head_size(), 4);
      ASSERT_EQ(sp->config.attn_width(), 8);  // A = 8 < C = 16: head_dim is explicit
      ASSERT_EQ(sp->config.head_dim, 4);

      std::vector<float> zeroed = params;
      zero_attention_output(c, t, zeroed.data(), sp->removed);
      const Pass full = run(c, t, zeroed, e);
      const Pass pruned = run(sp->config, sp->table, sp->params, e);
      ASSERT_TRUE(std::isfinite(full.loss) && std::isfinite(pruned.loss));
      // Zeroing the heads' output changed the model (else the comparison proves nothing).
      EXPECT_GT(std::fabs(run(c, t, params, e).loss - full.loss), 1e-4);
      EXPECT_NEAR(pruned.loss, full.loss, 1e-6 * full.loss);
      const std::vector<float> want = gather_kept(c, t, full.grads.data(), *sp);
      ASSERT_EQ(want.size(), pruned.grads.size());
      const double scale = max_abs(want);
      ASSERT_GT(scale, 0);
      for (const ParamDesc& d : sp->table.params) {
        for (int64_t i = d.offset; i < d.offset + d.shape.numel(); i++) {
          ASSERT_NEAR(pruned.grads[size_t(i)], want[size_t(i)], 1e-5 * scale)
              << d.name << " element " << i - d.offset;
        }
      }
    }
  }
}

// Wider heads than n_embd / n_head (A = 24 > C = 16): the attention's output and its gradient
// are wider than the residual stream. Central differences of the loss in double against the
// backward's gradient, for the weights of largest gradient in every attention tensor. One
// sequence: with as many scratch slots as threads, a scratch sized for the wrong head size shows
// in the guard bands.
TEST(HeadDim, WiderHeadsHaveGradientsThatMatchFiniteDifferences) {
  TransformerConfig g = gpt2_small();
  g.n_head = 2;
  g.head_dim = 12;
  TransformerConfig l = llama_small();
  l.head_dim = 6;
  for (const TransformerConfig& c : {g, l}) {
    ASSERT_TRUE(c.validate().is_ok()) << c.validate().to_string();
    ASSERT_EQ(c.attn_width(), 24);
    for (const ExecOptions& e : {plain(), tiled()}) {
      SCOPED_TRACE(c.model_type + (e.tiled_attention ? " tiled" : " plain"));
      const ParamTable t = gpt2_param_table(c);
      const std::vector<float> params = init(c, t, 23);
      const Pass base = run(c, t, params, e, /*B=*/1);
      ASSERT_TRUE(std::isfinite(base.loss));
      for (const ParamDesc& d : t.params) {
        const bool attention = d.name.find("attn") != std::string::npos && d.site == 1;
        if (!attention) continue;
        // The 3 entries of largest gradient: a relative check is meaningful there.
        std::vector<int64_t> idx(size_t(d.shape.numel()));
        for (int64_t i = 0; i < d.shape.numel(); i++) idx[size_t(i)] = d.offset + i;
        std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(), [&](int64_t a, int64_t b) {
          return std::fabs(base.grads[size_t(a)]) > std::fabs(base.grads[size_t(b)]);
        });
        for (int k = 0; k < 3; k++) {
          const int64_t i = idx[size_t(k)];
          const float eps = 1e-2f;
          std::vector<float> p = params;
          p[size_t(i)] = params[size_t(i)] + eps;
          const double up = run(c, t, p, e, 1).loss;
          p[size_t(i)] = params[size_t(i)] - eps;
          const double down = run(c, t, p, e, 1).loss;
          const double fd = (up - down) / (2.0 * eps);
          const double got = base.grads[size_t(i)];
          // fp32 forward (relative error ~1e-7 of a loss ~4 over 2 eps = 0.02: ~2e-5) plus the
          // O(eps^2) truncation of the central difference: a few percent of these gradients.
          EXPECT_NEAR(got, fd, 2e-4 + 3e-2 * std::fabs(fd))
              << d.name << " element " << i - d.offset;
          // The check is not of zeros (k's bias has none: it shifts a query's scores equally).
          if (d.shape.rank() == 2) {
            EXPECT_GT(std::fabs(got), 1e-3) << d.name;
          }
        }
      }
    }
  }
}

// bf16 (with the persistent copy and cast per layer) and fp16 run the same attention width: their
// loss and gradients agree with fp32 to their rounding.
TEST(HeadDim, LowPrecisionAgreesWithFp32AtAnotherAttentionWidth) {
  TransformerConfig narrow = llama_small();
  narrow.head_dim = 2;  // A = 8 < C
  TransformerConfig wide = gpt2_small();
  wide.head_dim = 8;  // A = 32 > C
  for (const TransformerConfig& c : {narrow, wide}) {
    const ParamTable t = gpt2_param_table(c);
    const std::vector<float> params = init(c, t, 29);
    const Pass f = run(c, t, params, tiled());
    for (auto [precision, copy] : {std::pair{Precision::kBf16, true},
                                   {Precision::kBf16, false},
                                   {Precision::kFp16, false}}) {
      SCOPED_TRACE(c.model_type + " " + std::string(precision_name(precision)) +
                   (copy ? " copy" : " cast"));
      ExecOptions e;
      e.precision = precision;
      e.bf16_weight_copy = copy;
      const Pass h = run(c, t, params, e);
      EXPECT_NEAR(h.loss, f.loss, 2e-2 * f.loss);
      double dot = 0, na = 0, nb = 0;
      for (size_t i = 0; i < f.grads.size(); i++) {
        dot += double(h.grads[i]) * f.grads[i];
        na += double(h.grads[i]) * h.grads[i];
        nb += double(f.grads[i]) * f.grads[i];
      }
      // A few roundings to 8 (bf16) or 11 (fp16) significant bits per layer: the gradients point
      // the same way.
      EXPECT_GT(dot / std::sqrt(na * nb), 0.99);
    }
  }
}

}  // namespace
}  // namespace headroom::model
