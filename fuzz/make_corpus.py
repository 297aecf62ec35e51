#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/<target>/: small valid files of each format, the
layouts mirroring src/model/safetensors.cc, src/data/token_file.cc, src/train/checkpoint.cc,
src/data/hf_tokenizer.cc and src/data/spm_tokenizer.cc.
Deterministic; run it again after a format change (tests/*/fuzz_regression_test.cc check that
the seeds are still accepted). Usage: fuzz/make_corpus.py"""
import json
import os
import shutil
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SEPARATOR = b"\n--headroom-fuzz-next-file--\n"  # fuzz/checkpoint_fuzzer.cc

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 4, "vocab_size": 8, "n_positions": 4}


def config_json(c, **extra):
    j = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": c["n_layer"],
         "n_head": c["n_head"], "n_embd": c["n_embd"], "vocab_size": c["vocab_size"],
         "n_positions": c["n_positions"], "n_ctx": c["n_positions"], "layer_norm_epsilon": 1e-05,
         "activation_function": "gelu_new", "tie_word_embeddings": True}
    j.update(extra)
    return (json.dumps(j, indent=2) + "\n").encode()


def param_table(c):
    """(name, shape) in gpt2_param_table's order, and total_floats (16-float padding)."""
    C = c["n_embd"]
    params = [("wte.weight", [c["vocab_size"], C]), ("wpe.weight", [c["n_positions"], C])]
    for l in range(c["n_layer"]):
        p = f"h.{l}."
        params += [(p + "ln_1.weight", [C]), (p + "ln_1.bias", [C]),
                   (p + "attn.c_attn.weight", [C, 3 * C]), (p + "attn.c_attn.bias", [3 * C]),
                   (p + "attn.c_proj.weight", [C, C]), (p + "attn.c_proj.bias", [C]),
                   (p + "ln_2.weight", [C]), (p + "ln_2.bias", [C]),
                   (p + "mlp.c_fc.weight", [C, 4 * C]), (p + "mlp.c_fc.bias", [4 * C]),
                   (p + "mlp.c_proj.weight", [4 * C, C]), (p + "mlp.c_proj.bias", [C])]
    params += [("ln_f.weight", [C]), ("ln_f.bias", [C])]
    total = 0
    for _, shape in params:
        n = 1
        for d in shape:
            n *= d
        total += (n + 15) // 16 * 16
    return params, total


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def safetensors(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)], laid out in order; header padded to 8 bytes."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def bf16(values):
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def model_tensors(c, dtype="F32", prefix=""):
    out = []
    for i, (name, shape) in enumerate(param_table(c)[0]):
        values = [((i * 7 + k) % 13 - 6) / 8.0 for k in range(numel(shape))]
        out.append((prefix + name, dtype, shape, f32(values) if dtype == "F32" else bf16(values)))
    return out


def token_file(tokens, vocab, eot, docs):
    width = 2 if vocab <= 65536 else 4
    header = b"HRTOKENS" + struct.pack("<IIQIIQ", 1, width, len(tokens), vocab, eot, docs)
    header += b"\0" * (64 - len(header))
    return header + b"".join(t.to_bytes(width, "little") for t in tokens)


def trainer_state(**over):
    s = {"version": 1, "step": 7, "data_position": 96, "total_steps": 20, "warmup_steps": 3,
         "lr": 0.0006, "min_lr_ratio": 0.1, "micro_batch": 2, "accumulation": 2, "seq": 4,
         "seed": 1337, "data": "data/fortunes.tok"}
    s.update(over)
    return (json.dumps(s, indent=2) + "\n").encode()


def varint(v):
    v &= (1 << 64) - 1
    out = b""
    while v >= 0x80:
        out += bytes([(v & 0x7F) | 0x80])
        v >>= 7
    return out + bytes([v])


def pb_bytes(field, data):
    return varint(field << 3 | 2) + varint(len(data)) + data


def pb_int(field, v):
    return varint(field << 3) + varint(v)


def spm_model(pieces, byte_fallback=True):
    """A SentencePiece ModelProto (BPE): pieces as (piece, score, type)."""
    out = b""
    for piece, score, typ in pieces:
        m = pb_bytes(1, piece.encode()) + varint(2 << 3 | 5) + struct.pack("<f", score)
        if typ != 1:
            m += pb_int(3, typ)
        out += pb_bytes(1, m)
    trainer = (pb_int(3, 2) + pb_int(35, int(byte_fallback)) + pb_int(40, 0) + pb_int(41, 1) +
               pb_int(42, 2) + pb_int(43, -1))
    norm = pb_bytes(1, b"identity") + pb_int(3, 1) + pb_int(4, 0)
    return out + pb_bytes(2, trainer) + pb_bytes(3, norm)


SP = "\u2581"


def sentencepiece_tokens(with_bytes):
    """Small SentencePiece-style pieces: unk, bos, eos, some bytes, then merged pieces."""
    toks = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    if with_bytes:
        toks += [("<0x%02X>" % b, 0.0, 6) for b in (0x0A, 0x20, 0x41, 0xC3, 0xE2, 0xFF)]
    toks += [(SP + SP, -100.0, 1), (SP + "t", -1.0, 1), ("he", -2.0, 1), (SP + "the", -3.0, 1),
             (SP, -4.0, 1), ("t", -5.0, 1), ("h", -5.0, 1), ("e", -5.0, 1), ("<user>", 0.0, 4)]
    return toks


def hf_sentencepiece_json():
    vocab = {t: i for i, (t, _, _) in enumerate(sentencepiece_tokens(True)[:-1])}
    return json.dumps({
        "version": "1.0",
        "added_tokens": [{"id": 0, "content": "<unk>", "special": True},
                         {"id": 1, "content": "<s>", "special": True},
                         {"id": 2, "content": "</s>", "special": True, "lstrip": True}],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP},
            {"type": "Replace", "pattern": {"String": " "}, "content": SP}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True,
                  "byte_fallback": True, "vocab": vocab,
                  "merges": [SP + " t", "h e", [SP + "t", "he"]]}}, indent=1).encode()


def hf_bytelevel_json():
    """A byte-level vocabulary (GPT-2's alphabet) with Llama 3's pre-tokenizer shape."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    n, alphabet = 0, []
    for b in range(256):
        if b in printable:
            alphabet.append(chr(b))
        else:
            alphabet.append(chr(256 + n))
            n += 1
    vocab = {c: i for i, c in enumerate(alphabet)}
    for t in ["he", "ll", "hell", "hello", "\u0120w", "or", "\u0120wor"]:
        vocab[t] = len(vocab)
    return json.dumps({
        "added_tokens": [{"id": len(vocab), "content": "<|end_of_text|>", "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                                   "\\p{N}{1,3}|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab,
                  "merges": ["h e", "l l", ["he", "ll"], "hell o", "\u0120 w", "o r",
                             "\u0120w or"]}}, indent=1).encode()


def main():
    shutil.rmtree(ROOT, ignore_errors=True)
    files = {}
    # config.json: the presets as headroom writes them, and Hugging Face's spellings.
    files["config/gpt2-tiny.json"] = config_json({"n_layer": 4, "n_head": 4, "n_embd": 128,
                                                  "vocab_size": 50257, "n_positions": 256})
    files["config/gpt2.json"] = config_json({"n_layer": 12, "n_head": 12, "n_embd": 768,
                                             "vocab_size": 50257, "n_positions": 1024})
    files["config/hf-aliases.json"] = json.dumps(
        {"model_type": "gpt2", "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
         "vocab_size": 16, "n_ctx": 8, "activation_function": "gelu_pytorch_tanh",
         "layer_norm_epsilon": 1e-6, "bos_token_id": 0, "task_specific_params": {"a": [1, 2.5]},
         "torch_dtype": "float32"}).encode()
    files["config/tiny.json"] = config_json(TINY)

    # safetensors: a tiny GPT-2 in F32 (as save_pretrained writes it), in BF16 with Hugging
    # Face's "transformer." prefix and mask buffer, and a file of every readable dtype.
    files["safetensors/tiny-f32.safetensors"] = safetensors(model_tensors(TINY), {"format": "pt"})
    files["safetensors/tiny-bf16-hf.safetensors"] = safetensors(
        model_tensors(TINY, "BF16", "transformer.") +
        [("transformer.h.0.attn.bias", "F32", [1, 1, 4, 4], f32([1.0] * 16))])
    files["safetensors/dtypes.safetensors"] = safetensors(
        [("a.f32", "F32", [2, 2], f32([1, 2, 3, 4])), ("b.bf16", "BF16", [3], bf16([1, -2, 0.5])),
         ("c.f16", "F16", [2], struct.pack("<2e", 1.5, -0.25)),
         ("d.i64", "I64", [], struct.pack("<q", -5)), ("e.i32", "I32", [1, 2],
                                                        struct.pack("<2i", 7, 8)),
         ("f.u16", "U16", [2], struct.pack("<2H", 1, 65535)), ("g.empty", "F32", [0, 3], b"")],
        {"format": "pt", "note": "seed"})
    files["safetensors/empty.safetensors"] = safetensors([])

    # token files: 2-byte and 4-byte tokens, and no tokens at all.
    files["token_file/gpt2.tok"] = token_file([464, 3290, 318, 13, 50256, 40, 50256], 50257,
                                              50256, 2)
    files["token_file/wide.tok"] = token_file([1, 99999, 65536, 0, 70000], 100000, 0, 2)
    files["token_file/empty.tok"] = token_file([], 16, 15, 0)

    # tokenizer.json: SentencePiece style (Mistral's shape) and byte-level (Llama 3's shape).
    files["hf_tokenizer/sentencepiece.json"] = hf_sentencepiece_json()
    files["hf_tokenizer/bytelevel.json"] = hf_bytelevel_json()

    # tokenizer.model: BPE with byte fallback, and without byte pieces.
    files["spm_model/bytes.model"] = spm_model(sentencepiece_tokens(True))
    files["spm_model/nobytes.model"] = spm_model(sentencepiece_tokens(False), byte_fallback=False)

    # checkpoint: a complete checkpoint of the tiny model, and one in the bf16 HF layout.
    _, total = param_table(TINY)
    opt = safetensors([("adam_m", "F32", [total], f32([0.001] * total)),
                       ("adam_v", "F32", [total], f32([0.0001] * total))],
                      {"layout": "headroom flat parameter buffer"})
    files["checkpoint/step.ckpt"] = SEPARATOR.join(
        [config_json(TINY), trainer_state(), safetensors(model_tensors(TINY), {"format": "pt"}),
         opt])
    files["checkpoint/hf-weights.ckpt"] = SEPARATOR.join(
        [config_json(TINY), trainer_state(step=1, data_position=0),
         safetensors(model_tensors(TINY, "BF16", "transformer.")), opt])

    for rel, data in sorted(files.items()):
        path = os.path.join(ROOT, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        print(f"{rel}: {len(data)} bytes")


if __name__ == "__main__":
    main()
