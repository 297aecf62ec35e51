// Fits of the cost model's measured terms, and the cache of self-corrections (cost_terms.h).
#include "plan/cost_terms.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/utf8.h"

namespace headroom::plan {

std::string_view cost_kind_name(CostKind k) {
  switch (k) {
    case CostKind::kGemm:
      return "gemm";
    case CostKind::kAttention:
      return "attention";
    case CostKind::kNorm:
      return "norm";
    case CostKind::kElementwise:
      return "elementwise";
    case CostKind::kLoss:
      return "loss";
    case CostKind::kEmbedding:
      return "embedding";
    case CostKind::kOptimizer:
      return "optimizer";
    case CostKind::kCount:
      break;
  }
  return "?";
}

LineFit fit_line(const std::vector<std::pair<double, double>>& xy) {
  LineFit f;
  if (xy.empty()) return f;
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : xy) {
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double n = double(xy.size());
  const double det = n * sxx - sx * sx;
  if (xy.size() >= 2 && det > 1e-12 * n * sxx) {
    f.slope = (n * sxy - sx * sy) / det;
    f.intercept = (sy - f.slope * sx) / n;
    if (f.intercept >= 0 && f.slope >= 0) return f;
  }
  // Through the origin: a negative intercept is noise at the small sizes, not a negative cost.
  f.intercept = 0;
  f.slope = sxx > 0 ? sxy / sxx : 0;
  return f;
}

double GemmTerm::seconds(double flops, double rows) const {
  if (flops <= 0) return 0;
  HR_CHECK_MSG(rate > 0 && rows > 0, "GemmTerm::seconds on an unmeasured class");
  return flops / (rate * rows / (rows + half_rows));
}

GemmTerm fit_gemm(const std::vector<GemmSample>& samples) {
  std::vector<std::pair<double, double>> xy;
  for (const GemmSample& s : samples) {
    if (s.flops > 0 && s.rows > 0 && s.seconds > 0)
      xy.push_back({1.0 / s.rows, s.seconds / s.flops});
  }
  HR_CHECK_MSG(!xy.empty(), "fit_gemm: no usable sample");
  const LineFit f = fit_line(xy);
  GemmTerm t;
  if (f.intercept > 0) {
    t.rate = 1.0 / f.intercept;
    t.half_rows = f.slope / f.intercept;
  } else {
    // Seconds per FLOP proportional to 1/rows alone: every sample far below its large-row rate.
    // Keep the fastest sample's rate with no row penalty (a conservative fallback).
    double best = 0;
    for (const GemmSample& s : samples) best = std::max(best, s.flops / s.seconds);
    t.rate = best;
    t.half_rows = 0;
  }
  double forward = 0, pair = 0;
  for (const GemmSample& s : samples) {
    if (s.forward_seconds > 0 && s.seconds > 0) forward += s.forward_seconds, pair += s.seconds;
  }
  if (pair > 0) t.forward_share = std::clamp(forward / pair, 0.15, 0.6);
  return t;
}

KernelTerm fit_attention(const std::vector<AttentionSample>& samples) {
  // Least squares of heads/s * a + units/s * b = 1 (relative error), through the origin.
  double hh = 0, hu = 0, uu = 0, h1 = 0, u1 = 0;
  for (const AttentionSample& s : samples) {
    if (!(s.seconds > 0)) continue;
    const double h = s.heads / s.seconds, u = s.units / s.seconds;
    hh += h * h, hu += h * u, uu += u * u, h1 += h, u1 += u;
  }
  HR_CHECK_MSG(uu > 0, "fit_attention: no usable sample");
  const double det = hh * uu - hu * hu;
  KernelTerm t;
  if (det > 1e-12 * hh * uu) {
    t.call_seconds = (h1 * uu - u1 * hu) / det;
    t.unit_seconds = (u1 * hh - h1 * hu) / det;
  }
  // Collinear samples, or a negative cost (noise): one term alone.
  if (!(t.call_seconds >= 0 && t.unit_seconds > 0)) t = {0, u1 / uu};
  return t;
}

KernelTerm fit_kernel(const std::vector<std::pair<double, double>>& units_seconds) {
  LineFit f = fit_line(units_seconds);
  // Whether the seconds grow with the units at all (the unconstrained slope's sign).
  double sx = 0, sy = 0, sxy = 0, sxx = 0;
  for (const auto& [x, y] : units_seconds) sx += x, sy += y, sxy += x * y, sxx += x * x;
  const double n = double(units_seconds.size());
  if (!(f.slope > 0) || (n >= 2 && n * sxy - sx * sy <= 0)) {
    // Larger sizes timed no slower than small ones (noise on a shared machine): the largest
    // sample's seconds per unit, no per-call term.
    double x = 0, y = 0;
    for (const auto& [u, t] : units_seconds) {
      if (u > x) x = u, y = t;
    }
    f = {0, x > 0 ? y / x : 0};
  }
  return {f.intercept, f.slope};
}

GemmClass gemm_class(int64_t in_cols, int64_t out_cols) {
  if (std::max(in_cols, out_cols) >= kHeadCols)
    return std::min(in_cols, out_cols) <= kSmallCols ? GemmClass::kHeadSmall : GemmClass::kHead;
  return std::min(in_cols, out_cols) <= kSmallCols ? GemmClass::kSmall : GemmClass::kLarge;
}

const GemmTerm& CostTerms::gemm(GemmClass c, bool bf16) const {
  const size_t p = bf16 ? 1 : 0;
  switch (c) {
    case GemmClass::kSmall:
      return gemm_small[p];
    case GemmClass::kLarge:
      return gemm_large[p];
    case GemmClass::kHeadSmall:
      return gemm_head_small[p];
    case GemmClass::kHead:
      break;
  }
  return gemm_head[p];
}

CostCorrection correction_from(const std::array<double, kCostKinds>& predicted,
                               const std::array<double, kCostKinds>& measured,
                               double measured_step_seconds, double tokens, int steps,
                               double fused_head_gemm) {
  CostCorrection c;
  c.steps = steps;
  double covered = 0;  // measured seconds of the kinds the model predicts
  const size_t gemm = size_t(CostKind::kGemm), loss = size_t(CostKind::kLoss);
  for (size_t k = 0; k < kCostKinds; k++) {
    if (k == loss && fused_head_gemm > 0 && measured[k] > 0) {
      // The loss's own part: what is left of it after the head's GEMMs at the GEMM scale.
      const double own = predicted[k] - fused_head_gemm;
      const double rest = measured[k] - fused_head_gemm * c.scale[gemm];
      c.scale[k] = own > 0 && rest > 0 ? std::clamp(rest / own, 0.05, 20.0) : 1.0;
      covered += std::max(own, 0.0) * c.scale[k] + fused_head_gemm * c.scale[gemm];
    } else if (predicted[k] > 0 && measured[k] > 0) {
      // What a clamped scale leaves unexplained goes to the per-token rest below.
      c.scale[k] = std::clamp(measured[k] / predicted[k], 0.05, 20.0);
      covered += predicted[k] * c.scale[k];
    } else if (predicted[k] > 0) {
      c.scale[k] = 1.0;  // not timed: keep the model's figure
      covered += predicted[k];
    }
  }
  const double rest = measured_step_seconds - covered;
  c.other_seconds_per_token = tokens > 0 && rest > 0 ? rest / tokens : 0.0;
  return c;
}

std::string corrections_path(const std::string& calibration_path) {
  const std::filesystem::path p(calibration_path);
  return (p.has_parent_path() ? p.parent_path() / "corrections.json" : "corrections.json").string();
}

std::string correction_machine_key(const std::string& cpu_model, int threads) {
  return fmt::format("{}|{} threads", cpu_model, threads);
}

namespace {
Result<nlohmann::json> read_corrections(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return Status::not_found("no corrections file '" + path + "'");
  }
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return Status::io_error("cannot read corrections file '" + path + "'");
  try {
    nlohmann::json j = nlohmann::json::parse(text.str());
    if (!j.is_object()) throw std::runtime_error("not an object");
    return j;
  } catch (const std::exception& e) {
    return Status::corrupt("corrections file '" + path + "' is not a JSON object (" + e.what() +
                           "); delete it (it is a cache)");
  }
}
}  // namespace

