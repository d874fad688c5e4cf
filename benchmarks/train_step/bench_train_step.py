#!/usr/bin/python3
"""Training-step benchmark: loom's reference LLaMA beside PyTorch and OpenBLAS sgemm.

Usage: /usr/bin/python3 benchmarks/train_step/bench_train_step.py \
           --binary build/benchmarks/train_step/loom-bench-train-step [--threads 2] [--steps N] [--repeat 3]

For every model size, on the same number of threads and in this one run: sgemm GFLOP/s
(n = 1024, the practical peak: the better of OpenBLAS and loom's kernel), loom's forward +
backward (loom-bench-train-step), and the same LLaMA and batch in PyTorch (an ordinary
nn.Module, autograd, fp32). Each implementation runs in its own process with
OPENBLAS_NUM_THREADS / OMP_NUM_THREADS set (and the environment below that suits it best);
a process reports its best timed step after one warm-up step (SIZES: 30 of the tiny model's
~60 ms steps, 10 of the others' 0.3-2 s ones, so every process times at least ~2 s; --steps
sets one count for all). loom and PyTorch processes alternate --repeat times per model (loom,
torch, loom, torch, ...; the repeats go round the models) and each keeps its best, so a busy
moment of a shared machine hits both sides alike. Prints a Markdown table.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

SIZES = [  # name, dim, layers, heads, kv_heads, hidden, vocab, seq, batch, timed steps per process
    ("tiny", 128, 4, 4, 2, 352, 4096, 128, 8, 30),
    ("small", 288, 6, 6, 6, 768, 4096, 256, 4, 10),
    ("medium", 512, 8, 8, 4, 1376, 8192, 256, 4, 10),
]


def flops_per_token(dim, layers, heads, kv, hidden, vocab, seq):
    hd = dim // heads
    matmul = layers * (2 * dim * heads * hd + 2 * dim * kv * hd + 3 * dim * hidden) + vocab * dim
    return 6.0 * matmul + 12.0 * layers * seq * dim


def torch_worker(a):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    dim, layers, heads, kv, hidden, vocab, seq, batch = a
    hd = dim // heads

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    freqs_cis = torch.polar(torch.ones(seq, hd // 2), torch.outer(torch.arange(seq).float(), freqs))

    def rope(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis.view(1, seq, 1, hd // 2)).flatten(3)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(dim, heads * hd, bias=False)
            self.wk = nn.Linear(dim, kv * hd, bias=False)
            self.wv = nn.Linear(dim, kv * hd, bias=False)
            self.wo = nn.Linear(heads * hd, dim, bias=False)
            self.w1 = nn.Linear(dim, hidden, bias=False)
            self.w2 = nn.Linear(hidden, dim, bias=False)
            self.w3 = nn.Linear(dim, hidden, bias=False)
            self.n1, self.n2 = RMSNorm(), RMSNorm()

        def forward(self, x, mask):
            b, s, _ = x.shape
            h = self.n1(x)
            q = rope(self.wq(h).view(b, s, heads, hd))
            k = rope(self.wk(h).view(b, s, kv, hd)).repeat_interleave(heads // kv, dim=2)
            v = self.wv(h).view(b, s, kv, hd).repeat_interleave(heads // kv, dim=2)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            att = F.softmax(q @ k.transpose(2, 3) / math.sqrt(hd) + mask, dim=-1)
            x = x + self.wo((att @ v).transpose(1, 2).reshape(b, s, dim))
            h = self.n2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class LLaMA(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RMSNorm()
            self.out = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens, targets):
            mask = torch.full((seq, seq), float("-inf")).triu(1)
            x = self.emb(tokens)
            for blk in self.blocks:
                x = blk(x, mask)
            logits = self.out(self.norm(x))
            return F.cross_entropy(logits.view(-1, vocab), targets.view(-1))

    m = LLaMA()
    tokens = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))

    def step():
        m.zero_grad(set_to_none=False)
        loss = m(tokens, targets)
        loss.backward()
        return loss.item()

    step()
    best = 1e30
    for _ in range(a_steps):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    n = batch * seq
    print(json.dumps({"impl": "torch", "step_s": best, "tokens_per_s": n / best,
                      "gflops": flops_per_token(dim, layers, heads, kv, hidden, vocab, seq) * n / best / 1e9}))


# Each side runs with the setting that suits it best on a shared core (measured on the 2-core
# development machine; it matters only above 1 thread):
# - loom: none. Its GEMMs run on its own pool, one single-thread call per part (loom's sgemm
#   kernel, or OpenBLAS on one thread), so OpenBLAS's idle-thread settings
#   (OPENBLAS_THREAD_TIMEOUT) make no difference.
# - PyTorch: idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE); spinning ones starve
#   OpenBLAS's threads (2 threads: 826 instead of 2241 tok/s for the small model), and
#   OPENBLAS_THREAD_TIMEOUT=4 makes PyTorch slower (2038 tok/s), so it is not set.
LOOM_ENV = {}
TORCH_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def run(cmd, threads, extra):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads), **extra)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--binary", required=True, help="path of loom-bench-train-step")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--steps", type=int, default=None, help="timed steps per process (default: per model, SIZES)")
    p.add_argument("--repeat", type=int, default=3, help="alternating loom/PyTorch runs per model; best of each")
    p.add_argument("--sizes", default=",".join(s[0] for s in SIZES))
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: measure what a CPU without AVX-512 runs, on one that has it: loom with "
                        "LOOM_SGEMM=avx2 (build the binary with -DLOOM_BENCH_MARCH=x86-64-v3 too), "
                        "OpenBLAS with OPENBLAS_CORETYPE=Haswell, PyTorch with ATEN_CPU_CAPABILITY=avx2")
    p.add_argument("--torch-worker", nargs=8, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    a_steps = args.steps
    if args.torch_worker:
        import torch
        torch.set_num_threads(args.threads)
        torch_worker(args.torch_worker)
        sys.exit(0)

    t = args.threads
    if args.isa == "avx2":
        LOOM_ENV.update(LOOM_SGEMM="avx2", OPENBLAS_CORETYPE="Haswell")
        TORCH_ENV.update(OPENBLAS_CORETYPE="Haswell", ATEN_CPU_CAPABILITY="avx2")
    # sgemm peak: the best of measurements taken before every model run, so a busy moment on a
    # shared machine does not lower the bar the models are compared against. The repeats go
    # round the models (tiny, small, medium, tiny, ...), so each model's runs are spread over
    # the whole benchmark instead of one stretch of it that a busy minute could cover.
    sgemm = run([args.binary, "--sgemm", "1024"], t, LOOM_ENV)["sgemm_gflops"]
    sizes = [s for s in SIZES if s[0] in args.sizes.split(",")]
    best = {}  # name -> (loom, torch) best results so far
    for _ in range(max(1, args.repeat)):
        for name, dim, layers, heads, kv, hidden, vocab, seq, batch, size_steps in sizes:
            shape = [dim, layers, heads, kv, hidden, vocab, seq, batch]
            steps = args.steps or size_steps
            sgemm = max(sgemm, run([args.binary, "--sgemm", "1024"], t, LOOM_ENV)["sgemm_gflops"])
            l = run([args.binary, "--dim", str(dim), "--layers", str(layers), "--heads", str(heads), "--kv-heads",
                     str(kv), "--hidden", str(hidden), "--vocab", str(vocab), "--seq", str(seq), "--batch",
                     str(batch), "--steps", str(steps)], t, LOOM_ENV)
            r = run([sys.executable, __file__, "--binary", args.binary, "--threads", str(t), "--steps",
                     str(steps), "--torch-worker"] + [str(x) for x in shape], t, TORCH_ENV)
            loom, torch_r = best.get(name, (l, r))
            best[name] = (l if l["tokens_per_s"] > loom["tokens_per_s"] else loom,
                          r if r["tokens_per_s"] > torch_r["tokens_per_s"] else torch_r)
    rows = [(s[0], list(s[1:9]), *best[s[0]]) for s in sizes]
    sgemm = max(sgemm, run([args.binary, "--sgemm", "1024"], t, LOOM_ENV)["sgemm_gflops"])
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    print("CPU flags: %s; isa: %s; loom's sgemm kernel: %s; OPENBLAS_CORETYPE: %s" % (
        " ".join(x for x in ("avx2", "fma", "avx512f") if x in flags) or "none of avx2/fma/avx512f", args.isa,
        rows[0][2].get("sgemm", "?") if rows else "?",
        LOOM_ENV.get("OPENBLAS_CORETYPE", os.environ.get("OPENBLAS_CORETYPE", "(auto)"))))
    print("threads: %d, sgemm (n=1024, best of the run, on OpenBLAS's threads or split over loom's): %.1f GFLOP/s\n" % (t, sgemm))
    # "PyTorch of sgemm": PyTorch's model FLOP/s as a share of the same bar, so
    # sgemm / PyTorch GFLOP/s is the loom / PyTorch ratio an implementation running exactly at
    # the bar would show: the ceiling of the first ratio.
    print("| model | params | tokens/step | loom tok/s | PyTorch tok/s | loom / PyTorch | loom GFLOP/s | of sgemm "
          "| PyTorch of sgemm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (dim, layers, heads, kv, hidden, vocab, seq, batch), loom, torch_r in rows:
        ratio = loom["tokens_per_s"] / torch_r["tokens_per_s"]
        print("| %s (d%d L%d h%d/%d ff%d V%d S%d) | %.1fM | %d | %.0f | %.0f | %.2fx | %.1f | %.0f%% | %.0f%% |" % (
            name, dim, layers, heads, kv, hidden, vocab, seq, loom["params"] / 1e6, batch * seq,
            loom["tokens_per_s"], torch_r["tokens_per_s"], ratio, loom["gflops"], 100 * loom["gflops"] / sgemm,
            100 * torch_r["gflops"] / sgemm))
