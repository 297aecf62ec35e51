#!/usr/bin/python3
"""PyTorch reference GPT-2 and the golden fixture writer for headroom's tests.

A tiny GPT-2 written in plain PyTorch that matches Hugging Face's GPT2LMHeadModel exactly
(no `transformers` needed): tied embeddings, learned positions, pre-LN blocks, causal attention
scaled by 1/sqrt(head_size), GELU tanh approximation ("gelu_new"), Conv1D projections
(weight stored [in, out], y = x @ W + b), final ln_f, logits = h @ wte^T, no dropout.
Parameter names are those of Hugging Face's GPT-2 safetensors files (no "transformer." prefix).

It writes tests/golden/fixtures/gpt2_tiny.safetensors (initial parameters, a batch, float64
reference logits/loss/gradients, a 5-step AdamW run in float32) and gpt2_tiny_config.json.
See tools/reference/README.md for the exact contents. Deterministic: re-running it on the same
machine and torch build reproduces the files byte for byte (`--check` verifies that).

Run with Debian's interpreter, which has python3-torch: /usr/bin/python3 gpt2_reference.py
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

# The fixture's configuration. V is deliberately odd (not a multiple of 8 or of a SIMD width) so
# that vocabulary-dimension tails in the C++ kernels are exercised.
CONFIG = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=97, n_positions=32)
LAYER_NORM_EPS = 1e-5
B, T = 2, 16
SEED = 1234
INIT_STD = 0.02
PERTURB_STD = 0.02
# Positions (batch, time) whose target is -1 (ignored by the loss).
IGNORED_TARGETS = [(0, 5), (1, T - 1)]
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, clip=1.0, steps=5)

REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "golden", "fixtures")


def param_shapes(cfg):
    """Parameter names (Hugging Face GPT-2 spelling) and shapes, in canonical order."""
    C, V, P, L = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"], cfg["n_layer"]
    shapes = [("wte.weight", (V, C)), ("wpe.weight", (P, C))]
    for i in range(L):
        h = f"h.{i}."
        shapes += [
            (h + "ln_1.weight", (C,)),
            (h + "ln_1.bias", (C,)),
            (h + "attn.c_attn.weight", (C, 3 * C)),
            (h + "attn.c_attn.bias", (3 * C,)),
            (h + "attn.c_proj.weight", (C, C)),
            (h + "attn.c_proj.bias", (C,)),
            (h + "ln_2.weight", (C,)),
            (h + "ln_2.bias", (C,)),
            (h + "mlp.c_fc.weight", (C, 4 * C)),
            (h + "mlp.c_fc.bias", (4 * C,)),
            (h + "mlp.c_proj.weight", (4 * C, C)),
            (h + "mlp.c_proj.bias", (C,)),
        ]
    shapes += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return shapes


def is_layer_norm(name):
    return ".ln_" in name or name.startswith("ln_")


def init_params(cfg):
    """GPT-2's initialisation (as Hugging Face's GPT2PreTrainedModel._init_weights), then a small
    perturbation of LayerNorm parameters and biases so that their gradients are not trivial.
    Draws come from the global generator seeded by the caller, in canonical order."""
    params = {}
    residual_std = INIT_STD / math.sqrt(2 * cfg["n_layer"])
    for name, shape in param_shapes(cfg):
        if is_layer_norm(name):
            t = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        elif name.endswith("c_proj.weight"):  # attn.c_proj and mlp.c_proj: residual projections
            t = torch.empty(shape).normal_(0.0, residual_std)
        else:  # wte, wpe, c_attn, c_fc
            t = torch.empty(shape).normal_(0.0, INIT_STD)
        params[name] = t
    for name, t in params.items():
        if is_layer_norm(name) or name.endswith(".bias"):
            t.add_(torch.randn(t.shape) * PERTURB_STD)
    return params


def conv1d(x, weight, bias):
    """Hugging Face's Conv1D: weight [in, out], y = x @ W + b."""
    out_shape = x.shape[:-1] + (weight.shape[1],)
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(out_shape)


