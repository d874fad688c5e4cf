"""PyTorch reference LLaMA for loom's parity test (independent of loom's C++ code).

Usage: llama_reference.py DIR
Reads DIR/config.txt, DIR/layout.txt, DIR/params.bin (flat float32), DIR/tokens.bin,
DIR/targets.bin (int32 [batch, seq]); writes DIR/ref_logits.bin (float32 [batch, seq, vocab]),
DIR/ref_loss.txt and DIR/ref_grads.bin (float32, the same flat layout as params.bin).
The model follows Meta's llama reference (RMSNorm, rotary embeddings as complex
multiplication on interleaved pairs, or Hugging Face's rotate_half on split halves,
repeat_kv for grouped-query attention, SwiGLU feed-forward).
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(1)
d = sys.argv[1]

cfg = {}
for line in open(os.path.join(d, "config.txt")):
    k, v = line.split()
    cfg[k] = v
dim, n_layers, n_heads, n_kv = (int(cfg[k]) for k in ("dim", "n_layers", "n_heads", "n_kv_heads"))
vocab, batch, seq = int(cfg["vocab"]), int(cfg["batch"]), int(cfg["seq"])
eps, theta, rope = float(cfg["norm_eps"]), float(cfg["rope_theta"]), cfg["rope"]
hd = dim // n_heads

flat = np.fromfile(os.path.join(d, "params.bin"), dtype=np.float32)
params = {}
for line in open(os.path.join(d, "layout.txt")):
    parts = line.split()
    name, off, numel, shape = parts[0], int(parts[1]), int(parts[2]), [int(x) for x in parts[3:]]
    params[name] = (off, torch.tensor(flat[off:off + numel].reshape(shape), requires_grad=True))
W = {k: v[1] for k, v in params.items()}
tokens = torch.from_numpy(np.fromfile(os.path.join(d, "tokens.bin"), dtype=np.int32).astype(np.int64)).view(batch, seq)
targets = torch.from_numpy(np.fromfile(os.path.join(d, "targets.bin"), dtype=np.int32).astype(np.int64)).view(batch, seq)


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# angles in float64, then float32 cos/sin
inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)  # [seq, hd/2]
cos, sin = ang.cos().float(), ang.sin().float()


def apply_rope(x):  # x: [b, s, h, hd]
    if rope == "interleaved":
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2))
        fc = torch.complex(cos, sin).view(1, seq, 1, hd // 2)
        return torch.view_as_real(xc * fc).flatten(3)
    c = torch.cat([cos, cos], -1).view(1, seq, 1, hd)
    s = torch.cat([sin, sin], -1).view(1, seq, 1, hd)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


mask = torch.full((seq, seq), float("-inf")).triu(1)
h = W["tok_embeddings.weight"][tokens]
for l in range(n_layers):
    p = "layers.%d." % l
    xn = rmsnorm(h, W[p + "attention_norm.weight"])
    q = (xn @ W[p + "attention.wq.weight"].T).view(batch, seq, n_heads, hd)
    k = (xn @ W[p + "attention.wk.weight"].T).view(batch, seq, n_kv, hd)
    v = (xn @ W[p + "attention.wv.weight"].T).view(batch, seq, n_kv, hd)
    q, k = apply_rope(q), apply_rope(k)
    rep = n_heads // n_kv
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, h, s, hd]
    scores = q @ k.transpose(2, 3) / math.sqrt(hd) + mask
    a = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, dim)
    h = h + a @ W[p + "attention.wo.weight"].T
    xn = rmsnorm(h, W[p + "ffn_norm.weight"])
    ff = F.silu(xn @ W[p + "feed_forward.w1.weight"].T) * (xn @ W[p + "feed_forward.w3.weight"].T)
    h = h + ff @ W[p + "feed_forward.w2.weight"].T
h = rmsnorm(h, W["norm.weight"])
out_w = W["output.weight"] if "output.weight" in W else W["tok_embeddings.weight"]
logits = h @ out_w.T
loss = F.cross_entropy(logits.view(-1, vocab), targets.view(-1), ignore_index=-100)
loss.backward()

logits.detach().numpy().astype(np.float32).tofile(os.path.join(d, "ref_logits.bin"))
with open(os.path.join(d, "ref_loss.txt"), "w") as f:
    f.write("%.9g\n" % loss.item())
grads = np.zeros_like(flat)
for name, (off, t) in params.items():
    grads[off:off + t.numel()] = t.grad.numpy().reshape(-1)
grads.tofile(os.path.join(d, "ref_grads.bin"))
