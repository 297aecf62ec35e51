"""Writes tests/model/fixtures/hf_sharded_llama/: a tiny Llama in the layout Hugging Face's
save_pretrained writes (config.json with the fields transformers adds, bf16 tensors in two shards
named model-0000N-of-00002.safetensors, model.safetensors.index.json with the weight map, the
tensors in alphabetical order as transformers lists them), written here without headroom's code,
plus expected.json: per tensor its shape, the float64 sum of its values and its first four
values, for tests/model/hf_layout_test.cc to check a load against.

Needs only numpy and the standard library: /usr/bin/python3 tools/reference/hf_sharded_fixture.py
"""

import json
import os
import struct
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "model", "fixtures",
                   "hf_sharded_llama")

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 88,
    "max_position_embeddings": 16,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0",
    "use_cache": True,
    "vocab_size": 96,
}


def shapes(c):
    C, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hs = C // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hs
    s = {"model.embed_tokens.weight": [V, C], "model.norm.weight": [C], "lm_head.weight": [V, C]}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        s[p + "input_layernorm.weight"] = [C]
        s[p + "post_attention_layernorm.weight"] = [C]
        s[p + "self_attn.q_proj.weight"] = [C, C]
        s[p + "self_attn.k_proj.weight"] = [kv, C]
        s[p + "self_attn.v_proj.weight"] = [kv, C]
        s[p + "self_attn.o_proj.weight"] = [C, C]
        s[p + "mlp.gate_proj.weight"] = [I, C]
        s[p + "mlp.up_proj.weight"] = [I, C]
        s[p + "mlp.down_proj.weight"] = [C, I]
    return s


def to_bf16(x):
    """Rounds float32 to bfloat16 (nearest even) and returns the 16-bit patterns."""
    u = x.astype("<f4").view("<u4").astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype("<u2")


def bf16_to_f32(b):
    return (b.astype("<u4") << 16).view("<f4")


def write_shard(path, tensors):
    header = {"__metadata__": {"format": "pt"}}
    chunks, offset = [], 0
    for name, arr in tensors:
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        chunks.append(arr.tobytes())
        offset += arr.nbytes
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    return offset


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261203)
    names = sorted(shapes(CONFIG).items())
    values = {}
    for name, shape in names:
        x = rng.standard_normal(shape).astype("<f4") * (1.0 if name.endswith("norm.weight") else 0.05)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        values[name] = to_bf16(x).reshape(shape)
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for shard, part in zip(shard_names, parts):
        total += write_shard(os.path.join(OUT, shard), [(n, values[n]) for n, _ in part])
        for n, _ in part:
            weight_map[n] = shard
    with open(os.path.join(OUT, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")
    with open(os.path.join(OUT, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
        f.write("\n")
    expected = {}
    for name, shape in names:
        v = bf16_to_f32(values[name].reshape(-1))
        expected[name] = {"shape": shape, "sum": float(np.sum(v.astype(np.float64))),
                          "first": [float(t) for t in v[:4]]}
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
