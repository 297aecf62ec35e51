#!/usr/bin/python3
"""headroom against PyTorch on the same GPT-2 training step, side by side.

For every (model, precision, micro-batch) this runs, one after the other and each in its own
process (so that peak RSS is per run):

  headroom     `<headroom> bench --model M --batch B --seq T --precision P --steps N --json`
  torch        the same GPT-2 training step in PyTorch (Debian's python3-torch), out of the box
  torch-tuned  the same PyTorch process with glibc told to keep freed memory
               (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=<huge>) and OpenBLAS's AVX-512 kernels
               (OPENBLAS_CORETYPE=SkylakeX); these three variables are set for that process only

and prints a Markdown table of tokens/s and peak RSS with headroom's ratios to both. The PyTorch
step: Hugging Face's GPT-2 (pre-LN, tied embeddings, GELU tanh, LayerNorm eps 1e-5, plain masked
softmax attention; the model functions of tools/reference/gpt2_reference.py), GPT-2's
initialisation (normal 0.02, c_proj 0.02/sqrt(2 n_layer), biases 0, LayerNorm 1/0), random tokens,
mean cross-entropy, backward, clip_grad_norm_(1.0), AdamW(lr 6e-4, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1 on 2-D tensors). bf16 is torch.autocast("cpu", dtype=torch.bfloat16) around the
forward and the loss (fp32 master weights and optimizer). torch.set_num_threads(threads) and
OMP_NUM_THREADS / OPENBLAS_NUM_THREADS = threads for every process, headroom's included.

Timing: `--warmup` untimed steps, then `--steps` timed steps; tokens/s = B*T / median step time.
Peak RSS: ru_maxrss of each child as os.wait4 reports it (the whole process: interpreter, libraries,
weights, optimizer state and activations).

Run from the repository root with Debian's interpreter (or any python3: the parent does not import
torch; `--torch-python` is the interpreter that runs the PyTorch processes):

  /usr/bin/python3 bench/compare_pytorch.py --json out/compare_pytorch.json
"""

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
REFERENCE_DIR = os.path.join(REPO_ROOT, "tools", "reference")

# headroom's presets (src/model/config.cc) for the models this script accepts.
MODELS = {
    "gpt2-tiny": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=50257, n_positions=256),
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024),
}
SYSTEMS = ("headroom", "torch", "torch-tuned")
PRECISIONS = ("fp32", "bf16")

# The tuned PyTorch process only. 2**40 bytes: far above this machine's memory, so glibc never
# returns freed heap memory to the kernel between steps.
TUNED_ENV = {
    "MALLOC_MMAP_MAX_": "0",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "OPENBLAS_CORETYPE": "SkylakeX",
}

ADAMW = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)
INIT_STD = 0.02
SEED = 1234
RESULT_TAG = "COMPARE_PYTORCH_RESULT "


# ------------------------------------------------------------------------------------------------
# The PyTorch side (runs in a child process: `--torch-worker SPEC_JSON`)
# ------------------------------------------------------------------------------------------------

