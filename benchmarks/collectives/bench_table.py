#!/usr/bin/python3
"""Markdown tables from loom-bench-collectives --json files (two runs side by side).

Usage: python3 benchmarks/collectives/bench_table.py A.json B.json [--min-ratio-bytes 1048576]

Prints one row per (collective, size) with each run's loom busbw, baseline busbw and ratio
(the file's "ratio": the median over rounds of the paired per-round loom/baseline ratio),
then, for a raw-MPI baseline, a summary of the ratios at sizes >= --min-ratio-bytes.
"""
import argparse
import json
import statistics


def size_name(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div and b % div == 0:
            return "%d %s" % (b // div, unit)
    return "%d B" % b


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs=2)
    p.add_argument("--min-ratio-bytes", type=int, default=1 << 20)
    a = p.parse_args()
    runs = [json.load(open(f)) for f in a.files]
    labels = ["%s %d" % ("np" if r["comm"] == "mpi" else "ranks", r["ranks"]) for r in runs]
    base = "raw MPI" if runs[0]["comm"] == "mpi" else "memcpy"
    keyed = [{(row["coll"], row["size"]): row for row in r["rows"]} for r in runs]
    head = ["collective", "size"]
    for l in labels:
        head += ["%s loom busbw" % l, "%s %s busbw" % (l, base), "%s ratio" % l]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    ratios = []
    for key in sorted(keyed[0], key=lambda k: (runs[0]["rows"].index(keyed[0][k]))):
        cells = [key[0], size_name(key[1])]
        for k in keyed:
            row = k.get(key)
            if row is None or not row.get("baseline"):
                cells += ["", "", ""]
                continue
            cells += ["%.2f" % row["out_of_place"]["busbw"], "%.2f" % row["baseline"]["busbw"], "%.2f" % row["ratio"]]
            if key[1] >= a.min_ratio_bytes:
                ratios.append(row["ratio"])
        print("| " + " | ".join(cells) + " |")
    if ratios and base == "raw MPI":  # the 0.95 goal is against raw MPI; memcpy is a bound, not a goal
        print("\nAt >= %s: %d of %d rows >= 0.95; median %.2f, range %.2f-%.2f." % (
            size_name(a.min_ratio_bytes), sum(r >= 0.95 for r in ratios), len(ratios), statistics.median(ratios),
            min(ratios), max(ratios)))


if __name__ == "__main__":
    main()
