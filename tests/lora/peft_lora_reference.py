"""The oracle of test_lora: PEFT's LoRA linear layer transcribed in PyTorch (facts from PEFT's
tuners/lora/layer.py: y = base(x) + lora_B(lora_A(dropout(x))) * scaling, scaling = alpha / r
or alpha / sqrt(r) with use_rslora; merge W += (B @ A) * scaling), run in float64.

The adapter is read the way a PEFT user reads it: adapter_config.json and
adapter_model.safetensors by PEFT's tensor names. Dropout's random mask is the only thing
taken from loom (the mask the test used, with 1 / (1 - p) folded in), since two RNGs cannot
agree; everything else is computed here.

usage: peft_lora_reference.py DIR
  DIR/adapter_config.json, DIR/adapter_model.safetensors   the adapter (PEFT layout)
  DIR/inputs.safetensors   per module key k: k.weight [out, in] (the HF base weight),
                           k.x [n, in], k.dy [n, out], k.mask [n, in]
  DIR/modules.json         {k: PEFT module path}
writes DIR/outputs.safetensors: k.y, k.y_merged, k.dx, k.dA, k.dB
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from safetensors_io import read_safetensors, write_safetensors  # noqa: E402


class LoraLinear(torch.nn.Module):
    """A frozen base nn.Linear plus lora_A (in -> r) and lora_B (r -> out), no biases."""

    def __init__(self, weight, r, alpha, use_rslora):
        super().__init__()
        out_f, in_f = weight.shape
        self.base_layer = torch.nn.Linear(in_f, out_f, bias=False).double()
        with torch.no_grad():
            self.base_layer.weight.copy_(weight)
        self.base_layer.weight.requires_grad_(False)
        self.lora_A = torch.nn.Linear(in_f, r, bias=False).double()
        self.lora_B = torch.nn.Linear(r, out_f, bias=False).double()
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r

    def forward(self, x, mask):
        result = self.base_layer(x)
        dropped = x * mask  # nn.Dropout in training mode with loom's mask (keep / (1 - p))
        return result + self.lora_B(self.lora_A(dropped)) * self.scaling

    def merged_forward(self, x):
        with torch.no_grad():
            w = self.base_layer.weight + (self.lora_B.weight @ self.lora_A.weight) * self.scaling
            return x @ w.t()


def main(d):
    with open(os.path.join(d, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA", cfg["peft_type"]
    with open(os.path.join(d, "modules.json")) as f:
        modules = json.load(f)
    adapter = read_safetensors(os.path.join(d, "adapter_model.safetensors"))
    inputs = read_safetensors(os.path.join(d, "inputs.safetensors"))
    out = {}
    for key, path in modules.items():
        t = {n: torch.from_numpy(inputs[key + "." + n]).double() for n in ("weight", "x", "dy", "mask")}
        layer = LoraLinear(t["weight"], cfg["r"], cfg["lora_alpha"], cfg.get("use_rslora", False))
        with torch.no_grad():
            layer.lora_A.weight.copy_(torch.from_numpy(adapter[path + ".lora_A.weight"]).double())
            layer.lora_B.weight.copy_(torch.from_numpy(adapter[path + ".lora_B.weight"]).double())
        x = t["x"].clone().requires_grad_(True)
        y = layer(x, t["mask"])
        y.backward(t["dy"])
        assert layer.base_layer.weight.grad is None  # frozen
        out[key + ".y"] = y.detach().numpy()
        out[key + ".y_merged"] = layer.merged_forward(t["x"]).numpy()
        out[key + ".dx"] = x.grad.numpy()
        out[key + ".dA"] = layer.lora_A.weight.grad.numpy()
        out[key + ".dB"] = layer.lora_B.weight.grad.numpy()
    write_safetensors(os.path.join(d, "outputs.safetensors"), out)


if __name__ == "__main__":
    main(sys.argv[1])
