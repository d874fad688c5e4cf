#!/usr/bin/python3
"""The oracle of test_train3d_lora's PyTorch cases: hf_init_reference's HF LLaMA, or
chatglm_reference's ChatGLM3 (fused query_key_value with its bias, packed dense_h_to_4h), in
float64 with every adapted projection a PEFT LoRA layer transcribed (facts from PEFT's
tuners/lora/layer.py: result = base(x) + lora_B(lora_A(dropout(x))) * scaling, scaling =
alpha / r, or alpha / sqrt(r) with use_rslora; no dropout here; on a fused layer the one A
and B span all of its output rows), the adapters read from a PEFT folder by PEFT's names, the
base frozen.

usage: lora_decoder_reference.py REF_DIR PEFT_DIR OUT [llama|chatglm]
  REF_DIR: what `hf_init_reference.py make` wrote (llama/, llama_expected.json; glm/,
  glm_batch.json)
  writes OUT (safetensors): logits [batch*seq, vocab], loss [1], and for every adapter
  tensor of PEFT_DIR its gradient under its own name
"""
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_init_reference as ref  # noqa: E402
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402


def main(ref_dir, peft_dir, out, model="llama"):
    assert model in ("llama", "chatglm"), model
    cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg.get("bias", "none") == "none"
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r
    base = ref.folder_tensors(os.path.join(ref_dir, "llama" if model == "llama" else "glm"))
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in base.items()}  # frozen: no gradients
    adapter = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for k, v in read_safetensors(os.path.join(peft_dir, "adapter_model.safetensors")).items()}
    used = set()

    def lin(name, h):  # name: "<module path>.weight", the base model's HF name
        result = h @ w[name].T
        path = "base_model.model." + name[:-len(".weight")]
        if path + ".lora_A.weight" in adapter:
            a, b = adapter[path + ".lora_A.weight"], adapter[path + ".lora_B.weight"]
            result = result + ((h @ a.T) @ b.T) * scaling
            used.add(path)
        return result

    e = json.load(open(os.path.join(ref_dir, "llama_expected.json" if model == "llama" else "glm_batch.json")))
    tokens = torch.tensor(e["tokens"]).view(e["batch"], e["seq"])
    targets = torch.tensor(e["targets"]).view(-1)
    logits = ref.llama_forward(w, tokens, lin) if model == "llama" else ref.glm.forward(w, tokens, lin)
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets, ignore_index=-100)
    loss.backward()
    # every adapter of the folder sits on a projection the model has
    assert len(used) * 2 == len(adapter), sorted(set(adapter) - {u + s for u in used for s in (".lora_A.weight", ".lora_B.weight")})
    res = {"logits": logits.detach().reshape(-1, vocab).numpy(), "loss": np.array([float(loss)])}
    res |= {k: t.grad.numpy() for k, t in adapter.items()}
    write_safetensors(out, res)


if __name__ == "__main__":
    main(*sys.argv[1:5])
