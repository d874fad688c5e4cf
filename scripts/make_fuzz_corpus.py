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

# ---- HF ChatGLM2/3 config.json (hf_config also runs the loader's family and ChatGLM reader)
glm = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96,
       "num_attention_heads": 4, "multi_query_attention": True, "multi_query_group_num": 2, "kv_channels": 16,
       "padded_vocab_size": 300, "seq_length": 128, "layernorm_epsilon": 1e-5, "rmsnorm": True, "post_layer_norm": True,
       "add_bias_linear": False, "add_qkv_bias": True, "apply_residual_connection_post_layernorm": False,
       "original_rope": True, "rope_ratio": 1, "tie_word_embeddings": False, "torch_dtype": "float16"}
put("hf_config", "chatglm3.json", json.dumps(glm, indent=2))
put("hf_config", "chatglm2_arch_only.json", json.dumps({k: v for k, v in glm.items() if k not in ("model_type", "multi_query_attention",
                                                                                                   "seq_length", "rope_ratio")}))
put("hf_config", "bad_chatglm_v1.json", json.dumps(dict(glm, position_encoding_2d=True, inner_hidden_size=96)))
put("hf_config", "bad_chatglm_kv.json", json.dumps(dict(glm, kv_channels=8, multi_query_group_num=3)))
put("hf_config", "bad_chatglm_bias.json", json.dumps(dict(glm, add_bias_linear=True, rmsnorm="yes")))
put("hf_config", "bad_chatglm_head.json", json.dumps(dict(glm, hidden_size=24, kv_channels=6, num_attention_heads=4)))
put("hf_config", "bad_model_type.json", json.dumps(dict(glm, model_type="gpt2")))

# ---- model.safetensors.index.json (fuzz/hf_index.cpp writes the folder: shard 1 holds "a" and "b",
# shard 2 holds "c"; config.json and sub/ are not shards)
s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
def index(weight_map, **extra):
    return json.dumps(dict({"metadata": {"total_size": 44}, "weight_map": weight_map}, **extra), indent=2)
put("hf_index", "two_shards.json", index({"a": s1, "b": s1, "c": s2}))
put("hf_index", "one_shard.json", index({"b": s1}))
put("hf_index", "bad_traversal.json", index({"a": "../" + s1, "c": "/etc/passwd"}))
put("hf_index", "bad_missing.json", index({"a": s1, "d": "model-00003-of-00003.safetensors"}))
put("hf_index", "bad_wrong_shard.json", index({"a": s2, "c": s2}))
put("hf_index", "bad_not_shard.json", index({"a": "config.json", "c": s2}))
put("hf_index", "bad_folder.json", index({"a": s1, "b": "sub"}))
put("hf_index", "bad_dot.json", index({"a": ".."}))
put("hf_index", "bad_no_map.json", json.dumps({"metadata": {}, "weight_map": [s1]}))
put("hf_index", "bad_type.json", index({"a": 7, "b": None}))
put("hf_index", "bad_deep.json", '{"weight_map": ' + "[" * 100 + "]" * 100 + "}")

# ---- chat templates: 4 bytes of settings (fuzz/chat_template.cpp: [0] template 0-3 | 4 system |
# 8 tokenizer with ChatGLM3's specials, [1] max_source_length, [2] max_target_length, [3] 1: no
# history column), then chat JSONL
def chat(name, kind, src, tgt, lines, system=False, specials=False, no_history=False):
    head = bytes([kind | (4 if system else 0) | (8 if specials else 0), src, tgt, 1 if no_history else 0])
    put("chat_template", name, head + "".join(json.dumps(l, ensure_ascii=False) + "\n" for l in lines).encode())
turns = [{"prompt": "and 3?", "response": "9", "history": [["2?", "4"], ["4?", "16"]]},
         {"prompt": "你好", "response": "你好！有什么可以帮你？", "history": None}]
chat("chatglm2.jsonl", 0, 64, 64, turns)
chat("chatglm2_specials_cut.jsonl", 0, 16, 4, turns, specials=True)
chat("chatglm3_system.jsonl", 1, 96, 32, turns, system=True, specials=True)
chat("llama2_system.jsonl", 2, 128, 16, [{"prompt": "  q \n", "response": " r\t", "history": [[" a ", " b "]]}], system=True)
chat("llama2_tight.jsonl", 2, 1, 1, turns, no_history=True)
chat("bad_chatglm3_bytes.jsonl", 1, 32, 32, turns)
chat("bad_chatglm2_system.jsonl", 0, 32, 32, turns, system=True)
chat("bad_template_name.jsonl", 3, 32, 32, turns)
chat("bad_zero_length.jsonl", 2, 0, 8, turns)
chat("bad_records.jsonl", 0, 8, 8, [{"prompt": "x"}, {"prompt": "a", "response": "b", "history": [["only one"]]}, [1]])

