// Pruning masks and structured MLP pruning (model/prune.h; decisions in docs/notes/pruning.md).
#include "model/prune.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include <fmt/format.h>

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

void apply_mask(const uint8_t* mask, float* buffer, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    // A multiply would keep -0.0 and turn NaN * 0 into NaN; pruned weights are +0.0 exactly.
    if (!mask[i]) buffer[i] = 0.0f;
  }
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

// One block's MLP channel j: calls f(flat offset) for every weight and bias it owns.
template <typename F>
void for_channel(const TransformerConfig& c, const ParamTable& t, int l, int64_t j, F&& f) {
  const ParamTable::Layer& y = t.layers[size_t(l)];
  const int64_t C = c.n_embd, I = c.mlp_width();
  if (c.is_gpt2()) {
    const int64_t fc = t.params[y.fc_w].offset, proj = t.params[y.fcproj_w].offset;
    for (int64_t i = 0; i < C; i++) f(fc + i * I + j);  // c_fc [C, I]: column j
    f(t.params[y.fc_b].offset + j);
    for (int64_t i = 0; i < C; i++) f(proj + j * C + i);  // c_proj [I, C]: row j
  } else {
    const int64_t gate = t.params[y.fc_w].offset, up = t.params[y.fc_w + 1].offset;
    const int64_t down = t.params[y.fcproj_w].offset;
    for (int64_t i = 0; i < C; i++) f(gate + j * C + i);  // gate [I, C]: row j
    for (int64_t i = 0; i < C; i++) f(up + j * C + i);    // up [I, C]: row j
    for (int64_t i = 0; i < C; i++) f(down + i * I + j);  // down [C, I]: column j
  }
}

}  // namespace

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
  StructuredPrune out;
  out.config = config;
  out.config.intermediate_size = int(keep);
  HR_RETURN_IF_ERROR(out.config.validate());
  out.table = gpt2_param_table(out.config);
  HR_CHECK_MSG(out.table.params.size() == table.params.size(),
               "prune_mlp_channels: the pruned model's tensors differ");
  out.params.assign(size_t(out.table.total_floats), 0.0f);
  // Which channels each block keeps: the `keep` of largest L2 norm, in their original order.
  std::vector<std::vector<int64_t>> kept(table.layers.size());
  out.removed.resize(table.layers.size());
  for (int l = 0; l < int(table.layers.size()); l++) {
    std::vector<double> score(size_t(I), 0.0);
    for (int64_t j = 0; j < I; j++) {
      double s = 0;
      for_channel(config, table, l, j, [&](int64_t k) { s += double(params[k]) * params[k]; });
      score[size_t(j)] = std::sqrt(s);
    }
    std::vector<int64_t> order(static_cast<size_t>(I));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return score[size_t(a)] > score[size_t(b)]; });
    kept[size_t(l)].assign(order.begin(), order.begin() + keep);
    out.removed[size_t(l)].assign(order.begin() + keep, order.end());
    std::sort(kept[size_t(l)].begin(), kept[size_t(l)].end());
    std::sort(out.removed[size_t(l)].begin(), out.removed[size_t(l)].end());
  }
  // Copy every tensor; the MLP's channel tensors gather the kept channels. A channel's weights
  // and biases are visited in the same order in both models (for_channel), so pairing the
  // visits copies each one to its place.
  std::vector<bool> mlp(table.params.size(), false);
  for (const ParamTable::Layer& y : table.layers) {
    mlp[y.fc_w] = mlp[y.fcproj_w] = true;
    if (!config.is_gpt2()) mlp[y.fc_w + 1] = true;
    if (y.fc_b != ParamTable::kNone) mlp[y.fc_b] = true;
  }
  for (size_t i = 0; i < table.params.size(); i++) {
    if (mlp[i]) continue;
    const ParamDesc& src = table.params[i];
    const ParamDesc& dst = out.table.params[i];
    HR_CHECK_MSG(src.name == dst.name && src.shape == dst.shape,
                 "prune_mlp_channels: a tensor outside the MLP changed");
    std::copy(params + src.offset, params + src.offset + src.shape.numel(),
              out.params.data() + dst.offset);
  }
  std::vector<int64_t> from;
  for (int l = 0; l < int(table.layers.size()); l++) {
    for (int64_t n = 0; n < keep; n++) {
      from.clear();
      for_channel(config, table, l, kept[size_t(l)][size_t(n)],
                  [&](int64_t k) { from.push_back(k); });
      size_t q = 0;
      for_channel(out.config, out.table, l, n,
                  [&](int64_t k) { out.params[size_t(k)] = params[from[q++]]; });
      HR_CHECK(q == from.size());
    }
  }
  return out;
}

void zero_mlp_channels(const TransformerConfig& config, const ParamTable& table, float* params,
                       const std::vector<std::vector<int64_t>>& removed) {
  for (int l = 0; l < int(removed.size()); l++) {
    for (int64_t j : removed[size_t(l)]) {
      for_channel(config, table, l, j, [&](int64_t k) { params[k] = 0.0f; });
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
