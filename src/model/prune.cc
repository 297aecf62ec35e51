// Pruning masks and structured MLP pruning (model/prune.h; decisions in docs/notes/pruning.md).
#include "model/prune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include <fmt/format.h>

#include "backend/ops.h"
#include "core/check.h"
#include "memory/host_resource.h"

namespace headroom::model {

std::vector<size_t> prunable_tensors(const ParamTable& table) {
  std::vector<size_t> out;
  const int L = int(table.layers.size());
  for (size_t i = 0; i < table.params.size(); i++) {
    const ParamDesc& p = table.params[i];
    if (p.site >= 0 && p.site < L && p.shape.rank() == 2) out.push_back(i);
  }
  return out;
}

int input_dim(const TransformerConfig& config) { return config.is_gpt2() ? 0 : 1; }

namespace {

// Masks, among the weights `idx` (flat offsets) of `params`, the `k` of smallest magnitude;
// ties at the threshold go to the lower offsets (idx is ascending).
void mask_smallest(const float* params, const std::vector<int64_t>& idx, int64_t k,
                   SparsityMask* mask) {
  if (k <= 0) return;
  std::vector<float> mags(idx.size());
  for (size_t i = 0; i < idx.size(); i++) mags[i] = std::fabs(params[idx[i]]);
  std::vector<float> sorted = mags;
  std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end());
  const float t = sorted[size_t(k - 1)];  // the k-th smallest magnitude
  int64_t below = 0;
  for (float x : mags) below += x < t;
  int64_t at_t = k - below;  // this many weights of magnitude exactly t are masked too
  for (size_t i = 0; i < idx.size(); i++) {
    if (mags[i] < t) {
      (*mask)[size_t(idx[i])] = 0;
    } else if (mags[i] == t && at_t > 0) {
      (*mask)[size_t(idx[i])] = 0;
      at_t--;
    }
  }
}

}  // namespace

SparsityMask magnitude_mask(const ParamTable& table, const float* params, double sparsity,
                            bool per_layer) {
  HR_CHECK_MSG(sparsity >= 0 && sparsity < 1, "magnitude_mask: sparsity outside [0, 1)");
  SparsityMask mask(size_t(table.total_floats), 1);
  const std::vector<size_t> tensors = prunable_tensors(table);
  // Groups ranked together: one (global) or one per block.
  const int groups = per_layer ? int(table.layers.size()) : 1;
  for (int g = 0; g < groups; g++) {
    std::vector<int64_t> idx;
    for (size_t t : tensors) {
      const ParamDesc& p = table.params[t];
      if (per_layer && p.site != g) continue;
      for (int64_t i = 0; i < p.shape.numel(); i++) idx.push_back(p.offset + i);
    }
    const auto k = int64_t(std::llround(sparsity * double(idx.size())));
    mask_smallest(params, idx, k, &mask);
  }
  return mask;
}

