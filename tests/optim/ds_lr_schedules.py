# Oracle for optim_lr_schedule_test: DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR
# rules as their documentation states them, written out in plain Python (not loom's code).
# usage: ds_lr_schedules.py <type> <n_iterations> key=value ...   prints one lr per line
# for last_batch_iteration = 0 .. n-1.
import math
import sys

kind, n = sys.argv[1], int(sys.argv[2])
kw = dict(a.split("=") for a in sys.argv[3:])


def f(k, d):
    return float(kw.get(k, d))


def warm_gamma(i, w, typ):
    if typ == "log":
        return math.log(i + 1) / math.log(w)
    return i / w


typ = kw.get("warmup_type", "log")
w = max(2, int(f("warmup_num_steps", 1000)))
for i in range(n):
    if kind == "WarmupLR":
        lo, hi = f("warmup_min_lr", 0), f("warmup_max_lr", 1e-3)
        g = warm_gamma(i, w, typ) if i < w else 1.0
        lr = lo + (hi - lo) * g
    elif kind == "WarmupDecayLR":
        lo, hi, total = f("warmup_min_lr", 0), f("warmup_max_lr", 1e-3), int(f("total_num_steps", 0))
        g = warm_gamma(i, w, typ) if i < w else max(0.0, (total - i) / max(1.0, total - w))
        lr = lo + (hi - lo) * g
    elif kind == "WarmupCosineLR":
        base, total = f("base_lr", 1e-3), int(f("total_num_steps", 0))
        wmin, cmin = f("warmup_min_ratio", 0), f("cos_min_ratio", 1e-4)
        if i < w:
            r = wmin + warm_gamma(i, w, typ) * (1 - wmin)
        else:
            r = (1 + math.cos(math.pi * (i - w + 1) / (total - w))) / 2
            r = max(0.0, cmin + (1 - cmin) * r)
        lr = base * r
    print(repr(lr))
