// The step cost model.
#include "plan/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "backend/cpu/kernels.h"
#include "core/check.h"

namespace headroom::plan {

namespace {
// Seconds of GEMM work at this plan's micro-batch: FLOPs per token x tokens / the GEMM rate.
double gemm_rate(const MemoryPlan& plan, const DeviceSpec& d) {
  const double rows = double(plan.policy.micro_batch) * plan.policy.seq;
  const double peak =
      (plan.policy.precision == "bf16" && d.flops_bf16 > 0) ? d.flops_bf16 : d.flops_fp32;
  return peak * d.gemm_efficiency * rows / (rows + kGemmHalfRows);
}

// Note [Measured terms]: one micro-batch's kernels priced with calibrate's fits, times the
// accumulation, plus the optimizer step. A forward is taken as a third of its forward + backward
// pair (the recomputations re-run forwards only).
std::array<double, kCostKinds> measured_kinds(const model::Gpt2Config& c, const MemoryPlan& plan,
                                              const CostTerms& t, double optimizer_floats,
                                              bool offload, double* fused_head_gemm) {
  std::array<double, kCostKinds> kind{};
  const double b = plan.policy.micro_batch, T = plan.policy.seq, k = plan.policy.accumulation;
  const double N = b * T, C = c.n_embd, L = c.n_layer, V = c.vocab_size;
  const double A = double(c.attn_width());  // the attention's width (C unless head_dim is set)
  const bool bf16 = plan.policy.precision == "bf16" && t.gemm_large[1].rate > 0;
  double full = 0, selective = 0;
  for (int l = 0; l < c.n_layer; l++) {
    full += plan.policy.exec.recompute_at(l) == model::Recompute::kFull;
    selective += plan.policy.exec.recompute_at(l) == model::Recompute::kSelective;
  }
  auto term = [&](double ic, double oc) -> const GemmTerm& {
    return t.gemm(gemm_class(int64_t(ic), int64_t(oc)), bf16);
  };
  auto gemm = [&](double ic, double oc, double rows, double flops) {
    return term(ic, oc).seconds(flops, rows);
  };
  const std::pair<double, double> shapes[] = {
      {C, double(c.qkv_width())}, {A, C}, {C, double(c.fc_width())}, {double(c.mlp_width()), C}};
  double g = 0;
  for (const auto& [ic, oc] : shapes) {
    // Forward and backward (6 FLOPs per weight per row) in every block, a forward more in each
    // fully recomputed one (the class's measured share of the pair).
    const double pair = gemm(ic, oc, N, 6.0 * N * ic * oc);
    g += L * pair + full * term(ic, oc).forward_share * pair;
  }
  double loss = t.loss.seconds(1, N * V);
  const double chunk = plan.policy.exec.head_chunk;
  if (chunk > 0) {
    // The fused head: forward, the backward's recompute, dinp and dwte per chunk of rows, timed
    // by the executor as the loss.
    *fused_head_gemm = k * gemm(C, V, std::min(chunk, N), 8.0 * N * C * V);
    loss += *fused_head_gemm / k;
  } else {
    g += gemm(C, V, N, 6.0 * N * C * V);
  }
  const double recomputed_forwards = (selective + full) / 3.0;
  kind[size_t(CostKind::kGemm)] = k * g;
  const double attention_calls = L + full / 3.0;  // a recomputed forward: a third of the pair
  kind[size_t(CostKind::kAttention)] =
      k * t.attention[bf16 ? 1 : 0].seconds(attention_calls * b * c.n_head,
                                            attention_calls * 12.0 * T * A * N);
  const double norm_pairs = 2.0 * L + 1.0 + 2.0 * recomputed_forwards;
  kind[size_t(CostKind::kNorm)] = k * t.norm.seconds(norm_pairs, norm_pairs * N * C);
  const double gelu_pairs = L + recomputed_forwards;
  const double residual_pairs = 2.0 * L + 2.0 * full / 3.0;
  kind[size_t(CostKind::kElementwise)] =
      k * (t.gelu.seconds(gelu_pairs, gelu_pairs * N * double(c.mlp_width())) +
           t.residual.seconds(residual_pairs, residual_pairs * N * C));
  kind[size_t(CostKind::kLoss)] = k * loss;
  kind[size_t(CostKind::kEmbedding)] = k * t.embedding.seconds(1, N * C);
  // bf16 with the weight copy: AdamW writes it in the same pass, timed so (calibrate's [1]).
  const bool copy =
      plan.policy.exec.precision == model::Precision::kBf16 && plan.policy.exec.bf16_weight_copy;
  kind[size_t(CostKind::kOptimizer)] =
      offload ? 0.0 : t.optimizer[copy ? 1 : 0].seconds(1, optimizer_floats);
  return kind;
}
}  // namespace

double offload_exposed_seconds(const model::Gpt2Config& c, const MemoryPlan& plan,
                               const DeviceSpec& d, double bandwidth) {
  const model::ActivationTable& t = plan.activations;
  if (t.offloaded.empty()) return 0;
  HR_CHECK_MSG(bandwidth > 0, "offload priced without an offload bandwidth");
  const double rows = double(plan.policy.micro_batch) * plan.policy.seq;
  const double C = c.n_embd, T = plan.policy.seq, V = c.vocab_size, A = double(c.attn_width());
  const double G = double(c.block_gemm_weights());
  const double rate = gemm_rate(plan, d);
  // A block's forward GEMMs and attention per micro-batch, and the LM head's.
  const double block_fwd = (2.0 * G + 4.0 * T * A) * rows / rate;
  const double head_fwd = 2.0 * V * C * rows / rate;
  const double head_bwd = (plan.policy.exec.head_chunk > 0 ? 6.0 : 4.0) * V * C * rows / rate;
  double exposed = 0;
  for (const model::OffloadBlock& ob : t.offloaded) {
    const int l = ob.layer;
    const double transfer = double(ob.bytes) / bandwidth;
    // Out: during the next op's forward. Back: during the backward of the op before this
    // block's (block l+1, whose full recomputation runs there too, or the LM head).
    const bool last = l + 1 >= c.n_layer;
    const double fwd_next = last ? head_fwd : block_fwd;
    const double bwd_prev =
        last ? head_bwd
             : 2.0 * block_fwd + (plan.policy.exec.recompute_at(l + 1) == model::Recompute::kFull
                                      ? block_fwd
                                      : 0.0);
    exposed += std::max(0.0, transfer - fwd_next) + std::max(0.0, transfer - bwd_prev);
  }
  return exposed;
}

std::string correction_model_key(const model::Gpt2Config& c, const std::string& precision) {
  // An explicit head_dim (pruned heads) is part of the shape; absent, the key is as before.
  const std::string hd = c.head_dim > 0 ? fmt::format("-D{}", c.head_dim) : "";
  return fmt::format("{}-L{}-C{}-H{}{}-V{}-{}", c.is_gpt2() ? "gpt2" : "llama", c.n_layer, c.n_embd,
                     c.n_head, hd, c.vocab_size, precision);
}

StepCost estimate_step(const model::Gpt2Config& c, const MemoryPlan& plan, const DeviceSpec& d,
                       const ZeroSpec* zero) {
  StepCost s;
  const double b = plan.policy.micro_batch, T = plan.policy.seq, k = plan.policy.accumulation;
  const double C = c.n_embd, L = c.n_layer, V = c.vocab_size;
  const double A = double(c.attn_width());  // the attention's width: C, or n_head x head_dim
  const double G = double(c.block_gemm_weights());  // 12 C^2 in GPT-2
  const double rows = b * T;
  // Matmul weights touched per token: 12 C^2 per block plus the tied LM head.
  const double matmul_params = L * G + V * C;
  // Forward 2 FLOPs per weight per token, backward 4; attention scores and mixing: 4 T A per
  // token per layer forward, 8 backward.
  const double per_token = 6.0 * matmul_params + 12.0 * L * T * A;
  const double tokens = rows * k;
  s.gemm_flops = per_token * tokens;
  // Recomputation re-runs work inside the backward: a full block's forward (its GEMMs and
  // attention), or for selective the two LayerNorms and the GELU (memory traffic only).
  double full_blocks = 0, selective_blocks = 0;
  for (int l = 0; l < c.n_layer; l++) {
    full_blocks += plan.policy.exec.recompute_at(l) == model::Recompute::kFull;
    selective_blocks += plan.policy.exec.recompute_at(l) == model::Recompute::kSelective;
  }
  s.gemm_flops += full_blocks * (2.0 * G + 4.0 * T * A) * tokens;
  // The fused LM head recomputes each chunk's logits in the backward: one more head GEMM.
  if (plan.policy.exec.head_chunk > 0) s.gemm_flops += 2.0 * V * C * tokens;
  const double non_embedding = double(plan.params.num_parameters) - double(c.lookup_parameters());
  s.model_flops = (6.0 * non_embedding + 12.0 * L * T * A) * tokens;

  // fp16 runs at the device's fp16 rate where it has fp16 GEMMs (a GPU's tensor cores); the CPU
  // backend has none (flops_fp16 0: oneDNN 2.6 has no f16 matmul on x86), so its fp16 GEMMs are
  // fp32 GEMMs on widened operands (Note [fp16 GEMMs]), priced at the fp32 rate plus the
  // widening traffic below.
  const bool fp16_widened = plan.policy.precision == "fp16" && !(d.flops_fp16 > 0);
  double peak = d.flops_fp32;
  if (plan.policy.precision == "bf16" && d.flops_bf16 > 0) peak = d.flops_bf16;
  if (plan.policy.precision == "fp16" && d.flops_fp16 > 0) peak = d.flops_fp16;
  const double efficiency = d.gemm_efficiency * rows / (rows + kGemmHalfRows);
  // The fused head runs its GEMMs (forward, the backward's recompute, dinp and dwte) per chunk of
  // head_chunk rows: they reach the efficiency of that many rows, not of the micro-batch's.
  const double head_chunk = plan.policy.exec.head_chunk;
  const double head_flops = head_chunk > 0 ? 8.0 * V * C * tokens : 0.0;
  const double head_rows = std::min(head_chunk, rows);
  const double head_efficiency = d.gemm_efficiency * head_rows / (head_rows + kGemmHalfRows);
  s.gemm_seconds = (s.gemm_flops - head_flops) / (peak * efficiency) +
                   (head_flops > 0 ? head_flops / (peak * head_efficiency) : 0.0);

  // Memory-bound traffic per micro-batch: every step buffer written once and read about three
  // times (forward consumers, backward, the gradient pass); per step: AdamW reads p, g, m, v and
  // writes p, m, v, plus zeroing and the norm of the gradients.
  double step_buffer_bytes = 0;
  // Offload landing buffers (category staging) are written by the copy and take over the reads
  // of the saved buffers they replace: their traffic is the copy's, priced below.
  for (const memory::BufferDesc& buf : plan.step.buffers) {
    if (buf.category != memory::Category::kStaging) step_buffer_bytes += double(buf.bytes());
  }
  const bool sharded = zero && zero->ranks > 1;
  // Stages 1-3 run AdamW on this rank's shard only (m's floats: counted as if on the device).
  double optimizer_floats = double(plan.params.total_floats);
  if (sharded && zero->stage > 0) {
    ZeroSpec on_device = *zero;
    on_device.offload_optimizer = false;
    optimizer_floats = double(zero_memory(on_device).optimizer) / 8.0;
  }
  const double param_bytes = optimizer_floats * 4.0;
  // Selective recomputation reads x and residual2 (C each) and fch (4C) and writes ln1, ln2
  // (C each) and fch_gelu (4C) again: 12 C floats per token per block. A full recompute also
  // writes and reads the block's saved buffers once more: about 16 C floats.
  double recompute_bytes = (selective_blocks * 12.0 + full_blocks * 32.0) * C * 4.0 * tokens;
  // The fused head writes and reads each logits chunk twice (forward, recomputing backward);
  // its chunk buffer is counted once among the step buffers.
  if (plan.policy.exec.head_chunk > 0) recompute_bytes += 4.0 * V * 4.0 * tokens;
  // bf16: AdamW also writes the bf16 copy (2 bytes a parameter), or, without the copy, every
  // micro-batch casts each block's GEMM weights twice (forward, backward) and the head's once:
  // 4 bytes read and 2 written per weight.
  double bf16_bytes = 0;
  if (plan.policy.exec.precision == model::Precision::kBf16) {
    if (plan.policy.exec.bf16_weight_copy) {
      bf16_bytes = param_bytes / 2.0;
    } else {
      bf16_bytes = k * (2.0 * L * G + V * C) * 6.0;
    }
  }
  // fp16: every micro-batch rounds each block's GEMM weights to f16 values twice (forward,
  // backward) and the head's once (4 bytes read, 4 written per weight); on the CPU the GEMMs
  // also widen their f16 activation operands: 46 C values per token per block (14 C forward,
  // 32 C backward; f16 outputs go through the staging too), each read as f16 (2 bytes), written
  // to the staging (4) and read from it (4). (The unfused head's dlogits are written as f16
  // values by the loss's own backward pass: no extra traffic.)
  double f16_bytes = 0;
  if (plan.policy.precision == "fp16") {
    f16_bytes = k * (2.0 * L * G + V * C) * 8.0;
    if (fp16_widened) {
      f16_bytes += 46.0 * C * L * tokens * 10.0;
    }
  }
  // bf16 on the CPU: the weight-gradient GEMMs that take transposed operands (the plan has their
  // staging buffer) first copy inp^T and/or dout^T (cpu::bf16_wgrad_copies: both for oneDNN, the
  // GEMM's A alone for our AMX kernel), each element read and written once (2 + 2 bytes): per
  // block the shapes cpu::bf16_wgrad_transposes picks, and the full-logits head.
  double wgrad_transpose_bytes = 0;
  const bool wgrad_staging = std::ranges::any_of(
      plan.step.buffers,
      [](const memory::BufferDesc& buf) { return buf.name == "bf16_wgrad_staging"; });
  if (wgrad_staging) {
    const int N = int(rows), ci = int(C);
    auto copied = [&](int ic, int oc, cpu::WeightLayout layout) {
      const cpu::Bf16WgradCopies c = cpu::bf16_wgrad_copies(N, layout);
      return 4.0 * rows * ((c.inp_t ? ic : 0) + (c.out_t ? oc : 0));
    };
    const int ai = int(A);
    for (auto [ic, oc] : {std::pair{ci, 3 * ai}, {ai, ci}, {ci, 4 * ci}, {4 * ci, ci}}) {
      if (cpu::bf16_wgrad_transposes(N, ic, oc))
        wgrad_transpose_bytes += L * copied(ic, oc, cpu::WeightLayout::kInOut);
    }
    if (plan.policy.exec.head_chunk == 0 && cpu::bf16_wgrad_transposes(N, ci, int(V))) {
      wgrad_transpose_bytes += copied(ci, int(V), cpu::WeightLayout::kOutIn);
    }
    wgrad_transpose_bytes *= k;
  }
  // AdamW reads p, g, m, v and writes p, m, v, plus zeroing and the norm: about nine passes over
  // the (sharded) parameter-sized state, on the device, or with offload on the host.
  const double optimizer_bytes = 9.0 * param_bytes;
  const bool offload = plan.policy.offload_optimizer;
  s.memory_bytes = k * 4.0 * step_buffer_bytes + (offload ? 0.0 : optimizer_bytes) +
                   recompute_bytes + bf16_bytes + f16_bytes + wgrad_transpose_bytes;
  s.memory_seconds = s.memory_bytes / d.mem_bandwidth;
  // Per kind. Without measured terms: the GEMM time split into attention (its FLOPs at the block
  // GEMMs' rate) and the rest, the optimizer's passes (and bf16 copy) as the optimizer, the other
  // memory-bound traffic as elementwise: the sums are the two figures above.
  std::array<double, kCostKinds>& kind = s.uncorrected_by_kind;
  const double bf16_copy_bytes =
      plan.policy.exec.precision == model::Precision::kBf16 && plan.policy.exec.bf16_weight_copy
          ? bf16_bytes
          : 0.0;
  if (d.terms.fitted && d.kind == "cpu") {
    kind = measured_kinds(c, plan, d.terms, optimizer_floats, offload, &s.fused_head_gemm_seconds);
    kind[size_t(CostKind::kGemm)] += (f16_bytes + wgrad_transpose_bytes) / d.mem_bandwidth;
    kind[size_t(CostKind::kElementwise)] += (bf16_bytes - bf16_copy_bytes) / d.mem_bandwidth;
    // The bf16 copy's bytes are in the optimizer's measured term, except with optimizer offload
    // (the host's AdamW writes it; priced as before, at the triad bandwidth).
    if (offload) kind[size_t(CostKind::kOptimizer)] += bf16_copy_bytes / d.mem_bandwidth;
  } else {
    const double attention_flops = (12.0 * L * T * A + full_blocks * 4.0 * T * A) * tokens;
    const double attention_seconds = attention_flops / (peak * efficiency);
    const double optimizer_seconds =
        ((offload ? 0.0 : optimizer_bytes) + bf16_copy_bytes) / d.mem_bandwidth;
    kind[size_t(CostKind::kAttention)] = attention_seconds;
    kind[size_t(CostKind::kGemm)] = s.gemm_seconds - attention_seconds;
    kind[size_t(CostKind::kOptimizer)] = optimizer_seconds;
    kind[size_t(CostKind::kElementwise)] = s.memory_seconds - optimizer_seconds;
  }
  if (offload) {
    // Without a ZeRO spec: one device holding the CPU executor's layout (fp32 working weights).
    s.offload_bytes = zero && zero->offload_optimizer ? double(offload_link_bytes(*zero))
                                                      : optimizer_floats * (4.0 + 4.0);
    const double link = offload_link_bandwidth(d);
    HR_CHECK_MSG(link > 0, "estimate_step: no host link bandwidth to price optimizer offload");
    s.offload_seconds = s.offload_bytes / link;
    const double host_bw = d.host_memory_bandwidth > 0 ? d.host_memory_bandwidth : d.mem_bandwidth;
    s.host_optimizer_seconds = optimizer_bytes / host_bw;
    if (d.kind == "gpu") {
      // Pipelined (OptimizerOffload): the gradients out (4 bytes a float) on the d2h stream,
      // AdamW on the host, the weights back (4, or 2 for bf16-only weights) on the h2d stream,
      // piece by piece: the longest of the three is paid, the rest hidden (the link is full
      // duplex; the first and last pieces' fill and drain are not counted).
      const double back_share =
          zero && zero->offload_optimizer
              ? double(zero->offload_return_bytes) / (4.0 + double(zero->offload_return_bytes))
              : 0.5;
      const double back = s.offload_seconds * back_share, out = s.offload_seconds - back;
      s.optimizer_overlap_seconds =
          out + back + s.host_optimizer_seconds - std::max({out, back, s.host_optimizer_seconds});
    }
  }

  if (sharded) {
    HR_CHECK_MSG(d.interconnect_bandwidth > 0, "estimate_step: no interconnect bandwidth");
    s.comm_bytes = double(zero_traffic(*zero).total());
    s.comm_seconds = zero_comm_seconds(*zero, d.interconnect_bandwidth);
  }
  if (!plan.activations.offloaded.empty()) {
    const double bw = offload_link_bandwidth(d);
    double activation_bytes = 0;
    for (const model::OffloadBlock& ob : plan.activations.offloaded) {
      activation_bytes += 2.0 * double(ob.bytes) * k;
    }
    s.activation_offload_bytes = activation_bytes;
    s.activation_offload_seconds = k * offload_exposed_seconds(c, plan, d, bw);
    s.offload_bytes += s.activation_offload_bytes;
    s.offload_seconds += s.activation_offload_seconds;
    // On the CPU the copy thread shares the memory bus with compute: its reads and writes are
    // memory traffic the step pays for even when the copy itself is hidden.
    if (d.kind == "cpu") {
      s.memory_bytes += 2.0 * activation_bytes;
      s.memory_seconds = s.memory_bytes / d.mem_bandwidth;
    }
  }
  // On the CPU the copy thread's traffic (above) is the elementwise kind's share of the bus.
  if (!(d.terms.fitted && d.kind == "cpu")) {
    double rest = s.memory_seconds;
    for (CostKind k :
         {CostKind::kNorm, CostKind::kLoss, CostKind::kEmbedding, CostKind::kOptimizer})
      rest -= kind[size_t(k)];
    kind[size_t(CostKind::kElementwise)] = rest;
  } else if (!plan.activations.offloaded.empty() && d.kind == "cpu") {
    kind[size_t(CostKind::kElementwise)] += 2.0 * s.activation_offload_bytes / d.mem_bandwidth;
  }
  // Note [Self-correction]: each kind scaled by what a run measured of it on this machine.
  const CostCorrection& corr = d.correction;
  s.gemm_seconds = s.memory_seconds = 0;
  for (size_t i = 0; i < kCostKinds; i++) {
    s.by_kind[i] = kind[i] * (corr.active() ? corr.scale[i] : 1.0);
    if (i == size_t(CostKind::kLoss) && corr.active() && s.fused_head_gemm_seconds > 0) {
      s.by_kind[i] = (kind[i] - s.fused_head_gemm_seconds) * corr.scale[i] +
                     s.fused_head_gemm_seconds * corr.scale[size_t(CostKind::kGemm)];
    }
    const bool gemm_like = i == size_t(CostKind::kGemm) || i == size_t(CostKind::kAttention);
    (gemm_like ? s.gemm_seconds : s.memory_seconds) += s.by_kind[i];
  }
  s.other_seconds = corr.active() ? corr.other_seconds_per_token * tokens : 0.0;
  s.step_seconds = s.gemm_seconds + s.memory_seconds + s.other_seconds + s.comm_seconds +
                   s.offload_seconds + s.host_optimizer_seconds - s.optimizer_overlap_seconds;
  s.tokens_per_s = tokens * (sharded ? zero->ranks : 1) / s.step_seconds;
  return s;
}

}  // namespace headroom::plan