# ---- SentencePiece tokenizer.model files: small models of each kind from spm_train (skipped
# where it is missing), and broken ones edited from them at the protobuf level
import shutil
import subprocess
import tempfile
def pb_varint(b, i):
    v = s_ = 0
    while True:
        c = b[i]; i += 1
        v |= (c & 0x7F) << s_; s_ += 7
        if c < 0x80:
            return v, i
def pb_put_varint(v):
    out = b""
    while True:
        c = v & 0x7F; v >>= 7
        if v:
            out += bytes([c | 0x80])
        else:
            return out + bytes([c])
def pb_fields(b):  # [(field, wire type, value)]: value is an int (varint) or bytes
    out, i = [], 0
    while i < len(b):
        key, i = pb_varint(b, i)
        f, w = key >> 3, key & 7
        if w == 0:
            v, i = pb_varint(b, i)
        elif w == 2:
            n, i = pb_varint(b, i); v = b[i:i + n]; i += n
        elif w == 5:
            v = b[i:i + 4]; i += 4
        elif w == 1:
            v = b[i:i + 8]; i += 8
        else:
            raise ValueError("wire type %d" % w)
        out.append((f, w, v))
    return out
def pb_join(fields):
    out = b""
    for f, w, v in fields:
        out += pb_put_varint(f << 3 | w)
        if w == 0:
            out += pb_put_varint(v)
        elif w == 2:
            out += pb_put_varint(len(v)) + v
        else:
            out += v
    return out
