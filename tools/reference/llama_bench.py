#!/usr/bin/python3
"""PyTorch CPU throughput of the reference Llama's training step, to compare with headroom's.

One step = forward + loss + backward + clip_grad_norm_(1.0) + torch.optim.AdamW.step, on a fixed
random batch, with the model of llama_reference.py (RMSNorm, RoPE, grouped-query attention,
SwiGLU, untied head). Parameters and optimizer state are float32; --dtype bf16 runs forward and
backward under torch.autocast("cpu", dtype=torch.bfloat16) (mixed precision: matmuls in bf16,
master weights and AdamW in fp32). Prints one JSON object: the shape, median and min step time
in ms, tokens/s at the median (B*T / median step), and the median CPU time per step (all
threads; on a machine shared with other work, wall time includes waiting for cores).

Example (Debian's interpreter, which has python3-torch):
  /usr/bin/python3 tools/reference/llama_bench.py --layers 4 --hidden 256 --heads 4 \
      --kv-heads 2 --intermediate 688 --vocab 8192 --batch 4 --seq 256 --steps 10 --threads 2
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference as ref  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    cfg = dict(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq, rms_norm_eps=1e-5, rope_theta=args.rope_theta,
        rope_scaling=None, tie_word_embeddings=False)
    assert args.hidden % args.heads == 0 and args.heads % args.kv_heads == 0, "bad head counts"

    torch.manual_seed(0)
    params = {n: t.requires_grad_(True) for n, t in ref.init_params(cfg).items()}
    n_params = sum(t.numel() for t in params.values())
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))
    hp = ref.ADAMW
    plist = list(params.values())
    opt = torch.optim.AdamW(
        [{"params": [t for t in plist if t.dim() >= 2], "weight_decay": hp["weight_decay"]},
         {"params": [t for t in plist if t.dim() < 2], "weight_decay": 0.0}],
        lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"])

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = ref.llama_forward(params, idx, cfg)
            loss = ref.llama_loss(logits.float(), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, hp["clip"])
        opt.step()
        return loss.item()

    times, cpu, losses = [], [], []
    for i in range(args.warmup + args.steps):
        c0, t0 = time.process_time(), time.perf_counter()
        losses.append(step())
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= args.warmup:
            times.append((t1 - t0) * 1e3)
            cpu.append((c1 - c0) * 1e3)
    med = statistics.median(times)
    tokens = args.batch * args.seq
    print(json.dumps({
        "framework": f"pytorch {torch.__version__}",
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
        "kv_heads": args.kv_heads, "intermediate": args.intermediate, "vocab": args.vocab,
        "batch": args.batch, "seq": args.seq, "params": n_params,
        "warmup": args.warmup, "steps": args.steps,
        "median_step_ms": round(med, 3), "min_step_ms": round(min(times), 3),
        "tokens_per_s": round(tokens / (med / 1e3), 1),
        # CPU time of the process (all threads) per step: on a shared machine, wall time
        # includes waiting for cores; cpu_ms / threads is the step without that wait, roughly.
        "median_cpu_ms": round(statistics.median(cpu), 3),
        "first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5),
        "expected_initial_loss": round(math.log(args.vocab), 5),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
