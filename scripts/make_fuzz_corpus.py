#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (committed; rerun
after changing a format). Each target gets a few valid inputs, so the fuzzer starts from the
paths a real file takes, and a few broken ones next to them (truncated, lying header, wrong
type), so it starts at the checks as well. Files stay small: they are mutated millions of times."""
import json
import os
import struct
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuzz", "corpus")


def put(target, name, data):
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(n, start=0.0):
    return struct.pack(f"<{n}f", *[start + 0.01 * i for i in range(n)])


# ---- llama2.c checkpoints: dim 4, hidden 8, 1 layer, 2 heads, 1 kv head, vocab 6, seq_len 3
D, H, L, NH, NKV, V, S = 4, 8, 1, 2, 1, 6, 3
hd = D // NH
KD = NKV * hd
layer = 2 * D + 2 * D * D + 2 * KD * D + 3 * H * D
def legacy(shared=True, rope=True):
    hdr = struct.pack("<7i", D, H, L, NH, NKV, V if shared else -V, S)
    n = L * layer + D + V * D * (1 if shared else 2) + (S * hd // 2 * 2 if rope else 0)
    return hdr + floats(n)
def v1(shared=True):
    hdr = struct.pack("<Ii7iB", 0x616B3432, 1, D, H, L, NH, NKV, V, S, 1 if shared else 0)
    hdr += b"\0" * (256 - len(hdr))
    return hdr + floats(L * layer + D + V * D * (1 if shared else 2))
put("llama2c_checkpoint", "legacy_shared.bin", legacy())
put("llama2c_checkpoint", "legacy_unshared.bin", legacy(shared=False))
put("llama2c_checkpoint", "v1_shared.bin", v1())
put("llama2c_checkpoint", "v1_unshared.bin", v1(shared=False))
put("llama2c_checkpoint", "bad_truncated.bin", legacy()[:-4])
put("llama2c_checkpoint", "bad_no_rope.bin", legacy(rope=False))
put("llama2c_checkpoint", "bad_heads.bin", struct.pack("<7i", 4, 8, 1, 3, 1, 6, 3) + floats(16))
put("llama2c_checkpoint", "bad_version2.bin", struct.pack("<Ii7iB", 0x616B3432, 2, D, H, L, NH, NKV, V, S, 1) + b"\0" * 219)
put("llama2c_checkpoint", "bad_huge.bin", struct.pack("<7i", 1 << 30, 1 << 30, 1 << 20, 1, 1, 1 << 30, 1 << 30))

# ---- tokenizer.bin: <unk> <s> </s>, the 256 byte tokens <0xXX>, then a few pieces and merges
def tokenizer(pieces, max_len=None):
    m = max_len if max_len is not None else max(len(p) for p, _ in pieces)
    out = struct.pack("<i", m)
    for p, s in pieces:
        out += struct.pack("<fi", s, len(p)) + p
    return out
special = [(b"<unk>", 0.0), (b"<s>", 0.0), (b"</s>", 0.0)]
byte_tokens = [(b"<0x%02X>" % b, 0.0) for b in range(256)]
words = [(p.encode(), -float(i)) for i, p in enumerate(
    [" ", "h", "e", "l", "o", "w", "r", "d", "t", "\u00e9", "\u20ac", "he", "ll", "hell", "hello", " w", "or", "wor", "world", " hello", " world"])]
put("llama2c_tokenizer", "small.bin", tokenizer(special + words))
put("llama2c_tokenizer", "bytes.bin", tokenizer(special + byte_tokens + words))
put("llama2c_tokenizer", "bad_truncated.bin", tokenizer(special + words)[:-3])
put("llama2c_tokenizer", "bad_too_few.bin", tokenizer(special[:2]))
put("llama2c_tokenizer", "bad_long_piece.bin", tokenizer(special + words, max_len=2))
put("llama2c_tokenizer", "bad_negative_len.bin", struct.pack("<ifi", 8, 0.0, -1))

# ---- safetensors
def safetensors(entries, metadata=None, pad=True, raw_header=None):
    header, blob = {}, b""
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    if metadata:
        header["__metadata__"] = metadata
    h = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    while pad and (8 + len(h)) % 8:
        h += b" "
    return struct.pack("<Q", len(h)) + h + blob
f16 = struct.pack("<4e", 1.0, -2.0, 0.5, 65504.0)
bf16 = struct.pack("<3H", 0x3F80, 0xC000, 0x7F80)
put("safetensors", "f32.safetensors", safetensors([("a", "F32", [2, 2], floats(4)), ("b", "F32", [3], floats(3))], {"format": "pt"}))
put("safetensors", "f16_bf16.safetensors", safetensors([("h", "F16", [4], f16), ("b", "BF16", [1, 3], bf16)]))
put("safetensors", "scalar_empty.safetensors", safetensors([("s", "F32", [], floats(1)), ("e", "F32", [0, 5], b"")]))
put("safetensors", "bad_dtype.safetensors", safetensors([("a", "I64", [1], b"\0" * 8)]))
put("safetensors", "bad_overlap.safetensors",
    safetensors([], raw_header=b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + floats(2))
put("safetensors", "bad_header_len.safetensors", struct.pack("<Q", 1 << 62) + b"{}")
put("safetensors", "bad_shape.safetensors", safetensors([], raw_header=b'{"a":{"dtype":"F32","shape":[-1, 4],"data_offsets":[0,16]}}') + floats(4))

# ---- HF config.json
llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 2048,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}
put("hf_config", "llama.json", json.dumps(llama, indent=2))
put("hf_config", "minimal.json", json.dumps({k: llama[k] for k in ["hidden_size", "intermediate_size", "num_hidden_layers",
                                                                   "num_attention_heads", "vocab_size"]}))
put("hf_config", "bad_heads.json", json.dumps(dict(llama, num_key_value_heads=3)))
put("hf_config", "bad_types.json", json.dumps(dict(llama, hidden_size="64", tie_word_embeddings=1)))
put("hf_config", "bad_range.json", json.dumps(dict(llama, hidden_size=2**40, rms_norm_eps=1e300)))
put("hf_config", "bad_syntax.json", '{"hidden_size": 64,')

# ---- ds_config.json
with open(os.path.join(root, "..", "..", "tests", "io", "config", "ds_config_zero3.json"), "rb") as f:
    put("ds_config", "zero3.json", f.read())
put("ds_config", "micro_auto.json", json.dumps({
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": 10,
                                                      "total_num_steps": "auto", "warmup_type": "linear"}}}))
put("ds_config", "cosine.json", json.dumps({
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10, "gradient_clipping": "auto",
    "fp16": {"enabled": "auto", "loss_scale": 0, "hysteresis": 2, "min_loss_scale": 1},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 5}},
    "zero_optimization": {"stage": 1}}))
put("ds_config", "warmup_lr.json", json.dumps({
    "train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_type": "log"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}))
put("ds_config", "bad_unknown_key.json", json.dumps({"train_batch_size": 8, "zero_optimisation": {"stage": 3}}))
put("ds_config", "bad_type.json", json.dumps({"train_batch_size": "8", "fp16": {"enabled": 1}}))
put("ds_config", "bad_batch.json", json.dumps({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}))
put("ds_config", "bad_deep.json", "[" * 100 + "]" * 100)

# ---- token shards (loom header, or headerless uint16 / uint32)
def shard(tokens, width, vocab=0, n=None, reserved=b"\0" * 36):
    fmt = "<%d%s" % (len(tokens), "H" if width == 2 else "I")
    hdr = b"LOOMTOK1" + struct.pack("<IIQI", 64, width, len(tokens) if n is None else n, vocab) + reserved
    return hdr + struct.pack(fmt, *tokens)
toks = [1, 5, 17, 300, 2, 0, 65535 % 400, 399]
put("token_shard", "u16.bin", shard(toks, 2, 400))
put("token_shard", "u32.bin", shard(toks + [70000], 4))
put("token_shard", "headerless_u16.bin", struct.pack("<8H", *toks))
put("token_shard", "headerless_u32.bin", struct.pack("<8I", *toks))
put("token_shard", "bad_count.bin", shard(toks, 2, 400, n=9))
put("token_shard", "bad_reserved.bin", shard(toks, 2, 400, reserved=b"\1" + b"\0" * 35))
put("token_shard", "bad_vocab.bin", shard(toks, 4, 10))
put("token_shard", "bad_short_header.bin", b"LOOMTOK1" + b"\0" * 20)
put("token_shard", "bad_odd.bin", b"\1\2\3")

# ---- chat JSONL
with open(os.path.join(root, "..", "..", "tests", "data", "chat_sample.jsonl"), "rb") as f:
    put("chat_jsonl", "sample.jsonl", f.read())
put("chat_jsonl", "one.jsonl", json.dumps({"prompt": "Hi", "response": "Hello!"}) + "\n")
put("chat_jsonl", "history.jsonl", json.dumps({"prompt": "and 3?", "response": "9", "history": [["2?", "4"], ["4?", "16"]]},
                                               ensure_ascii=False) + "\n\n" + json.dumps({"prompt": "x", "response": "y", "history": None}) + "\r\n")
put("chat_jsonl", "bad_missing.jsonl", json.dumps({"prompt": "Hi"}) + "\n")
put("chat_jsonl", "bad_history.jsonl", json.dumps({"prompt": "a", "response": "b", "history": [["only one"]]}) + "\n")
put("chat_jsonl", "bad_type.jsonl", json.dumps({"prompt": 1, "response": ["b"]}) + "\n")
put("chat_jsonl", "bad_syntax.jsonl", '{"prompt": "a", "response": "b"\n')
put("chat_jsonl", "bad_empty.jsonl", "\n \t\r\n")
# ---- llama-serve request bodies: the target reads the route from the input's size mod 3 (0 api.py's
# POST /, 1 /v1/completions, 2 /v1/chat/completions) and tight limits from (size / 3) odd, so each
# seed is padded with JSON whitespace to the size that picks its route
def request(name, body, route, tight=False):
    b = (body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)).encode()
    while len(b) % 3 != route or (len(b) // 3) % 2 != int(tight):
        b += b" "
    put("serve_request", name, b)
request("chatglm.json", {"prompt": "你好", "history": [["1+1?", "2"], ["hi", "hello"]], "max_length": 200,
                         "top_p": 0.7, "temperature": 0.95}, 0)
request("chatglm_null_history.json", {"prompt": "x", "history": None, "max_length": 60}, 0, tight=True)
request("completion.json", {"model": "loom-llama", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8,
                            "top_p": 0.9, "top_k": 40, "seed": 18446744073709551615, "stream": True}, 1)
request("completion_list.json", {"prompt": ["hello"], "n": 1, "stop": None, "ignore_eos": True,
                                 "repetition_penalty": 1.1, "max_tokens": None}, 1, tight=True)
request("chat.json", {"model": "x", "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": False}, 2)
request("chat_tight.json", {"messages": [{"role": "user", "content": "a" * 10}], "max_tokens": 20, "seed": 7}, 2, tight=True)
request("bad_history.json", {"prompt": "x", "history": [["only one"]]}, 0)
request("bad_max_length.json", {"prompt": "long prompt", "max_length": 3}, 0)
request("bad_wrap.json", {"prompt": "x", "max_tokens": 4294967301, "top_k": 4294967301}, 1)
request("bad_range.json", {"prompt": "x", "temperature": 1e300, "top_p": 0, "n": 2}, 1)
request("bad_stream.json", {"prompt": "x", "stream": "yes", "stop": ["\n"]}, 1)
request("bad_messages.json", {"messages": [{"role": "user"}]}, 2)
request("bad_empty_messages.json", {"messages": []}, 2)
request("bad_not_object.json", "[1, 2, 3]", 2)
request("bad_syntax.json", '{"prompt": "x", "max_tokens": 1e400', 1)
request("bad_context.json", {"prompt": "b" * 120}, 1, tight=True)
request("bad_pool.json", {"messages": [{"role": "user", "content": "c" * 50}], "max_tokens": 40}, 2, tight=True)

# ---- sharded-checkpoint manifests (fuzz/checkpoint_manifest.cpp writes the two rank files: pieces of
# "a" [2, 3] and "b" [4]; "c" has none)
ckpt = {"format": "loom-sharded-checkpoint-1", "step": 10, "files": 2, "mesh": {"dp": 2, "tp": 1, "pp": 1},
        "zero_stage": 3, "tensors": {"a": [2, 3], "b": [4]},
        "loss_scaler": {"kind": "dynamic", "scale": 65536.0, "iteration": 10, "last_overflow_iteration": -1,
                        "hysteresis_left": 2, "skipped_steps": 0}}
put("checkpoint_manifest", "two_ranks.json", json.dumps(ckpt, indent=1))
put("checkpoint_manifest", "static_scale.json", json.dumps(dict(ckpt, loss_scaler={"kind": "static", "scale": 1.0})))
put("checkpoint_manifest", "bad_no_piece.json", json.dumps(dict(ckpt, tensors={"a": [2, 3], "b": [4], "c": [1]})))
put("checkpoint_manifest", "bad_shape.json", json.dumps(dict(ckpt, tensors={"a": [3, 3], "b": [0]})))
put("checkpoint_manifest", "bad_huge_shape.json", json.dumps(dict(ckpt, tensors={"a": [4294967296, 4294967296], "b": [4]})))
put("checkpoint_manifest", "bad_big_shape.json", json.dumps(dict(ckpt, tensors={"a": [2, 3], "b": [1 << 40]})))
put("checkpoint_manifest", "bad_files.json", json.dumps(dict(ckpt, files=3)))
put("checkpoint_manifest", "bad_step.json", json.dumps(dict(ckpt, step=-1, files=1e300)))
put("checkpoint_manifest", "bad_format.json", json.dumps(dict(ckpt, format="loom-sharded-checkpoint-2")))
put("checkpoint_manifest", "bad_format_type.json", '{"format": {"dp": 2, "ts_left": 2, "skipped_steps": 0}}')  # a finding
put("checkpoint_manifest", "bad_scaler.json", json.dumps(dict(ckpt, loss_scaler={"kind": 7, "scale": 0, "hysteresis_left": 0})))
put("checkpoint_manifest", "bad_deep.json", '{"format": "loom-sharded-checkpoint-1", "tensors": ' + "[" * 100 + "]" * 100 + "}")

# ---- libFuzzer dictionaries (fuzz/dict/<target>.dict): JSON syntax and the key names each
# reader looks for, taken from the reader's source so a new key reaches the fuzzer
import re
json_tokens = ["{", "}", "[", "]", ":", ",", '""', "true", "false", "null", "\\\\u0000", "1e308", "-1", "0.5", "\\\"auto\\\""]
def dictionary(target, header, extra=()):  # header: under include/loom/, or under examples/
    top = os.path.join(root, "..", "..")
    with open(os.path.join(top, header) if header.startswith("examples/") else os.path.join(top, "include", "loom", header)) as f:
        keys = sorted(set(re.findall(r'"([A-Za-z][A-Za-z0-9_]*)"', f.read())) | set(extra))
    d = os.path.join(root, "..", "dict")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, target + ".dict"), "w") as f:
        for t in json_tokens:
            f.write('"%s"\n' % t.replace('"', '\\"') if '\\' not in t else '"%s"\n' % t)
        for k in keys:
            f.write('"\\"%s\\""\n' % k)
dictionary("ds_config", "io/ds_config.hpp")
dictionary("hf_config", "io/safetensors.hpp")
dictionary("safetensors", "io/safetensors.hpp", ["__metadata__", "data_offsets"])
dictionary("chat_jsonl", "data/chat_jsonl.hpp", ["prompt", "response", "history"])
dictionary("serve_request", "examples/llama/serve/request.hpp", ["user", "assistant", "system", "model"])
dictionary("checkpoint_manifest", "checkpoint/sharded.hpp", ["a", "b", "c", "dp", "tp", "pp", "dynamic", "static",
                                                                            "loom-sharded-checkpoint-1"])
print("wrote", sum(len(fs) for _, _, fs in os.walk(root)), "seed files under", os.path.normpath(root), file=sys.stderr)