Result<SparsityMask> nm_mask(const TransformerConfig& config, const ParamTable& table,
                             const float* params, int n, int m) {
  if (!(n > 0 && m > n)) {
    return Status::invalid_argument(fmt::format(
        "N:M = {}:{}: N must be positive and smaller than M (2:4 keeps 2 of every 4)", n, m));
  }
  SparsityMask mask(size_t(table.total_floats), 1);
  const int in_dim = input_dim(config);
  std::vector<std::pair<float, int>> group(static_cast<size_t>(m));
  for (size_t t : prunable_tensors(table)) {
    const ParamDesc& p = table.params[t];
    const int64_t in = p.shape[size_t(in_dim)], out = p.shape[size_t(1 - in_dim)];
    if (in % m != 0) {
      return Status::invalid_argument(
          fmt::format("N:M = {}:{}: tensor {} {} has an input dimension of {}, not a multiple "
                      "of M = {}; choose an M that divides it",
                      n, m, p.name, p.shape.to_string(), in, m));
    }
    // Element (o, i) of the weight: o * in + i ([out, in]) or i * out + o ([in, out]).
    const int64_t so = in_dim == 1 ? in : 1, si = in_dim == 1 ? 1 : out;
    for (int64_t o = 0; o < out; o++) {
      for (int64_t g = 0; g < in; g += m) {
        for (int j = 0; j < m; j++) {
          group[size_t(j)] = {std::fabs(params[p.offset + o * so + (g + j) * si]), j};
        }
        // The N largest stay; among equal magnitudes the lower index is larger.
        std::sort(group.begin(), group.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (int j = n; j < m; j++) {
          mask[size_t(p.offset + o * so + (g + group[size_t(j)].second) * si)] = 0;
        }
      }
    }
  }
  return mask;
}

SparsityMask mask_from_zeros(const ParamTable& table, const float* params) {
  SparsityMask mask(size_t(table.total_floats), 1);
  for (size_t t : prunable_tensors(table)) {
    const ParamDesc& p = table.params[t];
    for (int64_t i = p.offset; i < p.offset + p.shape.numel(); i++) {
      if (params[i] == 0.0f) mask[size_t(i)] = 0;
    }
  }
  return mask;
}

// The CPU table's op (backend/cpu's kernel): one loop for host buffers and the CPU backend.
void apply_mask(const uint8_t* mask, float* buffer, int64_t n) {
  backend::cpu_ops().apply_mask(mask, buffer, n);
}

std::string MaskSpec::describe() const {
  if (kind == Kind::kNM) return fmt::format("{}:{}", n, m);
  return fmt::format("magnitude {:g}% {}", 100 * sparsity, per_layer ? "per layer" : "global");
}

Result<MaskSpec> parse_mask_spec(const std::string& method, const std::string& nm, double sparsity,
                                 bool per_layer, const std::string& flag) {
  MaskSpec s;
  s.sparsity = sparsity;
  s.per_layer = per_layer;
  std::string pattern = method == "n:m" || method == "N:M" ? nm : method;
  if (method == "magnitude") {
    s.kind = MaskSpec::Kind::kMagnitude;
    if (!(sparsity >= 0 && sparsity < 1)) {
      return Status::invalid_argument(fmt::format(
          "--sparsity {}: use a share of the weights to prune in [0, 1), e.g. 0.5", sparsity));
    }
    return s;
  }
  const size_t colon = pattern.find(':');
  int n = 0, m = 0;
  char tail = 0;
  if (colon == std::string::npos || std::sscanf(pattern.c_str(), "%d:%d%c", &n, &m, &tail) != 2) {
    return Status::invalid_argument(
        fmt::format("{} '{}': use magnitude, n:m (with --nm N:M), or an N:M pattern such as 2:4",
                    flag, pattern));
  }
  if (!(n > 0 && m > n && m <= 64)) {
    return Status::invalid_argument(fmt::format(
        "{} {}:{}: N:M needs 0 < N < M <= 64 (2:4 keeps 2 of every 4 weights)", flag, n, m));
  }
  s.kind = MaskSpec::Kind::kNM;
  s.n = n;
  s.m = m;
  return s;
}

Result<SparsityMask> make_mask(const TransformerConfig& config, const ParamTable& table,
                               const float* params, const MaskSpec& spec) {
  if (spec.kind == MaskSpec::Kind::kNM) return nm_mask(config, table, params, spec.n, spec.m);
  if (!(spec.sparsity >= 0 && spec.sparsity < 1)) {
    return Status::invalid_argument(fmt::format("sparsity {} is outside [0, 1)", spec.sparsity));
  }
  return magnitude_mask(table, params, spec.sparsity, spec.per_layer);
}

MaskCounts count_mask(const ParamTable& table, const SparsityMask& mask) {
  MaskCounts c;
  for (size_t t : prunable_tensors(table)) {
    const ParamDesc& p = table.params[t];
    c.prunable += p.shape.numel();
    for (int64_t i = p.offset; i < p.offset + p.shape.numel(); i++)
      c.pruned += mask[size_t(i)] == 0;
  }
  return c;
}

namespace {

// What structured pruning removes: an MLP hidden channel, or a KV group (one key/value head with
// the query heads that read it; in MHA a group is one head).
using Unit = StructuredPrune::Unit;

int64_t unit_count(Unit u, const TransformerConfig& c) {
  return u == Unit::kMlpChannel ? c.mlp_width() : c.kv_heads();
}

// One block's unit j: calls f(flat offset) for every weight and bias it owns, in an order that
// depends only on the shapes that pruning keeps (C, the head size, the group size), so that the
// same unit at another index, or in the pruned model, is visited in the same order.
template <typename F>
void for_unit(Unit u, const TransformerConfig& c, const ParamTable& t, int l, int64_t j, F&& f) {
  const ParamTable::Layer& y = t.layers[size_t(l)];
  const int64_t C = c.n_embd;
  auto off = [&](size_t i) { return t.params[i].offset; };
  if (u == Unit::kMlpChannel) {
    const int64_t I = c.mlp_width();
    if (c.is_gpt2()) {
      const int64_t fc = off(y.fc_w), proj = off(y.fcproj_w);
      for (int64_t i = 0; i < C; i++) f(fc + i * I + j);  // c_fc [C, I]: column j
      f(off(y.fc_b) + j);
      for (int64_t i = 0; i < C; i++) f(proj + j * C + i);  // c_proj [I, C]: row j
    } else {
      const int64_t gate = off(y.fc_w), up = off(y.fc_w + 1), down = off(y.fcproj_w);
      for (int64_t i = 0; i < C; i++) f(gate + j * C + i);  // gate [I, C]: row j
      for (int64_t i = 0; i < C; i++) f(up + j * C + i);    // up [I, C]: row j
      for (int64_t i = 0; i < C; i++) f(down + i * I + j);  // down [C, I]: column j
    }
    return;
  }
  // KV group j: query heads j G .. (j + 1) G - 1 (G = n_head / kv_heads) and kv head j. Head h's
  // features are h HS .. (h + 1) HS - 1 of q's output (and of the output projection's input);
  // kv head j's are j HS .. of k's and of v's.
  const int64_t HS = c.head_size(), G = c.n_head / c.kv_heads();
  const int64_t A = c.attn_width(), KV = int64_t(c.kv_heads()) * HS;
  const int64_t q0 = j * G * HS, kv0 = j * HS;  // first q feature, first k (v) feature
  if (c.is_gpt2()) {
    // c_attn [C, A + 2 KV] (q | k | v columns; GPT-2 is MHA: KV = A), its bias; c_proj [A, C].
    const int64_t W = c.qkv_width(), at = off(y.qkv_w), proj = off(y.attproj_w);
    for (int64_t part = 0; part < 3; part++) {
      const int64_t col0 = part == 0 ? q0 : A + (part - 1) * KV + kv0;
      const int64_t n = part == 0 ? G * HS : HS;
      for (int64_t i = 0; i < C; i++) {
        for (int64_t d = 0; d < n; d++) f(at + i * W + col0 + d);
      }
      if (y.qkv_b != ParamTable::kNone) {
        for (int64_t d = 0; d < n; d++) f(off(y.qkv_b) + col0 + d);
      }
    }
    for (int64_t d = 0; d < G * HS; d++) {
      for (int64_t i = 0; i < C; i++) f(proj + (q0 + d) * C + i);  // c_proj: rows of the heads
    }
    return;
  }
  // q_proj [A, C], k_proj and v_proj [KV, C] (rows), their biases (Qwen2); o_proj [C, A].
  const int64_t rows0[3] = {q0, kv0, kv0}, rows[3] = {G * HS, HS, HS};
  for (size_t part = 0; part < 3; part++) {
    const int64_t w = off(y.qkv_w + part);
    for (int64_t r = 0; r < rows[part]; r++) {
      for (int64_t i = 0; i < C; i++) f(w + (rows0[part] + r) * C + i);
    }
    if (y.qkv_b != ParamTable::kNone) {
      for (int64_t r = 0; r < rows[part]; r++) f(off(y.qkv_b + part) + rows0[part] + r);
    }
  }
  const int64_t o = off(y.attproj_w);
  for (int64_t i = 0; i < C; i++) {
    for (int64_t d = 0; d < G * HS; d++) f(o + i * A + q0 + d);  // o_proj: columns of the heads
  }
}

// The tensors whose shapes a unit's removal changes (the rest are copied whole).
std::vector<bool> unit_tensors(Unit u, const TransformerConfig& c, const ParamTable& t) {
  std::vector<bool> owned(t.params.size(), false);
  auto mark = [&](size_t i, int n) {
    if (i == ParamTable::kNone) return;
    for (int k = 0; k < n; k++) owned[i + size_t(k)] = true;
  };
  const int fused = c.is_gpt2() ? 1 : 3;  // c_attn, or q_proj | k_proj | v_proj
  for (const ParamTable::Layer& y : t.layers) {
    if (u == Unit::kMlpChannel) {
      mark(y.fc_w, c.is_gpt2() ? 1 : 2);  // c_fc, or gate | up
      mark(y.fc_b, 1);
      mark(y.fcproj_w, 1);
    } else {
      mark(y.qkv_w, fused);
      mark(y.qkv_b, fused);
      mark(y.attproj_w, 1);
    }
  }
  return owned;
}

// Keeps in every block the `keep` units of largest L2 norm (in their original order) and writes
// `out_config`'s smaller model. REQUIRES: out_config has `keep` units and otherwise the shapes
// of `config`.
StructuredPrune prune_units(Unit u, const TransformerConfig& config, const ParamTable& table,
                            const float* params, const TransformerConfig& out_config,
                            int64_t keep) {
  const int64_t n_units = unit_count(u, config);
  StructuredPrune out;
  out.config = out_config;
  out.table = gpt2_param_table(out.config);
  HR_CHECK_MSG(out.table.params.size() == table.params.size() && unit_count(u, out_config) == keep,
               "prune_units: the pruned model's tensors differ");
  // Each block keeps the `keep` units of largest L2 norm (ties: the lower index stays) and
  // removes the rest; gather_kept keeps the original order.
  out.unit = u;
  out.removed.resize(table.layers.size());
  for (int l = 0; l < int(table.layers.size()); l++) {
    std::vector<double> score(size_t(n_units), 0.0);
    for (int64_t j = 0; j < n_units; j++) {
      double s = 0;
      for_unit(u, config, table, l, j, [&](int64_t k) { s += double(params[k]) * params[k]; });
      score[size_t(j)] = std::sqrt(s);
    }
    std::vector<int64_t> order(static_cast<size_t>(n_units));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return score[size_t(a)] > score[size_t(b)]; });
    out.removed[size_t(l)].assign(order.begin() + keep, order.end());
    std::sort(out.removed[size_t(l)].begin(), out.removed[size_t(l)].end());
  }
  out.params = gather_kept(config, table, params, out);
  return out;
}

