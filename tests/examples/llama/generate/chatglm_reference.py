#!/usr/bin/python3
"""An independent ChatGLM2/3 for loom's parity test: a PyTorch transcription of ChatGLM's
modeling semantics written from the architecture facts (docs: /work/shared/reference/chatglm.md
is what it follows), not from loom and not from THUDM's code.

  chatglm_reference.py make DIR
      writes a small random ChatGLM3-shaped model as HF folders
        DIR/hf/        F32, two shards + model.safetensors.index.json, config.json
        DIR/hf_bf16/   the same weights as BF16, one file, config.json
      and, computed in float64 from the F32 weights,
        DIR/ref.safetensors   logits [batch*seq, vocab] and grad/<HF name> for every tensor
        DIR/expected.json     tokens, targets, loss, a prompt and its greedy continuation
  chatglm_reference.py check DIR OUT
      reads the HF folder OUT (written by loom) and exits 0 when its tensors equal DIR/hf's bit
      for bit, its config.json describes the same model, and the logits it gives equal
      ref.safetensors' logits (they are the same weights).

Model: RMSNorm (fp32 statistics), fused query_key_value with bias split as [Q | K | V],
multi-query groups (query head h reads group h // (heads / groups)), rotary on the first half
of each head's dimension in interleaved pairs (base 10000 * rope_ratio), causal softmax
attention scaled by 1/sqrt(head_dim), SwiGLU over dense_h_to_4h's [gate | up], untied
output_layer, padded_vocab_size rows.
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "support"))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ_LENGTH = 2, 256, 8, 2, 512, 1000, 64
HD = HIDDEN // HEADS
EPS = 1e-5
ROPE_RATIO = 1.5
BATCH, SEQ = 2, 16


def config_json():
    return {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": LAYERS, "hidden_size": HIDDEN,
            "ffn_hidden_size": FFN, "num_attention_heads": HEADS, "kv_channels": HD, "multi_query_attention": True,
            "multi_query_group_num": GROUPS, "padded_vocab_size": VOCAB, "seq_length": SEQ_LENGTH,
            "layernorm_epsilon": EPS, "rmsnorm": True, "post_layer_norm": True, "add_bias_linear": False,
            "add_qkv_bias": True, "apply_residual_connection_post_layernorm": False,
            "apply_query_key_layer_scaling": True, "original_rope": True, "rope_ratio": ROPE_RATIO,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def make_weights(seed):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: (rng.standard_normal(s) * sc).astype(np.float32)
    qkv_rows = HEADS * HD + 2 * GROUPS * HD
    w = {"transformer.embedding.word_embeddings.weight": f(VOCAB, HIDDEN)}
    for l in range(LAYERS):
        p = f"transformer.encoder.layers.{l}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "self_attention.query_key_value.weight"] = f(qkv_rows, HIDDEN, sc=HIDDEN ** -0.5)
        w[p + "self_attention.query_key_value.bias"] = f(qkv_rows, sc=0.1)
        w[p + "self_attention.dense.weight"] = f(HIDDEN, HEADS * HD, sc=HIDDEN ** -0.5)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        w[p + "mlp.dense_h_to_4h.weight"] = f(2 * FFN, HIDDEN, sc=HIDDEN ** -0.5)
        w[p + "mlp.dense_4h_to_h.weight"] = f(HIDDEN, FFN, sc=FFN ** -0.5)
    w["transformer.encoder.final_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    w["transformer.output_layer.weight"] = f(VOCAB, HIDDEN, sc=HIDDEN ** -0.5)
    return w


def read_folder(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(read_safetensors(os.path.join(d, f)))
    return out


# ---- the model ----------------------------------------------------------------------------
def rms_norm(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotary(x, positions):
    """x [seq, heads, HD]: the first n_elem = HD/2 channels rotate in pairs (2i, 2i+1) by
    position * base^(-2i / n_elem), i < n_elem/2; the rest pass through."""
    n_elem = HD // 2
    base = 10000.0 * ROPE_RATIO
    theta = 1.0 / base ** (torch.arange(0, n_elem, 2, dtype=torch.float64) / n_elem)
    ang = positions.to(torch.float64)[:, None] * theta[None, :]  # [seq, n_elem/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    rot, rest = x[..., :n_elem], x[..., n_elem:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    y0, y1 = x0 * cos - x1 * sin, x1 * cos + x0 * sin
    return torch.cat([torch.stack([y0, y1], dim=-1).flatten(-2), rest], dim=-1)


def forward(w, tokens, lin=None):
    """tokens [batch, seq] -> logits [batch, seq, vocab], float64. lin(name, h): the projection
    by weight `name` (default h @ w[name].T; a LoRA oracle wraps it; the bias is added after)."""
    lin = lin or (lambda name, h: h @ w[name].T)
    b, s = tokens.shape
    pos = torch.arange(s)
    x = w["transformer.embedding.word_embeddings.weight"][tokens]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    for l in range(LAYERS):
        p = f"transformer.encoder.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"])
        qkv = lin(p + "self_attention.query_key_value.weight", h) + w[p + "self_attention.query_key_value.bias"]
        q, k, v = torch.split(qkv, [HEADS * HD, GROUPS * HD, GROUPS * HD], dim=-1)
        q, k, v = q.view(b, s, HEADS, HD), k.view(b, s, GROUPS, HD), v.view(b, s, GROUPS, HD)
        q = torch.stack([rotary(q[i], pos) for i in range(b)])
        k = torch.stack([rotary(k[i], pos) for i in range(b)])
        group = torch.arange(HEADS) // (HEADS // GROUPS)
        k, v = k[:, :, group], v[:, :, group]  # [b, s, heads, HD]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / HD ** 0.5
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        a = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, HEADS * HD)
        x = x + lin(p + "self_attention.dense.weight", a)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = torch.chunk(lin(p + "mlp.dense_h_to_4h.weight", h), 2, dim=-1)
        x = x + lin(p + "mlp.dense_4h_to_h.weight", torch.nn.functional.silu(gate) * up)
    x = rms_norm(x, w["transformer.encoder.final_layernorm.weight"])
    return x @ w["transformer.output_layer.weight"].T


def to_torch(weights, grad=False):
    return {k: torch.tensor(v, dtype=torch.float64, requires_grad=grad) for k, v in weights.items()}


def make(d):
    weights = make_weights(7)
    os.makedirs(os.path.join(d, "hf"), exist_ok=True)
    os.makedirs(os.path.join(d, "hf_bf16"), exist_ok=True)
    names = list(weights)
    first = {k: weights[k] for k in names[: len(names) // 2]}
    second = {k: weights[k] for k in names[len(names) // 2:]}
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    write_safetensors(os.path.join(d, "hf", files[0]), first)
    write_safetensors(os.path.join(d, "hf", files[1]), second)
    weight_map = {k: files[0] for k in first} | {k: files[1] for k in second}
    json.dump({"metadata": {"total_size": 4 * sum(a.size for a in weights.values())}, "weight_map": weight_map},
              open(os.path.join(d, "hf", "model.safetensors.index.json"), "w"), indent=1)
    json.dump(config_json(), open(os.path.join(d, "hf", "config.json"), "w"), indent=1)
    write_safetensors(os.path.join(d, "hf_bf16", "model.safetensors"), weights, "BF16")
    json.dump(config_json() | {"torch_dtype": "bfloat16"}, open(os.path.join(d, "hf_bf16", "config.json"), "w"))

    rng = np.random.default_rng(11)
    tokens = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    targets = rng.integers(0, VOCAB, size=(BATCH, SEQ))
    targets[:, ::5] = -100
    w = to_torch(weights, grad=True)
    logits = forward(w, torch.tensor(tokens))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(targets).reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    ref = {"logits": logits.detach().reshape(-1, VOCAB).numpy()}
    for k, t in w.items():
        ref["grad/" + k] = t.grad.numpy()
    write_safetensors(os.path.join(d, "ref.safetensors"), ref)

    with torch.no_grad():
        wt = to_torch(weights)
        prompt = [int(t) for t in rng.integers(0, VOCAB, size=9)]
        seq = list(prompt)
        for _ in range(12):  # greedy: the whole sequence again each step (no cache to get wrong)
            last = forward(wt, torch.tensor([seq]))[0, -1]
            top = torch.topk(last, 2).values
            # a near tie would make the expected token depend on rounding, not on the model
            assert float(top[0] - top[1]) > 1e-3, f"greedy step {len(seq) - len(prompt)}: top-2 logits tie"
            seq.append(int(last.argmax()))
    json.dump({"tokens": tokens.reshape(-1).tolist(), "targets": targets.reshape(-1).tolist(), "batch": BATCH,
               "seq": SEQ, "loss": float(loss), "prompt": prompt, "greedy": seq[len(prompt):]},
              open(os.path.join(d, "expected.json"), "w"))


def check(d, out):
    want, got = read_folder(os.path.join(d, "hf")), read_folder(out)
    ok = True
    if sorted(want) != sorted(got):
        print("tensor names differ:", sorted(set(want) ^ set(got)))
        return 1
    for k in want:
        if want[k].shape != got[k].shape or not np.array_equal(want[k].view(np.uint32), got[k].view(np.uint32)):
            print("tensor differs:", k)
            ok = False
    cw, cg = config_json(), json.load(open(os.path.join(out, "config.json")))
    for k, v in cw.items():
        if k != "architectures" and cg.get(k) != v:
            print(f"config.json: {k} = {cg.get(k)!r}, want {v!r}")
            ok = False
    exp = json.load(open(os.path.join(d, "expected.json")))
    tokens = torch.tensor(exp["tokens"]).view(exp["batch"], exp["seq"])
    with torch.no_grad():
        logits = forward(to_torch(got), tokens).reshape(-1, VOCAB).numpy()
    if not np.array_equal(logits.astype(np.float32), read_safetensors(os.path.join(d, "ref.safetensors"))["logits"]):
        print("logits of the written model differ")
        ok = False
    print("round trip", "exact" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    elif sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(f"usage: {sys.argv[0]} make DIR | check DIR OUT")
