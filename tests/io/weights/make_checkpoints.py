#!/usr/bin/python3
"""Independent writer and oracle for loom's weight readers and the LLaMA engine.

Writes, into the directory given as argv[1], from seeded numpy weights:
  a_legacy.bin, a_v1.bin      llama2.c legacy / version-1 checkpoints of model A (own classifier)
  b_legacy.bin, b_v1.bin      the same for model B (classifier shared with the embedding)
  hf/model.safetensors        model A in HF naming (q/k rows permuted for half-split RoPE), F32
  hf/config.json
  hf_bf16/model-0000{1,2}-of-00002.safetensors + config.json   model A as BF16 in two shards
  tokenizer.bin               a small llama2.c BPE vocabulary
  expected.json               per-tensor checksums, PyTorch greedy tokens and last-position
                              logits of model A and B, and tokenizer encodings
The forward pass is a plain PyTorch LLaMA (Meta/llama2.c style: complex RoPE on adjacent
pairs), written here, not taken from loom.
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "support"))
from safetensors_io import write_safetensors  # noqa: E402

out = sys.argv[1]
os.makedirs(os.path.join(out, "hf"), exist_ok=True)
os.makedirs(os.path.join(out, "hf_bf16"), exist_ok=True)

DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ = 32, 64, 2, 4, 2, 300, 64
HD = DIM // HEADS
KVD = KV_HEADS * HD
EPS = 1e-5


def make_model(seed, shared):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    m = {"tok_embeddings.weight": f(VOCAB, DIM)}
    for l in range(LAYERS):
        p = f"layers.{l}."
        m[p + "attention_norm.weight"] = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
        m[p + "attention.wq.weight"] = f(DIM, DIM, sc=DIM ** -0.5)
        m[p + "attention.wk.weight"] = f(KVD, DIM, sc=DIM ** -0.5)
        m[p + "attention.wv.weight"] = f(KVD, DIM, sc=DIM ** -0.5)
        m[p + "attention.wo.weight"] = f(DIM, DIM, sc=DIM ** -0.5)
        m[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
        m[p + "feed_forward.w1.weight"] = f(HIDDEN, DIM, sc=DIM ** -0.5)
        m[p + "feed_forward.w2.weight"] = f(DIM, HIDDEN, sc=HIDDEN ** -0.5)
        m[p + "feed_forward.w3.weight"] = f(HIDDEN, DIM, sc=DIM ** -0.5)
    m["norm.weight"] = (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32)
    if not shared:
        m["output.weight"] = f(VOCAB, DIM, sc=DIM ** -0.5)
    return m


def layer_list(m, kind):
    return [m[f"layers.{l}.{kind}"] for l in range(LAYERS)]


def write_legacy(path, m):
    shared = "output.weight" not in m
    with open(path, "wb") as fh:
        fh.write(struct.pack("7i", DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB if shared else -VOCAB, SEQ))
        ws = [m["tok_embeddings.weight"]]
        for kind in ["attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                     "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight"]:
            ws += layer_list(m, kind)
        ws.append(m["norm.weight"])
        freqs = 1.0 / (10000.0 ** (np.arange(0, HD, 2)[: HD // 2] / HD))
        ang = np.outer(np.arange(SEQ), freqs)
        ws += [np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)]
        if not shared:
            ws.append(m["output.weight"])
        for w in ws:
            fh.write(np.ascontiguousarray(w, dtype="<f4").tobytes())


def write_v1(path, m):
    shared = "output.weight" not in m
    with open(path, "wb") as fh:
        fh.write(struct.pack("I", 0x616B3432))
        fh.write(struct.pack("i", 1))
        fh.write(struct.pack("7i", DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ))
        fh.write(struct.pack("B", int(shared)))
        fh.write(b"\0" * (256 - fh.tell()))
        ws = layer_list(m, "attention_norm.weight") + layer_list(m, "ffn_norm.weight")
        ws += [m["norm.weight"], m["tok_embeddings.weight"]]
        for kind in ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                     "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"]:
            ws += layer_list(m, kind)
        if not shared:
            ws.append(m["output.weight"])
        for w in ws:
            fh.write(np.ascontiguousarray(w, dtype="<f4").tobytes())


def permute(w, heads):  # Meta adjacent-pair rows -> HF half-split rows
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_names(m):
    h = {"model.embed_tokens.weight": m["tok_embeddings.weight"], "model.norm.weight": m["norm.weight"]}
    for l in range(LAYERS):
        a, b = f"layers.{l}.", f"model.layers.{l}."
        h[b + "input_layernorm.weight"] = m[a + "attention_norm.weight"]
        h[b + "self_attn.q_proj.weight"] = permute(m[a + "attention.wq.weight"], HEADS)
        h[b + "self_attn.k_proj.weight"] = permute(m[a + "attention.wk.weight"], KV_HEADS)
        h[b + "self_attn.v_proj.weight"] = m[a + "attention.wv.weight"]
        h[b + "self_attn.o_proj.weight"] = m[a + "attention.wo.weight"]
        h[b + "post_attention_layernorm.weight"] = m[a + "ffn_norm.weight"]
        h[b + "mlp.gate_proj.weight"] = m[a + "feed_forward.w1.weight"]
        h[b + "mlp.down_proj.weight"] = m[a + "feed_forward.w2.weight"]
        h[b + "mlp.up_proj.weight"] = m[a + "feed_forward.w3.weight"]
    if "output.weight" in m:
        h["lm_head.weight"] = m["output.weight"]
    return h


def hf_config(shared):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": DIM, "intermediate_size": HIDDEN,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "vocab_size": VOCAB, "max_position_embeddings": SEQ, "rms_norm_eps": EPS, "rope_theta": 10000.0,
            "tie_word_embeddings": shared, "torch_dtype": "float32"}


def forward_logits(m, tokens):
    """Plain PyTorch LLaMA over the whole sequence; returns [len, vocab] logits (float64)."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in m.items()}
    n = len(tokens)
    x = t["tok_embeddings.weight"][torch.tensor(tokens)]
    freqs = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.outer(torch.arange(n, dtype=torch.float64), freqs)
    cis = torch.polar(torch.ones_like(ang), ang)  # [n, HD/2]

    def rms(v, g):
        return v * torch.rsqrt((v * v).mean(-1, keepdim=True) + EPS) * g

    def rope(v, heads):
        c = torch.view_as_complex(v.reshape(n, heads, HD // 2, 2).contiguous())
        return torch.view_as_real(c * cis[:, None, :]).reshape(n, heads, HD)

    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    for l in range(LAYERS):
        p = f"layers.{l}."
        h = rms(x, t[p + "attention_norm.weight"])
        q = rope(h @ t[p + "attention.wq.weight"].T, HEADS)
        k = rope(h @ t[p + "attention.wk.weight"].T, KV_HEADS)
        v = (h @ t[p + "attention.wv.weight"].T).reshape(n, KV_HEADS, HD)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / HD ** 0.5 + mask
        a = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(n, DIM)
        x = x + a @ t[p + "attention.wo.weight"].T
        h = rms(x, t[p + "ffn_norm.weight"])
        g = h @ t[p + "feed_forward.w1.weight"].T
        x = x + ((g * torch.sigmoid(g)) * (h @ t[p + "feed_forward.w3.weight"].T)) @ t[p + "feed_forward.w2.weight"].T
    x = rms(x, t["norm.weight"])
    return x @ t.get("output.weight", t["tok_embeddings.weight"]).T


def greedy(m, prompt, steps):
    toks = list(prompt)
    for _ in range(steps):
        toks.append(int(torch.argmax(forward_logits(m, toks)[-1])))
    return toks[len(prompt):]


# ---- tokenizer: byte tokens + a few pieces; scores decide merge order
pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
extra = [(" ", -1.0), ("h", -2.0), ("e", -2.0), ("l", -2.0), ("o", -2.0), ("w", -2.0), ("r", -2.0), ("d", -2.0),
         ("he", -3.0), ("ll", -2.5), ("llo", -4.0), ("hello", -5.0), (" hello", -6.0), (" w", -3.5), ("or", -3.2),
         (" wor", -7.0), ("é", -2.0)]
scores = [0.0] * len(pieces) + [s for _, s in extra]
pieces += [p for p, _ in extra]
with open(os.path.join(out, "tokenizer.bin"), "wb") as fh:
    enc = [p.encode() for p in pieces]
    fh.write(struct.pack("i", max(len(e) for e in enc)))
    for e, s in zip(enc, scores):
        fh.write(struct.pack("fi", s, len(e)))
        fh.write(e)


def bpe(text):
    ids = {p: i for i, p in enumerate(pieces)}
    toks = [ids[" "]] if text else []
    for ch in text:
        if ch in ids:
            toks.append(ids[ch])
        else:
            toks += [b + 3 for b in ch.encode()]
    while True:
        best = None
        for i in range(len(toks) - 1):
            s = pieces[toks[i]] + pieces[toks[i + 1]]
            if s in ids and (best is None or scores[ids[s]] > best[0]):
                best = (scores[ids[s]], i, ids[s])
        if best is None:
            return [1] + toks
        toks[best[1]:best[1] + 2] = [best[2]]


A, B = make_model(1, shared=False), make_model(2, shared=True)
write_legacy(os.path.join(out, "a_legacy.bin"), A)
write_v1(os.path.join(out, "a_v1.bin"), A)
write_legacy(os.path.join(out, "b_legacy.bin"), B)
write_v1(os.path.join(out, "b_v1.bin"), B)
HA = hf_names(A)
write_safetensors(os.path.join(out, "hf", "model.safetensors"), HA, "F32")
json.dump(hf_config(False), open(os.path.join(out, "hf", "config.json"), "w"))
names = list(HA)
write_safetensors(os.path.join(out, "hf_bf16", "model-00001-of-00002.safetensors"),
                  {k: HA[k] for k in names[: len(names) // 2]}, "BF16")
write_safetensors(os.path.join(out, "hf_bf16", "model-00002-of-00002.safetensors"),
                  {k: HA[k] for k in names[len(names) // 2:]}, "BF16")
json.dump(hf_config(False), open(os.path.join(out, "hf_bf16", "config.json"), "w"))

prompt = [1, 17, 250, 3, 99, 42, 7]
exp = {"prompt": prompt, "steps": 12, "dims": [DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ]}
for tag, m in (("a", A), ("b", B)):
    exp[tag] = {
        "greedy": greedy(m, prompt, 12),
        "last_logits": forward_logits(m, prompt)[-1].tolist(),
        "checksums": {k: [float(np.sum(v, dtype=np.float64)), float(v.reshape(-1)[0]), float(v.reshape(-1)[-1])]
                      for k, v in m.items()},
    }
texts = ["hello world", "hello", "héllo wörld", "", "ww  or"]
exp["tokenizer"] = [{"text": s, "ids": bpe(s)} for s in texts]
json.dump(exp, open(os.path.join(out, "expected.json"), "w"))