def gpt2_forward(p, idx, cfg):
    """Logits [B, T, V] of GPT2LMHeadModel (eval mode, i.e. no dropout). `p` maps HF names to
    tensors of one dtype (float32 or float64)."""
    Bn, Tn = idx.shape
    C, NH = cfg["n_embd"], cfg["n_head"]
    hs = C // NH
    pos = torch.arange(Tn)
    x = F.embedding(idx, p["wte.weight"]) + F.embedding(pos, p["wpe.weight"])
    causal = torch.tril(torch.ones(Tn, Tn, dtype=torch.bool))
    for i in range(cfg["n_layer"]):
        h = f"h.{i}."
        a = F.layer_norm(x, (C,), p[h + "ln_1.weight"], p[h + "ln_1.bias"], LAYER_NORM_EPS)
        qkv = conv1d(a, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])
        q, k, v = qkv.split(C, dim=2)
        q = q.view(Bn, Tn, NH, hs).transpose(1, 2)  # [B, NH, T, hs]
        k = k.view(Bn, Tn, NH, hs).transpose(1, 2)
        v = v.view(Bn, Tn, NH, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # [B, NH, T, T]
        att = att.masked_fill(~causal, float("-inf"))  # HF uses finfo.min: same after softmax
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(Bn, Tn, C)
        x = x + conv1d(y, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        m = F.layer_norm(x, (C,), p[h + "ln_2.weight"], p[h + "ln_2.bias"], LAYER_NORM_EPS)
        m = F.gelu(conv1d(m, p[h + "mlp.c_fc.weight"], p[h + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + conv1d(m, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], LAYER_NORM_EPS)
    return x @ p["wte.weight"].t()


def gpt2_loss(logits, targets):
    """Mean cross-entropy over the targets that are not -1."""
    V = logits.shape[-1]
    total = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=-1,
                            reduction="sum")
    return total / (targets != -1).sum()


def forward_backward(params, idx, targets, dtype):
    p = {n: t.detach().to(dtype).clone().requires_grad_(True) for n, t in params.items()}
    logits = gpt2_forward(p, idx, CONFIG)
    loss = gpt2_loss(logits, targets)
    loss.backward()
    return logits.detach(), loss.detach(), {n: t.grad.detach() for n, t in p.items()}


def build_fixture():
    torch.manual_seed(SEED)
    params = init_params(CONFIG)
    V = CONFIG["vocab_size"]
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    for b, t in IGNORED_TARGETS:
        targets[b, t] = -1

    logits64, loss64, grads64 = forward_backward(params, idx, targets, torch.float64)
    logits32, loss32, grads32 = forward_backward(params, idx, targets, torch.float32)
    losses, norms, final = adamw_run(
        params, lambda p: gpt2_loss(gpt2_forward(p, idx, CONFIG), targets), ADAMW)

    # Sanity: the float32 pass agrees with float64 to float32 rounding.
    assert abs(loss32.item() - loss64.item()) < 1e-5, (loss32.item(), loss64.item())
    assert (logits32.double() - logits64).abs().max().item() < 1e-5
    for n in params:
        assert (grads32[n].double() - grads64[n]).abs().max().item() < 1e-5, n
    assert abs(losses[0] - loss32.item()) == 0.0

    names = [n for n, _ in param_shapes(CONFIG)]
    tensors = [(n, f32(params[n])) for n in names]
    tensors += [("input_ids", idx.numpy().astype("<i4")), ("targets", targets.numpy().astype("<i4"))]
    tensors += [("ref.logits", f32(logits64)), ("ref.loss", f32(loss64))]
    tensors += [("grad." + n, f32(grads64[n])) for n in names]
    tensors += [("adamw.losses", np.array(losses, dtype="<f4")),
                ("adamw.grad_norms", np.array(norms, dtype="<f4"))]
    tensors += [("final." + n, f32(final[n])) for n in names]

    metadata = {k: str(v) for k, v in CONFIG.items()}
    metadata.update({
        "layer_norm_epsilon": repr(LAYER_NORM_EPS),
        "activation_function": "gelu_new",
        "B": str(B), "T": str(T), "seed": str(SEED),
        "lr": repr(ADAMW["lr"]), "beta1": repr(ADAMW["beta1"]), "beta2": repr(ADAMW["beta2"]),
        "eps": repr(ADAMW["eps"]), "weight_decay": repr(ADAMW["weight_decay"]),
        "weight_decay_applies_to": "2-D tensors (all weight matrices and both embeddings)",
        "clip": repr(ADAMW["clip"]), "adamw_steps": str(ADAMW["steps"]),
        "ignore_index": "-1",
        "loss": "sum of cross-entropy over targets != -1, divided by their count",
        # Full-precision values of the float64 loss and the float32 pass, for tight comparisons.
        "ref.loss_f64": repr(loss64.item()),
        "ref32.loss": repr(loss32.item()),
        "torch_version": torch.__version__,
        "generator": "tools/reference/gpt2_reference.py",
    })

    hf_config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        **CONFIG,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "activation_function": "gelu_new",
        "initializer_range": INIT_STD,
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "tie_word_embeddings": True,
    }
    return tensors, metadata, hf_config, (loss64.item(), losses, norms)


def write_outputs(out_dir, tensors, metadata, hf_config):
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "gpt2_tiny.safetensors"), tensors, metadata)
    write_json(os.path.join(out_dir, "gpt2_tiny_config.json"), hf_config)


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
    tensors, metadata, hf_config, (loss64, losses, norms) = build_fixture()

    if args.check:
        return check_outputs(args.out_dir, ("gpt2_tiny.safetensors", "gpt2_tiny_config.json"),
                             lambda d: write_outputs(d, tensors, metadata, hf_config))

    write_outputs(args.out_dir, tensors, metadata, hf_config)
    size = os.path.getsize(os.path.join(args.out_dir, "gpt2_tiny.safetensors"))
    print(f"torch {torch.__version__}: wrote {len(tensors)} tensors ({size} bytes) to {args.out_dir}")
    print(f"ref.loss (float64) = {loss64!r}")
    print("adamw.losses     = " + ", ".join(f"{x:.7f}" for x in losses))
    print("adamw.grad_norms = " + ", ".join(f"{x:.7f}" for x in norms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
