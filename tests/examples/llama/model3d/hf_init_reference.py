#!/usr/bin/python3
"""Oracles for llama3d::init_from_hf (test_init_hf.cpp), written independently of loom.

  hf_init_reference.py make DIR
      writes small random HF folders and, for each, the tensors the trainer must hold after
      init_from_hf under the model's (Meta's) names:
        DIR/glm/        ChatGLM3-shaped (chatglm_reference.py's model), F32, two shards +
                        model.safetensors.index.json
        DIR/glm_bf16/   the same weights as BF16, one file
        DIR/glm_meta.safetensors              the weights under Meta's names (fused wqkv, w13)
        DIR/glm_batch.json                    a batch for it: batch, seq, tokens, targets
        DIR/llama/      HF-named LLaMA with GQA (8 heads, 2 KV heads), F32, two shards + index;
                        q_proj/k_proj rows in HF's order (permuted as HF's converter does)
        DIR/llama_f16/  the same weights as F16, one file
        DIR/llama_meta_interleaved.safetensors  Meta's names and Meta's row order (adjacent pairs)
        DIR/llama_meta_half.safetensors         Meta's names, HF's row order (half-split rotary)
        DIR/llama_ref.safetensors, DIR/llama_expected.json
                        the HF LLaMA's logits, loss and every gradient (HF names) of a batch
                        in float64 (HF's semantics: half-split rotary on the stored rows,
                        query head h reads KV head h // (heads / kv_heads))
      The weights are rounded to BF16 (ChatGLM) / F16 (LLaMA) first, so every folder holds
      exactly the same values.
  hf_init_reference.py logits FOLDER TOKENS_JSON LOOM_LOGITS
      the ChatGLM transcription (chatglm_reference.forward, float64) on FOLDER's tensors for
      the tokens of TOKENS_JSON ({"batch", "seq", "tokens"}); exits 0 when
      max |loom - torch| <= 1e-4 max |torch| for LOOM_LOGITS' "logits" [batch*seq, vocab].
"""
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "support"))
sys.path.insert(0, os.path.join(HERE, "..", "generate"))
import chatglm_reference as glm  # noqa: E402
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402

L_LAYERS, L_HIDDEN, L_HEADS, L_KV, L_FFN, L_VOCAB = 2, 128, 8, 2, 256, 512
L_HD = L_HIDDEN // L_HEADS


def round_to(a, dtype):
    return torch.tensor(a).to(dtype).to(torch.float32).numpy()


