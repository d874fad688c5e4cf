#!/usr/bin/python3
"""Single-stream greedy decode: loom's llama-generate against llama2.c's run.c, side by side.

    benchmarks/decode/decode_vs_runc.py --run /path/to/run \
        --generate build/examples/llama/generate/llama-generate [--rounds 9] [--tokens 250]

`--run` is a `run` binary the user built from llama2.c (for example
`gcc -Ofast -march=native run.c -lm -o run`); nothing of llama2.c is in this repository.
The script writes random llama2.c checkpoints of the stories15M shape (dim 288, 6 layers,
6 heads, FFN 768, seq_len 256, classifier tied to the embedding) with vocabularies of 32000
and 512 tokens, and a tokenizer.bin whose pieces are " t<id>" so run.c's text reads back as
token ids. Both programs run on one thread (OMP_NUM_THREADS=LOOM_NUM_THREADS=
OPENBLAS_NUM_THREADS=1), from the BOS token, greedy, for `--tokens` tokens, in alternating
rounds; the table gives each side's median tokens/s (each program's own figure: the time of
the forward passes that produced the tokens) and their ratio, and how many of the tokens are
the same (the two sum in different orders, so a near-tie may go either way).

Embedding row 1 (BOS) is zero: run.c stops at a generated BOS, so no logit may pick it. The
embedding is small (std 0.02) next to what the blocks add, so the tied classifier does not
just echo the last token and the two token streams are a real check.
Pass LOOM_SGEMM=avx2 in the environment to run loom on its AVX2 kernel.
"""
import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile

import numpy as np

DIM, HIDDEN, LAYERS, HEADS, SEQ = 288, 768, 6, 6, 256


def write_checkpoint(path, vocab, seed, dim=DIM, hidden=HIDDEN, layers=LAYERS, heads=HEADS, seq=SEQ):
    """A random legacy llama2.c checkpoint (tied classifier, n_kv_heads = heads) of the given
    shape (stories15M's by default); benchmarks/decode/parallel_generate.py uses it too."""
    rng = np.random.default_rng(seed)
    f = lambda *s, sc: (rng.standard_normal(s) * sc).astype("<f4")
    norm = lambda *s: rng.uniform(0.8, 1.2, s).astype("<f4")
    emb = f(vocab, dim, sc=0.02)  # small next to the blocks' outputs: a tied model that does not just repeat its input
    emb[1] = 0  # BOS never wins the argmax (run.c stops at a generated BOS)
    sd, sh = dim ** -0.5, hidden ** -0.5
    hd = dim // heads
    with open(path, "wb") as fh:
        fh.write(struct.pack("7i", dim, hidden, layers, heads, heads, vocab, seq))  # vocab > 0: tied classifier
        tensors = [emb, norm(layers, dim), f(layers, dim, dim, sc=sd), f(layers, dim, dim, sc=sd),
                   f(layers, dim, dim, sc=sd), f(layers, dim, dim, sc=sd), norm(layers, dim),
                   f(layers, hidden, dim, sc=sd), f(layers, dim, hidden, sc=sh), f(layers, hidden, dim, sc=sd),
                   norm(dim), np.zeros((2, seq, hd // 2), "<f4")]  # legacy files carry a RoPE table nobody reads
        for t in tensors:
            fh.write(np.ascontiguousarray(t).tobytes())


def write_tokenizer(path, vocab):
    pieces = [b"<s>" if i == 1 else b" t%d" % i for i in range(vocab)]
    with open(path, "wb") as fh:
        fh.write(struct.pack("i", max(len(p) for p in pieces)))
        for p in pieces:
            fh.write(struct.pack("fi", 0.0, len(p)) + p)


def run_runc(run, ckpt, tok, tokens, env):
    out = subprocess.run([run, ckpt, "-z", tok, "-t", "0", "-n", str(tokens)], env=env, check=True,
                         capture_output=True, text=True)
    rate = float(re.search(r"achieved tok/s: ([0-9.]+)", out.stderr).group(1))
    ids = [int(m) for m in re.findall(r"t(\d+)", out.stdout)]
    return rate, ids


def run_loom(gen, ckpt, tokens, env):
    out = subprocess.run([gen, "--checkpoint", ckpt, "--prompt", "1", "--max-new", str(tokens), "--temperature", "0",
                          "--blocks", str(SEQ // 16 + 1)], env=env, check=True, capture_output=True, text=True).stdout
    rate = float(re.search(r"\(([0-9.]+) tokens/s\)", out).group(1))
    ids = [int(t) for t in re.search(r"^\[0\]\s*(.*)$", out, re.M).group(1).split()]
    return rate, ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="path of a run binary built from llama2.c's run.c")
    ap.add_argument("--generate", required=True, help="path of loom's llama-generate")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 512])
    a = ap.parse_args()
    for p in (a.run, a.generate):
        if not os.access(p, os.X_OK):
            sys.exit(f"decode_vs_runc: '{p}' is not an executable file")
    if not 0 < a.tokens < SEQ:
        sys.exit(f"decode_vs_runc: --tokens must be in [1, {SEQ - 1}], got {a.tokens}")
    env = dict(os.environ, OMP_NUM_THREADS="1", LOOM_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    print(f"run.c: {a.run}; loom: {a.generate} with LOOM_SGEMM={os.environ.get('LOOM_SGEMM', '(default)')}; "
          f"{a.rounds} alternating rounds, {a.tokens} tokens, 1 thread\n")
    print("| vocab | run.c tokens/s | loom tokens/s | loom / run.c | same tokens |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for vocab in a.vocab:
            ckpt, tok = os.path.join(d, f"model{vocab}.bin"), os.path.join(d, f"tok{vocab}.bin")
            write_checkpoint(ckpt, vocab, seed=vocab)
            write_tokenizer(tok, vocab)
            rc, lm = [], []
            for _ in range(a.rounds):
                r, rids = run_runc(a.run, ckpt, tok, a.tokens, env)
                l, lids = run_loom(a.generate, ckpt, a.tokens, env)
                rc.append(r), lm.append(l)
            if len(lids) != a.tokens or len(rids) != a.tokens:
                sys.exit(f"decode_vs_runc: vocab {vocab}: run.c made {len(rids)} tokens, loom {len(lids)}; "
                         f"expected {a.tokens}")
            same = next((i for i, (x, y) in enumerate(zip(rids, lids)) if x != y), a.tokens)
            r, l = statistics.median(rc), statistics.median(lm)
            print(f"| {vocab} | {r:.0f} | {l:.0f} | {l / r:.2f}x | first {same} of {a.tokens} |", flush=True)


if __name__ == "__main__":
    main()