Result<CostCorrection> load_correction(const std::string& path, const std::string& machine,
                                       const std::string& key) {
  HR_ASSIGN_OR_RETURN(nlohmann::json j, read_corrections(path));
  auto m = j.find(machine);
  if (m == j.end() || !m->is_object() || !m->contains(key)) {
    return Status::not_found(fmt::format("no correction for {} on {} in '{}'", key, machine, path));
  }
  const nlohmann::json& e = (*m)[key];
  auto bad = [&](const std::string& field) {
    return Status::corrupt(
        fmt::format("corrections file '{}': {} / {}: field '{}' is missing or "
                    "not a positive number; delete the file (it is a cache)",
                    path, machine, key, field));
  };
  CostCorrection c;
  for (size_t k = 0; k < kCostKinds; k++) {
    const std::string name(cost_kind_name(CostKind(k)));
    if (!e.contains("scale") || !e["scale"].contains(name) || !e["scale"][name].is_number())
      return bad("scale." + name);
    const double v = e["scale"][name].get<double>();
    if (!std::isfinite(v) || v <= 0) return bad("scale." + name);
    c.scale[k] = v;
  }
  if (!e.contains("other_seconds_per_token") || !e["other_seconds_per_token"].is_number())
    return bad("other_seconds_per_token");
  c.other_seconds_per_token = e["other_seconds_per_token"].get<double>();
  if (!std::isfinite(c.other_seconds_per_token) || c.other_seconds_per_token < 0)
    return bad("other_seconds_per_token");
  if (!e.contains("steps") || !e["steps"].is_number_integer() || e["steps"].get<int>() < 1)
    return bad("steps");
  c.steps = e["steps"].get<int>();
  return c;
}

Status save_correction(const std::string& path, const std::string& machine, const std::string& key,
                       const CostCorrection& c) {
  Result<nlohmann::json> old = read_corrections(path);
  nlohmann::json j = old.is_ok() ? *old : nlohmann::json::object();
  nlohmann::json scale = nlohmann::json::object();
  for (size_t k = 0; k < kCostKinds; k++)
    scale[std::string(cost_kind_name(CostKind(k)))] = c.scale[k];
  if (!j[machine].is_object()) j[machine] = nlohmann::json::object();
  j[machine][key] = {
      {"scale", scale}, {"other_seconds_per_token", c.other_seconds_per_token}, {"steps", c.steps}};
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path target(path);
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << dump_json(j, 2) << "\n";
    if (!out) return Status::io_error("cannot write corrections file '" + tmp + "'");
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    fs::remove(tmp, ec);
    return Status::io_error("cannot rename '" + tmp + "' to '" + path + "'");
  }
  return Status::ok();
}

}  // namespace headroom::plan
