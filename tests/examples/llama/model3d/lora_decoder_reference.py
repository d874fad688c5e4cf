#!/usr/bin/python3
"""The oracle of test_train3d_lora's PyTorch case: hf_init_reference's HF LLaMA (float64) with
every projection a PEFT LoRA layer transcribed (facts from PEFT's tuners/lora/layer.py:
result = base(x) + lora_B(lora_A(dropout(x))) * scaling, scaling = alpha / r, or
alpha / sqrt(r) with use_rslora; no dropout here), the adapters read from a PEFT folder by
PEFT's names, the base frozen.

usage: lora_decoder_reference.py REF_DIR PEFT_DIR OUT
  REF_DIR: what `hf_init_reference.py make` wrote (llama/, llama_expected.json)
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


def main(ref_dir, peft_dir, out):
    cfg = json.load(open(os.path.join(peft_dir, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg.get("bias", "none") == "none"
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r
    base = {}
    for f in sorted(os.listdir(os.path.join(ref_dir, "llama"))):
        if f.endswith(".safetensors"):
            base |= read_safetensors(os.path.join(ref_dir, "llama", f))
    w = {k: torch.tensor(v, dtype=torch.float64) for k, v in base.items()}  # frozen: no gradients
    adapter = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True)
               for k, v in read_safetensors(os.path.join(peft_dir, "adapter_model.safetensors")).items()}

    def lin(name, h):  # name: "model.layers.{i}.<module path>.weight"
        result = h @ w[name].T
        path = "base_model.model." + name[:-len(".weight")]
        if path + ".lora_A.weight" in adapter:
            a, b = adapter[path + ".lora_A.weight"], adapter[path + ".lora_B.weight"]
            result = result + ((h @ a.T) @ b.T) * scaling
        return result

    e = json.load(open(os.path.join(ref_dir, "llama_expected.json")))
    tokens = torch.tensor(e["tokens"]).view(e["batch"], e["seq"])
    targets = torch.tensor(e["targets"]).view(-1)
    logits = ref.llama_forward(w, tokens, lin)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, ref.L_VOCAB), targets, ignore_index=-100)
    loss.backward()
    res = {"logits": logits.detach().reshape(-1, ref.L_VOCAB).numpy(), "loss": np.array([float(loss)])}
    res |= {k: t.grad.numpy() for k, t in adapter.items()}
    write_safetensors(out, res)


if __name__ == "__main__":
    main(*sys.argv[1:4])
