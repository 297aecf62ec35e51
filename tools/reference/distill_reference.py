#!/usr/bin/python3
"""PyTorch reference for knowledge distillation and the fixture of headroom's KD head tests.

A tiny student head and a tiny teacher head of a different width over one vocabulary: the
student's final hidden states xs [N, Cs] and head weight ws [V, Cs], the teacher's xt [N, Ct] and
wt [V, Ct], targets [N] with one ignored (-1). For several (alpha, temperature) it writes, in
float64 and rounded once to float32, the loss of one optimizer step

    loss = sum_n [alpha T^2 KL(softmax(t_n / T) || softmax(s_n / T)) + (1 - alpha) CE(s_n)] / valid

(the per-token loss normalised by the valid tokens, as headroom's trainer normalises the CE), its
CE and KL parts, and its gradients w.r.t. the student's logits, hidden states and head weight.
The KL is torch's F.kl_div(log q, log p, log_target=True), the form Hinton et al. and most
distillation code use.

It writes tests/train/fixtures/distill_tiny.safetensors. Deterministic (one thread, fixed seed):
`--check` regenerates into a temporary directory and fails if the committed file differs.

Run with Debian's interpreter, which has python3-torch: /usr/bin/python3 distill_reference.py
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import check_outputs, f32, write_safetensors  # noqa: E402

# V deliberately not a multiple of 64 (the kernels' padded rows) nor of 16 (their lanes).
N, V, CS, CT = 7, 83, 8, 12
SEED = 4321
IGNORED = [3]
# (alpha, temperature): the defaults, a pure-CE-leaning mix at T = 1, pure KD at a high T.
CASES = [(0.5, 2.0), (0.25, 1.0), (1.0, 4.0)]
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                           "train", "fixtures")


def kd_loss(xs, ws, xt, wt, targets, alpha, temp):
    s = xs @ ws.T
    t = xt @ wt.T
    valid = targets >= 0
    ce = F.cross_entropy(s, targets.clamp(min=0), reduction="none")
    kl = F.kl_div(F.log_softmax(s / temp, dim=-1), F.log_softmax(t / temp, dim=-1),
                  log_target=True, reduction="none").sum(-1)
    per_token = alpha * temp * temp * kl + (1 - alpha) * ce
    count = valid.sum()
    loss = (per_token * valid).sum() / count
    return loss, (ce * valid).sum() / count, (kl * valid).sum() / count, s


def build_fixture():
    g = torch.Generator().manual_seed(SEED)
    xs = torch.randn(N, CS, generator=g, dtype=torch.float64)
    ws = torch.randn(V, CS, generator=g, dtype=torch.float64) * 0.5
    xt = torch.randn(N, CT, generator=g, dtype=torch.float64)
    wt = torch.randn(V, CT, generator=g, dtype=torch.float64) * 0.5
    # Inputs rounded to float32 first, so that the reference sees exactly what the C++ reads.
    xs, ws, xt, wt = (torch.from_numpy(f32(a)).to(torch.float64) for a in (xs, ws, xt, wt))
    targets = torch.randint(0, V, (N,), generator=g)
    for i in IGNORED:
        targets[i] = -1

    tensors = [("xs", f32(xs)), ("ws", f32(ws)), ("xt", f32(xt)), ("wt", f32(wt)),
               ("targets", targets.to(torch.int32).numpy().astype("<i4"))]
    for k, (alpha, temp) in enumerate(CASES):
        xs_ = xs.clone().requires_grad_(True)
        ws_ = ws.clone().requires_grad_(True)
        loss, ce, kl, s = kd_loss(xs_, ws_, xt, wt, targets, alpha, temp)
        s.retain_grad()
        loss.backward()
        p = f"case{k}."
        tensors += [(p + "loss", f32(loss)), (p + "ce", f32(ce)), (p + "kl", f32(kl)),
                    (p + "dlogits", f32(s.grad)), (p + "dxs", f32(xs_.grad)),
                    (p + "dws", f32(ws_.grad))]
    metadata = {"N": str(N), "V": str(V), "Cs": str(CS), "Ct": str(CT), "cases": str(len(CASES)),
                "torch": torch.__version__}
    for k, (alpha, temp) in enumerate(CASES):
        metadata[f"case{k}.alpha"] = repr(alpha)
        metadata[f"case{k}.temperature"] = repr(temp)
    return tensors, metadata


def write_outputs(out_dir, tensors, metadata):
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "distill_tiny.safetensors"), tensors, metadata)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=DEFAULT_OUT, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and fail if the file in "
                         "--out-dir differs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tensors, metadata = build_fixture()
    if args.check:
        return check_outputs(args.out_dir, ("distill_tiny.safetensors",),
                             lambda d: write_outputs(d, tensors, metadata))
    write_outputs(args.out_dir, tensors, metadata)
    print(f"torch {torch.__version__}: wrote {len(tensors)} tensors to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
