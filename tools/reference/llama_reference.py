#!/usr/bin/python3
"""PyTorch reference Llama and the golden fixture writer for headroom's Llama tests.

A tiny Llama written in plain PyTorch that matches Hugging Face's LlamaForCausalLM (no
`transformers` needed): token embedding, no learned positions, pre-norm blocks
(`x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))`), RMSNorm with weight
only (`x * rsqrt(mean(x^2) + eps) * w`), rotary embeddings in HF's "rotate_half" layout (pairs
i and i + head_dim/2), optional Llama 3 frequency scaling (rope_type "llama3"), grouped-query
causal attention scaled by 1/sqrt(head_dim) (query head h reads key/value head
h // (n_heads / n_kv_heads)), SwiGLU MLP `down(silu(gate(x)) * up(x))`, no biases, final norm,
`lm_head` (nn.Linear, weight [V, C]) or, when tied, `logits = h @ embed_tokens^T`.
Parameter names are those of Hugging Face's Llama safetensors files.

It writes two fixtures into tests/golden/fixtures/: llama_tiny (untied head, rope_theta 10000,
no scaling) and llama_tiny_tied (tied head, rope_theta 500000, llama3 scaling), each as
<name>.safetensors (initial parameters, a batch, float64 reference logits/loss/gradients, a
5-step AdamW run in float32) and <name>_config.json (a Hugging Face config.json). See
tools/reference/README.md for the exact contents. Before writing, it cross-checks the reference
(GQA against plain multi-head attention, RoPE against a complex rotation, llama3 scaling
actually changing frequencies) and fails if a check does. Deterministic: re-running it on the
same machine and torch build reproduces the files byte for byte (`--check` verifies that).

Run with Debian's interpreter, which has python3-torch: /usr/bin/python3 llama_reference.py
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import adamw_run, check_outputs, f32, write_json, write_safetensors  # noqa: E402

# Both fixtures' sizes. V is deliberately odd and intermediate_size is not a power of two, so
# that tails in the C++ kernels are exercised. head_dim = 64 / 4 = 16; k/v_proj are [32, 64].
BASE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small on purpose: at head_dim 16 the wavelengths are 2*pi*theta^(2i/16) >= 6.3, so with
    # Llama 3's 8192 nothing would change. With 16, frequency 0 (wavelength 6.3) is in the
    # smoothed band and frequencies 1..7 (wavelengths >= 32) are divided by `factor`.
    "original_max_position_embeddings": 16,
}
FIXTURES = {
    "llama_tiny": dict(BASE_CONFIG, rope_theta=10000.0, rope_scaling=None,
                       tie_word_embeddings=False),
    "llama_tiny_tied": dict(BASE_CONFIG, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                            tie_word_embeddings=True),
}
B, T = 2, 16
SEED = 1234
INIT_STD = 0.02  # every 2-D weight, as HF's LlamaPreTrainedModel._init_weights (no residual scaling)
PERTURB_STD = 0.02
# Positions (batch, time) whose target is -1 (ignored by the loss).
IGNORED_TARGETS = [(0, 5), (1, T - 1)]
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, steps=5)

REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "golden", "fixtures")


def head_dim(cfg):
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def param_shapes(cfg):
    """Parameter names (Hugging Face Llama spelling) and shapes, in canonical order: the order of
    LlamaForCausalLM's state_dict (modules in registration order)."""
    C, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    I, hs = cfg["intermediate_size"], head_dim(cfg)
    NH, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = [("model.embed_tokens.weight", (V, C))]
    for i in range(L):
        h = f"model.layers.{i}."
        shapes += [
            (h + "self_attn.q_proj.weight", (NH * hs, C)),
            (h + "self_attn.k_proj.weight", (KV * hs, C)),
            (h + "self_attn.v_proj.weight", (KV * hs, C)),
            (h + "self_attn.o_proj.weight", (C, NH * hs)),
            (h + "mlp.gate_proj.weight", (I, C)),
            (h + "mlp.up_proj.weight", (I, C)),
            (h + "mlp.down_proj.weight", (C, I)),
            (h + "input_layernorm.weight", (C,)),
            (h + "post_attention_layernorm.weight", (C,)),
        ]
    shapes += [("model.norm.weight", (C,))]
    if not cfg["tie_word_embeddings"]:
        shapes += [("lm_head.weight", (V, C))]
    return shapes