def torch_worker(spec):
    import resource

    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, REFERENCE_DIR)
    import gpt2_reference as ref  # gpt2_forward, gpt2_loss, param_shapes (HF GPT-2)

    cfg = MODELS[spec["model"]]
    B, T = spec["batch"], spec["seq"]
    if T > cfg["n_positions"]:
        raise SystemExit(f"--seq {T} exceeds n_positions {cfg['n_positions']} of {spec['model']}")
    V = cfg["vocab_size"]

    # GPT-2's initialisation (Hugging Face's _init_weights), canonical parameter order.
    torch.manual_seed(SEED)
    residual_std = INIT_STD / math.sqrt(2 * cfg["n_layer"])
    params = {}
    for name, shape in ref.param_shapes(cfg):
        if ref.is_layer_norm(name):
            t = torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        elif name.endswith("c_proj.weight"):
            t = torch.empty(shape).normal_(0.0, residual_std)
        else:
            t = torch.empty(shape).normal_(0.0, INIT_STD)
        params[name] = t.requires_grad_(True)
    plist = list(params.values())
    n_params = sum(t.numel() for t in plist)

    decay = [t for t in plist if t.dim() >= 2]
    no_decay = [t for t in plist if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": ADAMW["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"])

    bf16 = spec["precision"] == "bf16"
    gen = torch.Generator().manual_seed(SEED + 1)

    def step():
        idx = torch.randint(0, V, (B, T), generator=gen)
        targets = torch.randint(0, V, (B, T), generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref.gpt2_loss(ref.gpt2_forward(params, idx, cfg), targets)
        else:
            loss = ref.gpt2_loss(ref.gpt2_forward(params, idx, cfg), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plist, ADAMW["clip"])
        opt.step()
        loss_value = loss.item()
        wall = time.perf_counter() - t0
        return wall * 1e3, loss_value, (time.process_time() - c0) / wall

    for _ in range(spec["warmup"]):
        step()
    step_ms, losses, cores = [], [], []
    for _ in range(spec["steps"]):
        ms, loss_value, cores_used = step()
        step_ms.append(ms)
        losses.append(loss_value)
        cores.append(cores_used)

    median_ms = statistics.median(step_ms)
    tokens_per_s = B * T / (median_ms / 1e3)
    # Model FLOPs per token as nanoGPT's estimate_mfu counts them: 6N + 12 L T C (N without wpe).
    n_flop_params = n_params - cfg["n_positions"] * cfg["n_embd"]
    flops_per_token = 6 * n_flop_params + 12 * cfg["n_layer"] * T * cfg["n_embd"]
    result = {
        "tokens_per_s": tokens_per_s,
        "step_ms_median": median_ms,
        "step_ms": step_ms,
        "losses": losses,
        # CPU time / wall time of each timed step: about `threads` on an idle machine, less when
        # other processes take the cores (then the step time is inflated by the contention).
        "cores_used": cores,
        "model_flops_per_s": flops_per_token * tokens_per_s,
        "n_params": n_params,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in
                list(TUNED_ENV) + ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"]},
        "self_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------

def run_child(cmd, env, timeout_s):
    """Runs cmd to completion; returns (exit code, stdout, stderr, wall seconds, peak RSS bytes of
    that child alone, from os.wait4, CPU seconds (user + system) of that child). Exit code -9 after a
    timeout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        try:
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=REPO_ROOT)
        except OSError as e:
            return None, "", str(e), 0.0, None, 0.0
        lock = threading.Lock()
        done = [False]

        def kill():
            with lock:
                if not done[0]:
                    p.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        _, status, usage = os.wait4(p.pid, 0)
        with lock:
            done[0] = True
            p.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
        timer.cancel()
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return (p.returncode, out.read().decode("utf-8", "replace"),
                err.read().decode("utf-8", "replace"), wall, usage.ru_maxrss * 1024,
                usage.ru_utime + usage.ru_stime)


def last_line(text, limit=160):
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    if not lines:
        return ""
    s = lines[-1]
    return s if len(s) <= limit else s[:limit - 3] + "..."


def parse_json_object(text):
    """The JSON object a `--json` command printed: the whole output, or its last line that parses."""
    text = text.strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            return obj
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        try:
            return json.loads(text[start:end + 1])
        except ValueError:
            pass
    return None


def base_env(threads):
    """The environment of every child: the caller's, without the tuned variables (out of the box
    means unset), with the thread count fixed."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_ENV}
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    return env


_headroom_help_cache = {}


def headroom_bench_help(headroom, env):
    if headroom not in _headroom_help_cache:
        try:
            r = subprocess.run([headroom, "bench", "--help"], env=env, capture_output=True,
                               text=True, timeout=60, cwd=REPO_ROOT)
            _headroom_help_cache[headroom] = r.stdout + r.stderr if r.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            _headroom_help_cache[headroom] = ""
    return _headroom_help_cache[headroom]


def unsupported_precision(text):
    t = text.lower()
    return ("precision" in t or "bf16" in t) and any(
        w in t for w in ("unsupported", "not supported", "not implemented", "not yet",
                         "not built", "only fp32"))


def run_headroom(args, model, precision, batch):
    env = base_env(args.threads)
    cmd = [args.headroom, "bench", "--model", model, "--batch", str(batch), "--seq", str(args.seq),
           "--precision", precision, "--steps", str(args.steps), "--json"]
    help_text = headroom_bench_help(args.headroom, env)
    if "--warmup" in help_text:
        cmd[-1:-1] = ["--warmup", str(args.warmup)]
    if "--threads" in help_text:
        cmd[-1:-1] = ["--threads", str(args.threads)]
    rec = {"cmd": cmd, "env_overrides": {k: env[k] for k in ("OMP_NUM_THREADS",
                                                            "OPENBLAS_NUM_THREADS")}}
    if not os.path.exists(args.headroom):
        rec.update(ok=False, status="n/a", error=f"{args.headroom} not found (build it first)")
        return rec
    rc, out, err, wall, rss, cpu = run_child(cmd, env, args.timeout)
    rec.update(rc=rc, wall_s=wall, cpu_s=cpu, peak_rss_bytes=rss, stderr_tail=err[-2000:])
    obj = parse_json_object(out) if rc == 0 else None
    if rc == 0 and obj is not None and "tokens_per_s" in obj:
        rec.update(ok=True, result=obj)
        return rec
    rec["stdout_tail"] = out[-2000:]
    rec["ok"] = False
    if rc != 0 and unsupported_precision(out + err):
        rec.update(status="n/a (not built yet)", error=last_line(err) or last_line(out))
    elif rc == -9:
        rec.update(status="n/a (timeout)", error=f"killed after {args.timeout} s")
    elif rc == 0:
        rec.update(status="n/a (no JSON)", error="exit 0 but no JSON object with tokens_per_s")
    else:
        rec.update(status="n/a", error=f"exit {rc}: " + (last_line(err) or last_line(out)))
    return rec


def run_torch(args, system, model, precision, batch):
    env = base_env(args.threads)
    overrides = {k: env[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    if system == "torch-tuned":
        env.update(TUNED_ENV)
        overrides.update(TUNED_ENV)
    spec = dict(model=model, precision=precision, batch=batch, seq=args.seq, steps=args.steps,
                warmup=args.warmup, threads=args.threads)
    cmd = [args.torch_python, os.path.abspath(__file__), "--torch-worker", json.dumps(spec)]
    rec = {"cmd": cmd, "env_overrides": overrides}
    rc, out, err, wall, rss, cpu = run_child(cmd, env, args.timeout)
    rec.update(rc=rc, wall_s=wall, cpu_s=cpu, peak_rss_bytes=rss, stderr_tail=err[-2000:])
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            rec.update(ok=rc == 0, result=json.loads(line[len(RESULT_TAG):]))
            if rc == 0:
                return rec
    rec["ok"] = False
    rec["stdout_tail"] = out[-2000:]
    if rc == -9:
        rec.update(status="n/a (timeout)", error=f"killed after {args.timeout} s")
    else:
        rec.update(status="n/a", error=f"exit {rc}: " + (last_line(err) or last_line(out)))
    return rec


def cpu_model():
    name, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name in ("unknown", "", "x86_64"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    notable = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return name + (f" ({', '.join(notable)})" if notable else "")


def fmt_tps(rec):
    if rec is None:
        return "-"
    if rec.get("ok"):
        return f"{rec['result']['tokens_per_s']:.1f}"
    return rec.get("status", "n/a")


def fmt_rss(rec):
    if rec is None:
        return "-"
    if rec.get("ok") and rec.get("peak_rss_bytes"):
        return f"{rec['peak_rss_bytes'] / 1e9:.2f} GB"
    return "n/a"


def cores_used(rec):
    """CPU time / wall time: the torch worker's median over timed steps, else the whole process."""
    if rec is None or not rec.get("ok"):
        return None
    per_step = rec["result"].get("cores_used")
    if per_step:
        return statistics.median(per_step)
    if rec.get("wall_s") and rec.get("cpu_s") is not None:
        return rec["cpu_s"] / rec["wall_s"]
    return None


def combine(recs):
    """One system's runs of a configuration (one per round) as one record: the median tokens/s,
    MFU and peak RSS of the runs that succeeded; the first failure's status when none did."""
    if not recs:
        return None
    ok = [r for r in recs if r.get("ok")]
    if not ok:
        return recs[0]
    out = dict(ok[0])
    out["result"] = dict(ok[0]["result"])
    for key in ("tokens_per_s", "mfu", "mfu_in_run"):
        vals = [r["result"][key] for r in ok if key in r["result"]]
        if vals:
            out["result"][key] = statistics.median(vals)
    rss = [r["peak_rss_bytes"] for r in ok if r.get("peak_rss_bytes")]
    out["peak_rss_bytes"] = statistics.median(rss) if rss else None
    if len(recs) > 1:
        out["rounds_ok"] = len(ok)
    return out


def ratio(a_runs, b_runs, key):
    """headroom / peer: the median over rounds of the ratio within each round (a round runs every
    system once, back to back, so a ratio pairs runs seconds apart on this drifting machine)."""
    if not a_runs or not b_runs:
        return "-"
    rs = []
    for a, b in zip(a_runs, b_runs):
        if not a.get("ok") or not b.get("ok"):
            continue
        if key == "tps":
            x, y = a["result"]["tokens_per_s"], b["result"]["tokens_per_s"]
        else:
            x, y = a.get("peak_rss_bytes"), b.get("peak_rss_bytes")
        if x and y:
            rs.append(x / y)
    if not rs:
        return "-"
    text = f"{statistics.median(rs):.2f}x"
    if len(rs) > 1:
        text += f" ({min(rs):.2f}-{max(rs):.2f})"
    return text


def fmt_mfu(rec):
    """headroom's MFU against the cached calibration / against the peak timed in the run."""
    if rec is None or not rec.get("ok"):
        return "-"
    r = rec["result"]
    if "mfu" not in r:
        return "-"
    text = f"{100 * r['mfu']:.1f}%"
    if "mfu_in_run" in r:
        text += f" / {100 * r['mfu_in_run']:.1f}%"
    return text


def markdown(args, meta, rows):
    out = []
    out.append("# headroom vs PyTorch: GPT-2 training step on CPU")
    out.append("")
    out.append(f"- command: `{meta['command']}`")
    out.append(f"- date: {meta['date']}; host {meta['host']}")
    out.append(f"- CPU: {meta['cpu']}; {meta['cpus']} logical CPUs; load average at start "
               f"{meta['loadavg_start']}, at end {meta['loadavg_end']}")
    out.append(f"- threads: {args.threads} for every process (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, "
               f"torch.set_num_threads)")
    out.append(f"- PyTorch: {meta.get('torch_version', '?')} via `{args.torch_python}`; "
               f"headroom: `{args.headroom}`")
    out.append(f"- T={args.seq}; {args.warmup} warm-up step(s) then {args.steps} timed step(s); "
               f"tokens/s = B*T / median step time; peak RSS = ru_maxrss of each process "
               f"(one process per cell, GB = 1e9 bytes)")
    out.append("- torch-tuned = the same PyTorch process with "
               + " ".join(f"{k}={v}" for k, v in TUNED_ENV.items())
               + ", set for that process only (headroom and out-of-the-box torch run without "
               "them: OPENBLAS_CORETYPE unset)")
    out.append("- ratios are headroom / torch: > 1 for tokens/s means headroom is faster, "
               "< 1 for RSS means headroom uses less memory")
    out.append("- noisy: a shared machine; compare ratios within one run, not absolute figures "
               "across runs")
    out.append("")
    if args.rounds > 1:
        out.append(f"- {args.rounds} rounds: each round runs every system once, back to back, "
                   f"starting with a different one each round; tok/s and RSS are medians over "
                   f"rounds, a ratio is the median of the ratios within each round (range in "
                   f"brackets)")
    out.append("- headroom MFU: against the cached `headroom calibrate` peak / against the GEMM "
               "peak timed after each of its steps in the same run (`mfu_in_run`; "
               "docs/calibration.md)")
    out.append("")
    out.append("| config | headroom tok/s | torch tok/s | torch-tuned tok/s | ratio vs torch | "
               "ratio vs tuned | headroom MFU | headroom peak RSS | torch peak RSS | "
               "torch-tuned peak RSS | ratio (RSS vs torch) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (model, precision, batch), runs in rows:
        hr, tr, ttr = runs.get("headroom"), runs.get("torch"), runs.get("torch-tuned")
        h, t, tt = combine(hr), combine(tr), combine(ttr)
        out.append(f"| {model} {precision} b={batch} | {fmt_tps(h)} | {fmt_tps(t)} | {fmt_tps(tt)} "
                   f"| {ratio(hr, tr, 'tps')} | {ratio(hr, ttr, 'tps')} | {fmt_mfu(h)} "
                   f"| {fmt_rss(h)} | {fmt_rss(t)} | {fmt_rss(tt)} | {ratio(hr, tr, 'rss')} |")
    used = []
    for (model, precision, batch), runs in rows:
        parts = []
        for system, recs in runs.items():
            cus = [cores_used(rec) for rec in recs]
            cus = [c for c in cus if c is not None]
            if cus:
                parts.append(f"{system} " + "/".join(f"{c:.2f}" for c in cus))
        if parts:
            used.append(f"- {model} {precision} b={batch}: " + ", ".join(parts))
    if used:
        out.append("")
        out.append(f"Cores used (CPU time / wall time; about {args.threads} when the machine is "
                   f"otherwise idle, lower means other processes took the cores and the figures "
                   f"above are inflated by contention; torch: median over timed steps, headroom: "
                   f"whole process):")
        out.append("")
        out.extend(used)
    errors = []
    for (model, precision, batch), runs in rows:
        for system, recs in runs.items():
            for rec in recs:
                if not rec.get("ok") and rec.get("error"):
                    errors.append(f"- {system} {model} {precision} b={batch}: {rec['error']}")
    if errors:
        out.append("")
        out.append("Not measured:")
        out.append("")
        out.extend(errors)
    return "\n".join(out)


def csv_list(s, allowed=None, conv=str):
    items = [conv(x.strip()) for x in s.split(",") if x.strip()]
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
    return items


def loadavg():
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--torch-worker"]:
        return torch_worker(json.loads(argv[1]))

    ap = argparse.ArgumentParser(
        description="headroom bench vs PyTorch (out of the box and tuned) on the same GPT-2 step",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default="gpt2", type=lambda s: csv_list(s, MODELS),
                    help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--batches", default="1,4,8", type=lambda s: csv_list(s, conv=int),
                    help="micro-batches (sequences)")
    ap.add_argument("--precisions", default="fp32,bf16", type=lambda s: csv_list(s, PRECISIONS),
                    help="comma-separated: " + ", ".join(PRECISIONS))
    ap.add_argument("--seq", type=int, default=256, help="sequence length T")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps before them (passed to headroom bench as --warmup when "
                    "it has that flag)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    type=lambda s: csv_list(s, SYSTEMS),
                    help="comma-separated: " + ", ".join(SYSTEMS))
    ap.add_argument("--headroom", default="build/release/headroom", help="the headroom binary")
    ap.add_argument("--torch-python", default="/usr/bin/python3",
                    help="interpreter with torch (Debian's python3-torch)")
    ap.add_argument("--threads", type=int, default=2,
                    help="threads of every process (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, "
                    "torch.set_num_threads, headroom --threads)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, the systems alternated "
                    "(a different one first each round); medians over rounds")
    ap.add_argument("--json", metavar="FILE", help="write all raw results here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not os.path.isabs(args.headroom):
        args.headroom = os.path.join(REPO_ROOT, args.headroom)

    preset = [k for k in TUNED_ENV if k in os.environ]
    if preset:
        print(f"note: {', '.join(preset)} set in this environment; removed for headroom and "
              f"out-of-the-box torch", file=sys.stderr)

    meta = {
        "command": " ".join(shlex.quote(a) for a in [sys.argv[0]] + argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg(),
        "threads": args.threads,
        "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "tuned_env": TUNED_ENV,
        "headroom": args.headroom,
        "torch_python": args.torch_python,
    }

    runs, rows = [], []
    configs = [(m, p, b) for m in args.models for p in args.precisions for b in args.batches]
    total = len(configs) * len(args.systems) * args.rounds
    n = 0
    for model, precision, batch in configs:
        recs = {system: [] for system in args.systems}
        for rnd in range(args.rounds):
            k = rnd % len(args.systems)
            for system in args.systems[k:] + args.systems[:k]:
                n += 1
                print(f"[{n}/{total}] {system} {model} {precision} b={batch} T={args.seq}"
                      + (f" round {rnd + 1}" if args.rounds > 1 else "") + " ...",
                      end="", file=sys.stderr, flush=True)
                if system == "headroom":
                    rec = run_headroom(args, model, precision, batch)
                else:
                    rec = run_torch(args, system, model, precision, batch)
                rec.update(system=system, model=model, precision=precision, batch=batch, seq=args.seq,
                           round=rnd + 1)
                if rec.get("ok") and "torch_version" in rec["result"]:
                    meta["torch_version"] = rec["result"]["torch_version"]
                recs[system].append(rec)
                runs.append(rec)
                cu = cores_used(rec)
                print(f" {fmt_tps(rec)} tok/s, peak RSS {fmt_rss(rec)}"
                      + (f", {cu:.2f} cores used" if cu is not None else "")
                      + (f" [{rec['error']}]" if rec.get("error") else ""), file=sys.stderr,
                      flush=True)
        rows.append(((model, precision, batch), recs))
    meta["loadavg_end"] = loadavg()

    print(markdown(args, meta, rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