def sp_edit(model, edit):  # edit(pieces: [[piece bytes, score bytes, type]]) on ModelProto field 1
    top = pb_fields(model)
    pieces = []
    for f, w, v in top:
        if f == 1:
            d = {pf: pv for pf, _, pv in pb_fields(v)}
            pieces.append([d.get(1, b""), d.get(2, struct.pack("<f", 0.0)), d.get(3, 1)])
    edit(pieces)
    enc = [(1, 2, pb_join([(1, 2, p), (2, 5, sc), (3, 0, t)])) for p, sc, t in pieces]
    return pb_join(enc + [x for x in top if x[0] != 1])
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
spm = shutil.which("spm_train")
if spm:
    tmp = tempfile.mkdtemp()
    words = "the quick brown fox jumps over lazy dog hello world sop eop 你好 世界 模型 2024".split()
    r = __import__("random").Random(1)
    with open(os.path.join(tmp, "c.txt"), "w") as f:
        for _ in range(300):
            f.write(" ".join(r.choice(words) for _ in range(8)) + "\n")
    with open(os.path.join(tmp, "rule.tsv"), "w") as f:
        f.write("FF21\t41\nFF41\t61\n3000\t20\n")  # fullwidth A, a and space: a small normalizer charsmap
    def train(name, *args):  # relative paths: the model records its trainer's arguments
        subprocess.run([spm, "--input=c.txt", "--model_prefix=" + name, "--num_threads=1", "--character_coverage=1.0",
                        "--minloglevel=2", *args], check=True, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(os.path.join(tmp, name + ".model"), "rb") as f:
            return f.read()
    uni = train("uni", "--vocab_size=40", "--model_type=unigram", "--normalization_rule_name=identity")
    bpe = train("bpe", "--vocab_size=300", "--model_type=bpe", "--byte_fallback=true", "--split_digits=true",
                "--normalization_rule_name=identity", "--remove_extra_whitespaces=false")
    char = train("char", "--vocab_size=30", "--model_type=char", "--normalization_rule_name=identity",
                 "--user_defined_symbols=sop,eop", "--pad_id=3")
    norm = train("norm", "--vocab_size=40", "--model_type=unigram", "--normalization_rule_tsv=rule.tsv")
    nobos = train("nobos", "--vocab_size=17", "--model_type=word", "--normalization_rule_name=identity", "--bos_id=-1")
    shutil.rmtree(tmp)
    put("sentencepiece_model", "unigram.model", uni)
    put("sentencepiece_model", "bpe_bytes.model", bpe)
    put("sentencepiece_model", "char_user_defined.model", char)
    put("sentencepiece_model", "unigram_charsmap.model", norm)
    def control_sop(p):  # "sop" a control piece of the model as well as an appended special
        p[5][0], p[5][2] = b"sop", CONTROL
    put("sentencepiece_model", "control_sop.model", sp_edit(uni, control_sop))
    def unused(p):
        p[6][2] = UNUSED
    put("sentencepiece_model", "unused_piece.model", sp_edit(char, unused))
    put("sentencepiece_model", "bad_no_bos.model", nobos)
    put("sentencepiece_model", "bad_truncated.model", uni[:len(uni) // 2])
    put("sentencepiece_model", "bad_empty.model", b"")
    put("sentencepiece_model", "bad_text.model", "<unk>\t0\n<s>\t0\n</s>\t0\n")
    def byte_without_fallback(p):
        p[10][2] = BYTE
    put("sentencepiece_model", "bad_byte_type.model", sp_edit(uni, byte_without_fallback))
    def bad_byte_name(p):  # a byte piece whose name is no <0xXX>
        p[3][0] = b"<0xZ>"
    put("sentencepiece_model", "bad_byte_name.model", sp_edit(bpe, bad_byte_name))
    def duplicate(p):
        p[8][0] = p[9][0]
    put("sentencepiece_model", "bad_duplicate.model", sp_edit(uni, duplicate))
    def nul_piece(p):  # a finding: Load() threw Darts' exception (its trie reads pieces as C strings: an empty key)
        p[7][0] = b"\0o"
    put("sentencepiece_model", "bad_nul_piece.model", sp_edit(uni, nul_piece))
    def charsmap_past(model):  # a finding: the root's children block past the trie (SEGV in Normalizer::NormalizePrefix)
        top = pb_fields(model)
        def edit(spec):
            return pb_join([(f, w, v[:4] + struct.pack("<I", 4096 << 10) + v[8:] if f == 2 else v) for f, w, v in pb_fields(spec)])
        return pb_join([(f, w, edit(v) if f == 3 else v) for f, w, v in top])
    put("sentencepiece_model", "bad_charsmap_root.model", charsmap_past(norm))
    # bad_charsmap_finding.model is the fuzzer's own input (a few bytes inserted in norm's charsmap),
    # committed as found: it crashed the unchecked load, where this edit only reads garbage
    def unknown_type(p):  # protobuf-lite keeps an unknown enum value aside: the piece stays NORMAL
        p[12][2] = 99
    put("sentencepiece_model", "unknown_piece_type.model", sp_edit(uni, unknown_type))
else:
    print("spm_train not found (apt-get install sentencepiece): the sentencepiece_model seeds are not rewritten", file=sys.stderr)

# ---- libFuzzer dictionaries (fuzz/dict/<target>.dict): JSON syntax and the key names each
# reader looks for, taken from the reader's source so a new key reaches the fuzzer
import re
json_tokens = ["{", "}", "[", "]", ":", ",", '""', "true", "false", "null", "\\\\u0000", "1e308", "-1", "0.5", "\\\"auto\\\""]
def dictionary(target, headers, extra=()):  # headers: one or a list, under include/loom/ or examples/
    top = os.path.join(root, "..", "..")
    keys = set(extra)
    for header in [headers] if isinstance(headers, str) else headers:
        with open(os.path.join(top, header) if header.startswith("examples/") else os.path.join(top, "include", "loom", header)) as f:
            keys |= set(re.findall(r'"([A-Za-z][A-Za-z0-9_]*)"', f.read()))
    keys = sorted(keys)
    d = os.path.join(root, "..", "dict")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, target + ".dict"), "w") as f:
        for t in json_tokens:
            f.write('"%s"\n' % t.replace('"', '\\"') if '\\' not in t else '"%s"\n' % t)
        for k in keys:
            f.write('"\\"%s\\""\n' % k)
dictionary("ds_config", "io/ds_config.hpp")
dictionary("hf_config", ["io/safetensors.hpp", "examples/llama/generate/llama_loader.hpp"], ["ChatGLMModel", "LlamaForCausalLM"])
dictionary("hf_index", "examples/llama/generate/llama_loader.hpp", ["weight_map", "metadata", "total_size", "a", "b", "c", s1, s2,
                                                                      "config.json", "sub", "..", "../", "/"])
dictionary("safetensors", "io/safetensors.hpp", ["__metadata__", "data_offsets"])
dictionary("chat_jsonl", "data/chat_jsonl.hpp", ["prompt", "response", "history"])
dictionary("chat_template", "data/chat_jsonl.hpp", ["prompt", "response", "history"])
dictionary("serve_request", "include/loom/serve/request.hpp", ["user", "assistant", "system", "model"])
dictionary("checkpoint_manifest", "checkpoint/sharded.hpp", ["a", "b", "c", "dp", "tp", "pp", "dynamic", "static",
                                                                            "loom-sharded-checkpoint-1"])
print("wrote", sum(len(fs) for _, _, fs in os.walk(root)), "seed files under", os.path.normpath(root), file=sys.stderr)