void zero_units(Unit u, const TransformerConfig& config, const ParamTable& table, float* params,
                const std::vector<std::vector<int64_t>>& removed) {
  for (int l = 0; l < int(removed.size()); l++) {
    for (int64_t j : removed[size_t(l)]) {
      for_unit(u, config, table, l, j, [&](int64_t k) { params[k] = 0.0f; });
    }
  }
}

}  // namespace

std::vector<float> gather_kept(const TransformerConfig& config, const ParamTable& table,
                               const float* buffer, const StructuredPrune& pruned) {
  const Unit u = pruned.unit;
  const int64_t n_units = unit_count(u, config), keep = unit_count(u, pruned.config);
  HR_CHECK_MSG(pruned.removed.size() == table.layers.size(),
               "gather_kept: the pruning is of another model");
  std::vector<float> out(size_t(pruned.table.total_floats), 0.0f);
  // Copy every tensor; the units' tensors gather the kept units. A unit's weights and biases are
  // visited in the same order in both models (for_unit), so pairing the visits copies each one
  // to its place.
  const std::vector<bool> owned = unit_tensors(u, config, table);
  for (size_t i = 0; i < table.params.size(); i++) {
    if (owned[i]) continue;
    const ParamDesc& src = table.params[i];
    const ParamDesc& dst = pruned.table.params[i];
    HR_CHECK_MSG(src.name == dst.name && src.shape == dst.shape,
                 "gather_kept: a tensor outside the pruned units changed");
    std::copy(buffer + src.offset, buffer + src.offset + src.shape.numel(),
              out.data() + dst.offset);
  }
  std::vector<int64_t> from;
  for (int l = 0; l < int(table.layers.size()); l++) {
    const std::vector<int64_t>& removed = pruned.removed[size_t(l)];
    HR_CHECK_MSG(int64_t(removed.size()) == n_units - keep,
                 "gather_kept: a block's removed units do not match the pruned model");
    int64_t n = 0;
    for (int64_t j = 0; j < n_units; j++) {
      if (std::binary_search(removed.begin(), removed.end(), j)) continue;
      from.clear();
      for_unit(u, config, table, l, j, [&](int64_t k) { from.push_back(k); });
      size_t q = 0;
      for_unit(u, pruned.config, pruned.table, l, n,
               [&](int64_t k) { out[size_t(k)] = buffer[from[q++]]; });
      HR_CHECK(q == from.size());
      n++;
    }
  }
  return out;
}

