"""safetensors read and write for the tests' Python oracles, by hand (the format: a u64
header length, a JSON header of name -> dtype, shape, data_offsets, then little-endian data),
so that the oracles need nothing beyond numpy and do not share code with loom's reader."""
import json
import struct

import numpy as np


def to_bf16_bytes(a):  # round to nearest even
    u = np.ascontiguousarray(a, dtype="<f4").view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return r.tobytes()


def write_safetensors(path, tensors, dtype="F32"):
    """tensors: name -> float32 array, written in insertion order as F32, F16 or BF16."""
    header, blobs, off = {}, [], 0
    for name in tensors:  # insertion order; readers must not care
        a = tensors[name]
        b = (to_bf16_bytes(a) if dtype == "BF16" else np.ascontiguousarray(a, dtype="<f2").tobytes() if dtype == "F16"
             else np.ascontiguousarray(a, dtype="<f4").tobytes())
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)))
        fh.write(hb)
        for b in blobs:
            fh.write(b)


def read_safetensors(path):
    """name -> float32 array (F32, F16 and BF16 widened)."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        data = fh.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        a, b = e["data_offsets"]
        raw = data[a:b]
        if e["dtype"] == "F32":
            v = np.frombuffer(raw, dtype="<f4")
        elif e["dtype"] == "BF16":
            v = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif e["dtype"] == "F16":
            v = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {e['dtype']}")
        out[name] = v.reshape(e["shape"]).copy()
    return out
