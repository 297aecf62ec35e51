"""Helpers shared by the golden fixture writers (gpt2_reference.py, llama_reference.py).

- write_safetensors: a minimal safetensors writer (json + struct, no `safetensors` package);
- f32: a tensor as a little-endian float32 numpy array;
- adamw_run: N steps of torch.optim.AdamW in float32 with global-norm clipping, weight decay on
  2-D tensors only;
- check_outputs: regenerate into a temporary directory and compare with the committed files.

Run with Debian's interpreter, which has python3-torch (/usr/bin/python3).
"""

import json
import os
import struct
import sys
import tempfile

import numpy as np
import torch


def write_safetensors(path, tensors, metadata):
    """A minimal safetensors writer (json + struct). `tensors`: list of (name, numpy array) with
    dtype float32 or int32, laid out in order. The header is padded with spaces so the data
    section starts 8-byte aligned, as the reference implementation does."""
    dtype_names = {np.dtype("<f4"): "F32", np.dtype("<i4"): "I32"}
    header = {"__metadata__": metadata}
    chunks, offset = [], 0
    for name, arr in tensors:
        arr = np.array(arr, order="C", copy=True)  # ascontiguousarray would turn 0-d into 1-d
        header[name] = {"dtype": dtype_names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        chunks.append(arr.tobytes())
        offset += arr.nbytes
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    os.replace(tmp, path)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def f32(t):
    return t.detach().to(torch.float32).numpy().astype("<f4")


def adamw_run(params, loss_fn, hp):
    """hp["steps"] steps of torch.optim.AdamW (foreach=False) in float32, clipping the global
    gradient norm to hp["clip"] before each step. Weight decay hp["weight_decay"] on tensors with
    dim() >= 2, 0 on the others. `params` maps names to float32 tensors (not modified);
    `loss_fn(p)` returns the scalar loss for a dict of the same names. The parameter order (for
    the optimizer groups and the clipping sum) is the dict's order. Returns the losses and the
    norms (before clipping) of each step, and the final parameters."""
    p = {n: t.detach().clone().requires_grad_(True) for n, t in params.items()}
    decay = [t for t in p.values() if t.dim() >= 2]
    no_decay = [t for t in p.values() if t.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"], foreach=False)
    losses, norms = [], []
    for _ in range(hp["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(p)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(p.values()), hp["clip"])
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, {n: t.detach() for n, t in p.items()}


def check_outputs(out_dir, names, write_fn):
    """Run write_fn(directory) into a temporary directory and compare each file in `names` byte
    for byte with the one in out_dir. Prints the verdict; returns the exit status (0 or 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_fn(tmp)
        stale = []
        for name in names:
            with open(os.path.join(tmp, name), "rb") as a:
                fresh = a.read()
            try:
                with open(os.path.join(out_dir, name), "rb") as b:
                    committed = b.read()
            except FileNotFoundError:
                committed = None
            if fresh != committed:
                stale.append(name)
    if stale:
        print(f"fixtures differ from a fresh run: {', '.join(stale)}", file=sys.stderr)
        return 1
    print("fixtures are up to date")
    return 0