Result<StructuredPrune> prune_mlp_channels(const TransformerConfig& config, const ParamTable& table,
                                           const float* params, double sparsity) {
  if (!(sparsity >= 0 && sparsity < 1)) {
    return Status::invalid_argument(fmt::format(
        "--sparsity {}: use a share in [0, 1) of the MLP channels to remove", sparsity));
  }
  const int64_t I = config.mlp_width();
  const auto keep = int64_t(std::llround((1 - sparsity) * double(I)));
  if (keep < 1) {
    return Status::invalid_argument(
        fmt::format("--sparsity {} would remove all {} MLP channels of every block; use a "
                    "smaller share",
                    sparsity, I));
  }
  TransformerConfig c = config;
  c.intermediate_size = int(keep);
  HR_RETURN_IF_ERROR(c.validate());
  return prune_units(Unit::kMlpChannel, config, table, params, c, keep);
}

Result<StructuredPrune> prune_attention_heads(const TransformerConfig& config,
                                              const ParamTable& table, const float* params,
                                              double sparsity) {
  const int groups = config.kv_heads(), G = config.n_head / config.kv_heads();
  const std::string unit = G == 1 ? "attention heads" : "KV groups";
  if (!(sparsity >= 0 && sparsity < 1)) {
    return Status::invalid_argument(
        fmt::format("--sparsity {}: use a share in [0, 1) of the {} to remove", sparsity, unit));
  }
  const auto keep = int64_t(std::llround((1 - sparsity) * double(groups)));
  if (keep < 1) {
    return Status::invalid_argument(fmt::format(
        "--sparsity {} would remove all {} {} of every block (each keeps round((1 - {}) x {}) = "
        "0); use a smaller share",
        sparsity, groups, unit, sparsity, groups));
  }
  TransformerConfig c = config;
  const int HS = config.head_size();
  c.n_head = int(keep) * G;
  // GPT-2's n_kv_head stays 0 (= n_head); the Llama family's says how many groups are left.
  if (config.n_kv_head > 0) c.n_kv_head = int(keep);
  c.head_dim = 0;
  c.set_head_dim(HS);  // explicit unless the kept heads happen to span n_embd again
  HR_RETURN_IF_ERROR(c.validate());
  return prune_units(Unit::kKvGroup, config, table, params, c, keep);
}