def init_params(cfg):
    """HF's Llama initialisation (normal(0, 0.02) for every Linear and Embedding weight, RMSNorm
    weight 1), then normal(0, 0.02) noise added to every RMSNorm weight (the 1-D tensors) so that
    their gradients are not trivial, as the GPT-2 fixture does for its LayerNorms. Draws come
    from the global generator seeded by the caller, in canonical order."""
    params = {}
    for name, shape in param_shapes(cfg):
        if len(shape) == 1:  # RMSNorm weights
            params[name] = torch.ones(shape)
        else:
            params[name] = torch.empty(shape).normal_(0.0, INIT_STD)
    for name, t in params.items():
        if t.dim() == 1:
            t.add_(torch.randn(t.shape) * PERTURB_STD)
    return params


# ---- rotary embeddings -----------------------------------------------------------------------

def rope_inv_freq(cfg):
    """inv_freq [head_dim/2] in float32 as HF computes it: 1 / theta^(arange(0, hs, 2) / hs), then
    (rope_type "llama3") Llama 3's wavelength-dependent scaling."""
    hs = head_dim(cfg)
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hs, 2, dtype=torch.int64).float() / hs))
    sc = cfg["rope_scaling"]
    if sc is None:
        return inv_freq
    assert sc["rope_type"] == "llama3", sc
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old_len = sc["original_max_position_embeddings"]
    low_freq_wavelen = old_len / lo
    high_freq_wavelen = old_len / hi
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, and in between
    # interpolated with smooth = (old_len / wavelen - lo) / (hi - lo).
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq, Tn, dtype):
    """cos, sin [T, head_dim] for positions 0..T-1, both halves equal (HF's cat((f, f))). In
    float32 as HF does (float32 inv_freq times float32 positions); in float64 from the same
    float32 inv_freq values, with the angles and cos/sin computed in float64."""
    pos = torch.arange(Tn, dtype=torch.int64).to(dtype)
    freqs = torch.outer(pos, inv_freq.to(dtype))  # [T, hs/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, heads, T, hs]: x * cos + rotate_half(x) * sin, i.e. for i < hs/2 the pair
    (x_i, x_{i+hs/2}) rotated by the angle pos * inv_freq_i."""
    return x * cos + rotate_half(x) * sin


# ---- the model -------------------------------------------------------------------------------

def rms_norm(x, w, eps):
    """HF's LlamaRMSNorm: statistics in float32 (float64 for the float64 reference), then the
    weight: w * (x * rsqrt(mean(x^2) + eps))."""
    stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(stat_dtype)
    var = xs.pow(2).mean(-1, keepdim=True)
    return w * (xs * torch.rsqrt(var + eps)).to(x.dtype)


def repeat_kv(x, n_rep):
    """[B, KV, T, hs] -> [B, KV * n_rep, T, hs]; key/value head j serves query heads
    j*n_rep .. j*n_rep + n_rep - 1."""
    Bn, KV, Tn, hs = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(Bn, KV, n_rep, Tn, hs).reshape(Bn, KV * n_rep, Tn, hs)


def attention(a, p, h, cfg, cos, sin):
    """Grouped-query causal self-attention of one block; `a` is the normed input [B, T, C]."""
    Bn, Tn, C = a.shape
    NH, KV, hs = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    q = F.linear(a, p[h + "self_attn.q_proj.weight"]).view(Bn, Tn, NH, hs).transpose(1, 2)
    k = F.linear(a, p[h + "self_attn.k_proj.weight"]).view(Bn, Tn, KV, hs).transpose(1, 2)
    v = F.linear(a, p[h + "self_attn.v_proj.weight"]).view(Bn, Tn, KV, hs).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = repeat_kv(k, NH // KV), repeat_kv(v, NH // KV)
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # [B, NH, T, T]
    causal = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    att = att.masked_fill(~causal, float("-inf"))  # HF adds finfo.min: same after softmax
    att = F.softmax(att, dim=-1)
    y = (att @ v).transpose(1, 2).reshape(Bn, Tn, NH * hs)
    return F.linear(y, p[h + "self_attn.o_proj.weight"])


def mlp(m, p, h):
    return F.linear(F.silu(F.linear(m, p[h + "mlp.gate_proj.weight"])) *
                    F.linear(m, p[h + "mlp.up_proj.weight"]), p[h + "mlp.down_proj.weight"])


def llama_forward(p, idx, cfg, attn=attention):
    """Logits [B, T, V] of LlamaForCausalLM (eval mode, positions 0..T-1). `p` maps HF names to
    tensors of one dtype (float32 or float64)."""
    Bn, Tn = idx.shape
    dtype = p["model.embed_tokens.weight"].dtype
    eps = cfg["rms_norm_eps"]
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), Tn, dtype)
    x = F.embedding(idx, p["model.embed_tokens.weight"])
    for i in range(cfg["num_hidden_layers"]):
        h = f"model.layers.{i}."
        x = x + attn(rms_norm(x, p[h + "input_layernorm.weight"], eps), p, h, cfg, cos, sin)
        x = x + mlp(rms_norm(x, p[h + "post_attention_layernorm.weight"], eps), p, h)
    x = rms_norm(x, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    return F.linear(x, head)


def llama_loss(logits, targets):
    """Mean cross-entropy over the targets that are not -1."""
    V = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1,
                            reduction="sum")
    return total / (targets != -1).sum()


def forward_backward(params, idx, targets, cfg, dtype):
    p = {n: t.detach().to(dtype).clone().requires_grad_(True) for n, t in params.items()}
    logits = llama_forward(p, idx, cfg)
    loss = llama_loss(logits, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: t.grad.detach() for n, t in p.items()}


# ---- cross-checks of the reference itself ----------------------------------------------------

def mha_attention(a, p, h, cfg, cos, sin):
    """Plain multi-head attention written independently of `attention`: one head at a time, the
    rotation as a complex multiplication of the pairs (i, i + hs/2), the causal mask by slicing.
    Needs num_key_value_heads == num_attention_heads unless `kv_of_head` says otherwise."""
    Bn, Tn, C = a.shape
    NH, KV, hs = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    half = hs // 2
    wq, wk = p[h + "self_attn.q_proj.weight"], p[h + "self_attn.k_proj.weight"]
    wv, wo = p[h + "self_attn.v_proj.weight"], p[h + "self_attn.o_proj.weight"]
    angle = torch.atan2(sin[:, :half], cos[:, :half])  # [T, hs/2], the angles of cos/sin
    rot = torch.polar(torch.ones_like(angle), angle)
    heads = []
    for hd in range(NH):
        kvh = hd * KV // NH
        q = a @ wq[hd * hs:(hd + 1) * hs].t()
        k = a @ wk[kvh * hs:(kvh + 1) * hs].t()
        v = a @ wv[kvh * hs:(kvh + 1) * hs].t()
        q, k = complex_rotate(q, rot), complex_rotate(k, rot)
        out = torch.zeros(Bn, Tn, hs, dtype=a.dtype)
        for t in range(Tn):
            s = (k[:, :t + 1] @ q[:, t, :, None]).squeeze(-1) / math.sqrt(hs)  # [B, t+1]
            w = torch.exp(s - s.max(-1, keepdim=True).values)
            w = w / w.sum(-1, keepdim=True)
            out[:, t] = (w[:, :, None] * v[:, :t + 1]).sum(1)
        heads.append(out)
    return torch.cat(heads, dim=-1) @ wo.t()


def complex_rotate(x, rot):
    """x [..., T, hs]: z_i = x_i + j x_{i+hs/2} times rot[t, i] = exp(j pos_t inv_freq_i)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * rot
    return torch.cat((z.real, z.imag), dim=-1)


