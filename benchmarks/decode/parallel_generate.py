#!/usr/bin/python3
"""Tensor- and pipeline-parallel generation against one rank, on the same cores.

    benchmarks/decode/parallel_generate.py --generate build/examples/llama/generate/llama-generate \
        [--shape s15m|s42m|s110m] [--rounds 5] [--prompts 16] [--max-new 64] [--mpi]

Writes a random llama2.c checkpoint of the chosen shape (decode_vs_runc.write_checkpoint,
vocabulary 32000), then runs llama-generate on it in alternating rounds, one configuration
after the other, each on all of this machine's cores (nproc) and no more:
  tp 1 with a host pool of nproc threads; tp N (and pp N, and tp 2 x pp 2 where N >= 4) with
  one thread per rank; with --mpi, the same under `mpirun -np N` (one process per core).
Every run is the same batch of --prompts prompts (4 token ids each), --max-new greedy tokens
each, in one continuous batch. Per configuration the table gives the median of the program's
own figures over the rounds: tokens/s, rank 0's mean time per engine step (a decode step
is one token per sequence: the per-token latency a user sees), and rank 0's share of time in
communication (comm::timed: collectives, transfers and their waits, waiting for peers
included). Every configuration's tokens must equal tp 1's (the run fails otherwise).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_vs_runc import write_checkpoint  # noqa: E402

SHAPES = {  # dim, hidden, layers, heads, seq
    "s15m": (288, 768, 6, 6, 256),
    "s42m": (512, 1376, 8, 8, 256),
    "s110m": (768, 2048, 12, 12, 256),
}
VOCAB = 32000


def run(cmd, env):
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    rate = float(re.search(r"generated in [0-9.]+ s \(([0-9.]+) tokens/s\)", out).group(1))
    step = float(re.search(r"rank 0: ([0-9.]+) ms per engine step", out).group(1))
    comm = float(re.search(r"in communication [0-9.]+ s of [0-9.]+ s \(([0-9.]+)%", out).group(1))
    tokens = re.findall(r"^\[\d+\]  [0-9 ]+$", out, re.M)
    mem = re.search(r"rank 0 of \d+ holds weights (\d+) \+ KV pool (\d+) \+ workspace (\d+)", out)
    return rate, step, comm, tokens, sum(int(x) for x in mem.groups())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generate", required=True, help="path of loom's llama-generate")
    ap.add_argument("--shape", choices=SHAPES, default="s15m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--mpi", action="store_true", help="also run the split configurations under mpirun")
    a = ap.parse_args()
    if not os.access(a.generate, os.X_OK):
        sys.exit(f"parallel_generate: '{a.generate}' is not an executable file")
    n = os.cpu_count() or 1
    if n < 2:
        sys.exit("parallel_generate: needs at least 2 cores")
    dim, hidden, layers, heads, seq = SHAPES[a.shape]
    one = dict(os.environ, OPENBLAS_NUM_THREADS="1", LOOM_NUM_THREADS="1")
    configs = [("tp 1", [], dict(one, LOOM_NUM_THREADS=str(n)), [])]
    splits = [(f"tp {n}", ["--tp", str(n)]), (f"pp {n}", ["--pp", str(n)])]
    if n >= 4:
        splits.append(("tp 2 x pp 2", ["--tp", "2", "--pp", "2"]))
    configs += [(name, flags, one, []) for name, flags in splits]
    if a.mpi:
        mpirun = ["mpirun", "--bind-to", "none"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        configs += [(name + " (mpirun)", flags, one, mpirun + ["-np", str(n)]) for name, flags in splits[:2]]
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, f"{a.shape}.bin")
        write_checkpoint(ckpt, VOCAB, seed=1, dim=dim, hidden=hidden, layers=layers, heads=heads, seq=seq)
        base = [a.generate, "--checkpoint", ckpt, "--max-new", str(a.max_new), "--temperature", "0"]
        for i in range(a.prompts):
            base += ["--prompt", " ".join(str(2 + (7 * i + 3 * k) % (VOCAB - 2)) for k in range(4))]
        results = {name: [] for name, *_ in configs}
        reference = None
        for _ in range(a.rounds):
            for name, flags, env, launch in configs:
                r = run(launch + base + flags, env)
                if reference is None:
                    reference = r[3]
                elif r[3] != reference:
                    sys.exit(f"parallel_generate: {name} generated other tokens than tp 1")
                results[name].append(r)
    print(f"{a.shape} (dim {dim}, {layers} layers, {heads} heads, FFN {hidden}, vocab {VOCAB}), {a.prompts} prompts x "
          f"{a.max_new} tokens, {n} cores, {a.rounds} alternating rounds (medians); tokens equal tp 1's in every run\n")
    print("| configuration | tokens/s | vs tp 1 | ms per engine step | rank 0 in communication | rank 0 memory (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    t1 = statistics.median(r[0] for r in results["tp 1"])
    for name, rs in results.items():
        rate = statistics.median(r[0] for r in rs)
        print(f"| {name} | {rate:.0f} | {rate / t1:.2f}x | {statistics.median(r[1] for r in rs):.2f} | "
              f"{statistics.median(r[2] for r in rs):.1f}% | {rs[0][4] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