void zero_mlp_channels(const TransformerConfig& config, const ParamTable& table, float* params,
                       const std::vector<std::vector<int64_t>>& removed) {
  zero_units(Unit::kMlpChannel, config, table, params, removed);
}

void zero_attention_heads(const TransformerConfig& config, const ParamTable& table, float* params,
                          const std::vector<std::vector<int64_t>>& removed) {
  zero_units(Unit::kKvGroup, config, table, params, removed);
}

void zero_attention_output(const TransformerConfig& config, const ParamTable& table, float* params,
                           const std::vector<std::vector<int64_t>>& removed) {
  const int64_t C = config.n_embd, HS = config.head_size(), A = config.attn_width();
  const int64_t G = config.n_head / config.kv_heads();
  for (int l = 0; l < int(removed.size()); l++) {
    const int64_t o = table.params[table.layers[size_t(l)].attproj_w].offset;
    for (int64_t j : removed[size_t(l)]) {
      for (int64_t d = j * G * HS; d < (j + 1) * G * HS; d++) {
        for (int64_t i = 0; i < C; i++) {
          // GPT-2's c_proj [A, C]: row d; Llama's o_proj [C, A]: column d.
          params[config.is_gpt2() ? o + d * C + i : o + i * A + d] = 0.0f;
        }
      }
    }
  }
}

Result<double> mean_loss(const TransformerConfig& config, const ParamTable& table,
                         const float* params, const int32_t* inputs, const int32_t* targets,
                         int64_t sequences, int B, int T) {
  memory::HostResource host;
  double sum = 0;
  int64_t count = 0;
  Gpt2 net(config, &table);
  net.bind_params(const_cast<float*>(params), nullptr);
  for (int64_t q = 0; q < sequences; q += B) {
    const int b = int(std::min<int64_t>(B, sequences - q));
    const ActivationTable acts = gpt2_activation_table(config, b, T, /*training=*/false);
    HR_ASSIGN_OR_RETURN(
        memory::Arena arena,
        memory::Arena::create(&host, acts.buffers, memory::sequential_layout(acts.buffers),
                              memory::Category::kActivations));
    net.bind_activations(&arena, &acts, b, T);
    int64_t valid = 0;
    sum += net.forward(inputs + q * T, targets + q * T, &valid);
    count += valid;
  }
  return count ? sum / double(count) : 0.0;
}

}  // namespace headroom::model