def cross_checks():
    """Fails (AssertionError) if the reference disagrees with an independent formulation."""
    results = []
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(99)
    # 1. RoPE: rotate_half with HF's cos/sin equals the complex rotation of (i, i + hs/2) by
    #    pos * inv_freq_i (float64 from the float32 inv_freq), for both fixtures' frequencies.
    for name, cfg in FIXTURES.items():
        hs = head_dim(cfg)
        inv = rope_inv_freq(cfg).double()
        cos, sin = rope_cos_sin(rope_inv_freq(cfg), T, torch.float64)
        x = torch.randn(B, 3, T, hs, dtype=torch.float64)
        pos = torch.arange(T, dtype=torch.float64)
        rot = torch.polar(torch.ones(T, hs // 2, dtype=torch.float64), torch.outer(pos, inv))
        d = (apply_rope(x, cos, sin) - complex_rotate(x, rot)).abs().max().item()
        assert d < 1e-12, (name, d)
        results.append(f"rope == complex rotation ({name}): max diff {d:.1e}")
    # 2. llama3 scaling changes the frequencies, in the regimes the formula has at this size.
    plain = rope_inv_freq(dict(FIXTURES["llama_tiny_tied"], rope_scaling=None))
    scaled = rope_inv_freq(FIXTURES["llama_tiny_tied"])
    f = LLAMA3_SCALING["factor"]
    assert not torch.equal(plain, scaled)
    assert torch.allclose(scaled[1:], plain[1:] / f, rtol=0, atol=0)  # divided by factor
    assert plain[0] / f < scaled[0] < plain[0]  # smoothed: strictly between
    results.append("llama3 scaling: inv_freq[0] " f"{plain[0].item():.6g} -> {scaled[0].item():.6g}"
                   f" (smoothed), inv_freq[1:] divided by {f:g}")
    # 3. GQA == plain MHA when num_key_value_heads == num_attention_heads, and the grouped model
    #    equals MHA reading key/value head h * KV // NH (i.e. h // n_rep), in float64.
    for name, cfg in FIXTURES.items():
        for kv in (cfg["num_attention_heads"], cfg["num_key_value_heads"]):
            c = dict(cfg, num_key_value_heads=kv)
            p = {n: t.double() for n, t in init_params(c).items()}
            idx = torch.randint(0, c["vocab_size"], (B, T))
            ref = llama_forward(p, idx, c)
            alt = llama_forward(p, idx, c, attn=mha_attention)
            d = (ref - alt).abs().max().item()
            assert d < 1e-12, (name, kv, d)
            results.append(f"gqa == per-head MHA ({name}, kv_heads {kv}): max logit diff {d:.1e}")
    # 4. repeat_kv's grouping: GQA with KV heads equals MHA with each K/V head's rows copied to
    #    its n_rep query heads.
    cfg = FIXTURES["llama_tiny"]
    NH, KV, hs = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim(cfg)
    p = {n: t.double() for n, t in init_params(cfg).items()}
    idx = torch.randint(0, cfg["vocab_size"], (B, T))
    pm = dict(p)
    for i in range(cfg["num_hidden_layers"]):
        for w in ("k_proj", "v_proj"):
            n = f"model.layers.{i}.self_attn.{w}.weight"
            pm[n] = p[n].view(KV, 1, hs, -1).expand(KV, NH // KV, hs, p[n].shape[1]).reshape(
                NH * hs, -1)
    d = (llama_forward(p, idx, cfg) -
         llama_forward(pm, idx, dict(cfg, num_key_value_heads=NH))).abs().max().item()
    assert d < 1e-12, d
    results.append(f"gqa == MHA with K/V rows repeated per group: max logit diff {d:.1e}")
    torch.random.set_rng_state(gen_state)
    return results


# ---- the fixtures ----------------------------------------------------------------------------

def build_fixture(name):
    cfg = FIXTURES[name]
    torch.manual_seed(SEED)
    params = init_params(cfg)
    V = cfg["vocab_size"]
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    for b, t in IGNORED_TARGETS:
        targets[b, t] = -1

    logits64, loss64, grads64 = forward_backward(params, idx, targets, cfg, torch.float64)
    logits32, loss32, grads32 = forward_backward(params, idx, targets, cfg, torch.float32)
    losses, norms, final = adamw_run(
        params, lambda p: llama_loss(llama_forward(p, idx, cfg), targets), ADAMW)

    # Sanity: the float32 pass agrees with float64 to float32 rounding.
    assert abs(loss32.item() - loss64.item()) < 1e-5, (loss32.item(), loss64.item())
    assert (logits32.double() - logits64).abs().max().item() < 1e-5
    for n in params:
        assert (grads32[n].double() - grads64[n]).abs().max().item() < 1e-5, n
    assert abs(losses[0] - loss32.item()) == 0.0

    names = [n for n, _ in param_shapes(cfg)]
    tensors = [(n, f32(params[n])) for n in names]
    tensors += [("input_ids", idx.numpy().astype("<i4")), ("targets", targets.numpy().astype("<i4"))]
    tensors += [("rope.inv_freq", f32(rope_inv_freq(cfg)))]
    tensors += [("ref.logits", f32(logits64)), ("ref.loss", f32(loss64))]
    tensors += [("grad." + n, f32(grads64[n])) for n in names]
    tensors += [("adamw.losses", np.array(losses, dtype="<f4")),
                ("adamw.grad_norms", np.array(norms, dtype="<f4"))]
    tensors += [("final." + n, f32(final[n])) for n in names]

    metadata = {k: repr(v) if isinstance(v, float) else str(v) for k, v in BASE_CONFIG.items()}
    metadata.update({
        "head_dim": str(head_dim(cfg)),
        "rope_theta": repr(cfg["rope_theta"]),
        "rope_scaling": "none" if cfg["rope_scaling"] is None else
        ",".join(f"{k}={v}" for k, v in cfg["rope_scaling"].items()),
        "tie_word_embeddings": str(cfg["tie_word_embeddings"]).lower(),
        "hidden_act": "silu",
        "B": str(B), "T": str(T), "seed": str(SEED),
        "init": "normal(0, 0.02) for every 2-D weight (o_proj and down_proj too); RMSNorm "
                "weights 1 + normal(0, 0.02)",
        "lr": repr(ADAMW["lr"]), "beta1": repr(ADAMW["beta1"]), "beta2": repr(ADAMW["beta2"]),
        "eps": repr(ADAMW["eps"]), "weight_decay": repr(ADAMW["weight_decay"]),
        "weight_decay_applies_to": "2-D tensors (all weight matrices, embed_tokens, lm_head)",
        "clip": repr(ADAMW["clip"]), "adamw_steps": str(ADAMW["steps"]),
        "ignore_index": "-1",
        "loss": "sum of cross-entropy over targets != -1, divided by their count",
        # Full-precision values of the float64 loss and the float32 pass, for tight comparisons.
        "ref.loss_f64": repr(loss64.item()),
        "ref32.loss": repr(loss32.item()),
        "torch_version": torch.__version__,
        "generator": "tools/reference/llama_reference.py",
    })

    hf_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": head_dim(cfg),
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "rope_scaling": cfg["rope_scaling"],
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "pretraining_tp": 1,
        "torch_dtype": "float32",
    }
    return tensors, metadata, hf_config, (loss64.item(), losses, norms)


def output_names(name):
    return (f"{name}.safetensors", f"{name}_config.json")


def write_outputs(out_dir, name, tensors, metadata, hf_config):
    os.makedirs(out_dir, exist_ok=True)
    st, js = output_names(name)
    write_safetensors(os.path.join(out_dir, st), tensors, metadata)
    write_json(os.path.join(out_dir, js), hf_config)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=DEFAULT_OUT, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and fail if the files in "
                         "--out-dir differ")
    args = ap.parse_args()

    # One thread and deterministic algorithms: the same bytes on every run on this machine.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    checks = cross_checks()
    built = {name: build_fixture(name) for name in FIXTURES}

    if args.check:
        def write_all(d):
            for name, (tensors, metadata, hf_config, _) in built.items():
                write_outputs(d, name, tensors, metadata, hf_config)
        names = [f for name in FIXTURES for f in output_names(name)]
        return check_outputs(args.out_dir, names, write_all)

    for line in checks:
        print("check: " + line)
    for name, (tensors, metadata, hf_config, (loss64, losses, norms)) in built.items():
        write_outputs(args.out_dir, name, tensors, metadata, hf_config)
        size = os.path.getsize(os.path.join(args.out_dir, output_names(name)[0]))
        print(f"{name}: torch {torch.__version__}: wrote {len(tensors)} tensors ({size} bytes) "
              f"to {args.out_dir}")
        print(f"  ref.loss (float64) = {loss64!r}")
        print("  adamw.losses     = " + ", ".join(f"{x:.7f}" for x in losses))
        print("  adamw.grad_norms = " + ", ".join(f"{x:.7f}" for x in norms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