def write_folder(d, weights, config, dtype, shards):
    os.makedirs(d, exist_ok=True)
    names = list(weights)
    if shards == 1:
        write_safetensors(os.path.join(d, "model.safetensors"), weights, dtype)
    else:
        files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
        cut = [names[k * len(names) // shards:(k + 1) * len(names) // shards] for k in range(shards)]
        weight_map = {}
        for f, part in zip(files, cut):
            write_safetensors(os.path.join(d, f), {k: weights[k] for k in part}, dtype)
            weight_map |= {k: f for k in part}
        json.dump({"metadata": {"total_size": 4 * sum(a.size for a in weights.values())}, "weight_map": weight_map},
                  open(os.path.join(d, "model.safetensors.index.json"), "w"), indent=1)
    json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=1)


# ---- ChatGLM: chatglm_reference's model, Meta's names ---------------------------------------
def glm_meta_name(hf):
    top = {"transformer.embedding.word_embeddings.weight": "tok_embeddings.weight",
           "transformer.encoder.final_layernorm.weight": "norm.weight",
           "transformer.output_layer.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, rest = hf[len("transformer.encoder.layers."):].split(".", 1)
    part = {"input_layernorm.weight": "attention_norm.weight",
            "self_attention.query_key_value.weight": "attention.wqkv.weight",
            "self_attention.query_key_value.bias": "attention.wqkv.bias",
            "self_attention.dense.weight": "attention.wo.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "mlp.dense_h_to_4h.weight": "feed_forward.w13.weight",
            "mlp.dense_4h_to_h.weight": "feed_forward.w2.weight"}[rest]
    return f"layers.{layer}.{part}"


# ---- LLaMA with GQA: Meta's weights, and HF's as its converter writes them ------------------
def llama_config():
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": L_HIDDEN, "intermediate_size": L_FFN, "num_hidden_layers": L_LAYERS,
            "num_attention_heads": L_HEADS, "num_key_value_heads": L_KV, "vocab_size": L_VOCAB,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def hf_permute(w, heads):
    """HF's converter: rows of each head reordered from adjacent pairs to two halves."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def llama_weights(seed):
    """(HF-named weights in HF's order, Meta-named in Meta's order, Meta-named in HF's order)"""
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: round_to((rng.standard_normal(s) * sc).astype(np.float32), torch.float16)
    norm = lambda: round_to((1 + 0.1 * rng.standard_normal(L_HIDDEN)).astype(np.float32), torch.float16)
    meta = {"tok_embeddings.weight": f(L_VOCAB, L_HIDDEN)}
    for l in range(L_LAYERS):
        p = f"layers.{l}."
        meta[p + "attention_norm.weight"] = norm()
        meta[p + "attention.wq.weight"] = f(L_HEADS * L_HD, L_HIDDEN, sc=L_HIDDEN ** -0.5)
        meta[p + "attention.wk.weight"] = f(L_KV * L_HD, L_HIDDEN, sc=L_HIDDEN ** -0.5)
        meta[p + "attention.wv.weight"] = f(L_KV * L_HD, L_HIDDEN, sc=L_HIDDEN ** -0.5)
        meta[p + "attention.wo.weight"] = f(L_HIDDEN, L_HEADS * L_HD, sc=L_HIDDEN ** -0.5)
        meta[p + "ffn_norm.weight"] = norm()
        meta[p + "feed_forward.w1.weight"] = f(L_FFN, L_HIDDEN, sc=L_HIDDEN ** -0.5)
        meta[p + "feed_forward.w2.weight"] = f(L_HIDDEN, L_FFN, sc=L_FFN ** -0.5)
        meta[p + "feed_forward.w3.weight"] = f(L_FFN, L_HIDDEN, sc=L_HIDDEN ** -0.5)
    meta["norm.weight"] = norm()
    meta["output.weight"] = f(L_VOCAB, L_HIDDEN, sc=L_HIDDEN ** -0.5)
    half = dict(meta)
    for l in range(L_LAYERS):
        half[f"layers.{l}.attention.wq.weight"] = hf_permute(meta[f"layers.{l}.attention.wq.weight"], L_HEADS)
        half[f"layers.{l}.attention.wk.weight"] = hf_permute(meta[f"layers.{l}.attention.wk.weight"], L_KV)
    hf = {"model.embed_tokens.weight": half["tok_embeddings.weight"]}
    for l in range(L_LAYERS):
        m, h = f"layers.{l}.", f"model.layers.{l}."
        for a, b in [("attention_norm.weight", "input_layernorm.weight"), ("attention.wq.weight", "self_attn.q_proj.weight"),
                     ("attention.wk.weight", "self_attn.k_proj.weight"), ("attention.wv.weight", "self_attn.v_proj.weight"),
                     ("attention.wo.weight", "self_attn.o_proj.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
                     ("feed_forward.w1.weight", "mlp.gate_proj.weight"), ("feed_forward.w2.weight", "mlp.down_proj.weight"),
                     ("feed_forward.w3.weight", "mlp.up_proj.weight")]:
            hf[h + b] = half[m + a]
    hf["model.norm.weight"] = half["norm.weight"]
    hf["lm_head.weight"] = half["output.weight"]
    return hf, meta, half


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def llama_forward(w, tokens, lin=None):
    """HF LLaMA semantics, tokens [batch, seq] -> logits [batch, seq, vocab]. lin(name, h): the
    projection by weight `name` (default h @ w[name].T; a LoRA oracle wraps it)."""
    lin = lin or (lambda name, h: h @ w[name].T)
    b, s = tokens.shape
    inv = 1.0 / 10000.0 ** (torch.arange(0, L_HD, 2, dtype=torch.float64) / L_HD)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None], torch.cat([ang.sin(), ang.sin()], -1)[None, :, None]
    rot = lambda x: x * cos + torch.cat([-x[..., L_HD // 2:], x[..., :L_HD // 2]], -1) * sin
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    x = w["model.embed_tokens.weight"][tokens]
    for l in range(L_LAYERS):
        p = f"model.layers.{l}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rot(lin(p + "self_attn.q_proj.weight", h).view(b, s, L_HEADS, L_HD))
        k = rot(lin(p + "self_attn.k_proj.weight", h).view(b, s, L_KV, L_HD))
        v = lin(p + "self_attn.v_proj.weight", h).view(b, s, L_KV, L_HD)
        kv = torch.arange(L_HEADS) // (L_HEADS // L_KV)
        k, v = k[:, :, kv], v[:, :, kv]
        probs = torch.softmax((torch.einsum("bqhd,bkhd->bhqk", q, k) / L_HD ** 0.5).masked_fill(mask, float("-inf")), -1)
        x = x + lin(p + "self_attn.o_proj.weight", torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, L_HIDDEN))
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + lin(p + "mlp.down_proj.weight",
                    torch.nn.functional.silu(lin(p + "mlp.gate_proj.weight", h)) * lin(p + "mlp.up_proj.weight", h))
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def make_llama_ref(d, hf):
    rng = np.random.default_rng(13)
    batch, seq = 2, 12
    tokens = rng.integers(0, L_VOCAB, size=(batch, seq))
    targets = rng.integers(0, L_VOCAB, size=(batch, seq))
    targets[:, ::4] = -100
    w = glm.to_torch(hf, grad=True)
    logits = llama_forward(w, torch.tensor(tokens))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, L_VOCAB), torch.tensor(targets).reshape(-1), ignore_index=-100)
    loss.backward()
    ref = {"logits": logits.detach().reshape(-1, L_VOCAB).numpy()} | {"grad/" + k: t.grad.numpy() for k, t in w.items()}
    write_safetensors(os.path.join(d, "llama_ref.safetensors"), ref)
    json.dump({"batch": batch, "seq": seq, "tokens": tokens.reshape(-1).tolist(), "targets": targets.reshape(-1).tolist(),
               "loss": float(loss)}, open(os.path.join(d, "llama_expected.json"), "w"))


def make(d):
    weights = {k: round_to(v, torch.bfloat16) for k, v in glm.make_weights(7).items()}
    write_folder(os.path.join(d, "glm"), weights, glm.config_json(), "F32", 2)
    write_folder(os.path.join(d, "glm_bf16"), weights, glm.config_json() | {"torch_dtype": "bfloat16"}, "BF16", 1)
    write_safetensors(os.path.join(d, "glm_meta.safetensors"), {glm_meta_name(k): v for k, v in weights.items()})
    rng = np.random.default_rng(17)  # a batch for the ChatGLM LoRA oracle (lora_decoder_reference.py)
    tokens, targets = rng.integers(0, glm.VOCAB, size=(2, 12)), rng.integers(0, glm.VOCAB, size=(2, 12))
    targets[:, ::4] = -100
    json.dump({"batch": 2, "seq": 12, "tokens": tokens.reshape(-1).tolist(), "targets": targets.reshape(-1).tolist()},
              open(os.path.join(d, "glm_batch.json"), "w"))

    hf, meta, half = llama_weights(5)
    write_folder(os.path.join(d, "llama"), hf, llama_config(), "F32", 2)
    write_folder(os.path.join(d, "llama_f16"), hf, llama_config() | {"torch_dtype": "float16"}, "F16", 1)
    write_safetensors(os.path.join(d, "llama_meta_interleaved.safetensors"), meta)
    write_safetensors(os.path.join(d, "llama_meta_half.safetensors"), half)
    make_llama_ref(d, hf)


def logits(folder, tokens_json, loom_logits):
    t = json.load(open(tokens_json))
    tokens = torch.tensor(t["tokens"]).view(t["batch"], t["seq"])
    with torch.no_grad():
        want = glm.forward(glm.to_torch(glm.read_folder(folder)), tokens).reshape(-1, glm.VOCAB).numpy()
    got = read_safetensors(loom_logits)["logits"].astype(np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"logits: max |loom - torch| / max |torch| = {err:.3g}")
    return 0 if got.shape == want.shape and err <= 1e-4 else 1


def folder_tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(os.path.join(folder, f)))
    return out


def same(a, b):
    """Every tensor of folder a is in folder b with the same name, shape, dtype and bits."""
    x, y = folder_tensors(a), folder_tensors(b)
    bad = [n for n in x if n not in y or x[n].shape != y[n].shape or x[n].dtype != y[n].dtype
           or x[n].tobytes() != y[n].tobytes()]
    extra = sorted(set(y) - set(x))
    print(f"same: {len(x)} tensors, {len(bad)} differ {bad[:4]}, {len(extra)} extra {extra[:4]}")
    return 0 if x and not bad and not extra else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "same":
        sys.exit(same(sys.argv[2], sys.argv[3]))
    elif len(sys.argv) == 5 and sys.argv[1] == "logits":
        sys.exit(logits(*sys.argv[2:]))
    else:
        sys.exit(f"usage: {sys.argv[0]} make DIR | logits FOLDER TOKENS_JSON LOOM_LOGITS | same FOLDER_A FOLDER_B")
