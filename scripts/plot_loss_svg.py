#!/usr/bin/env python3
"""A llama-train log's loss curve as a plain SVG (no plotting library needed).

Reads the progress lines ("step 12/300 | loss 2.3456 | ...") and the phase lines that a run
with progressive unfreezing prints ("step 91/300: training groups top middle; frozen base"),
and draws the loss per step with each phase change as a dashed vertical line labelled with
the groups that train from there.

usage: plot_loss_svg.py [--log] LOG OUT.svg [TITLE]   (--log: a logarithmic loss axis)
"""
import html
import math
import re
import sys


def parse(lines):
    loss, phases = [], []
    for line in lines:
        m = re.match(r"step (\d+)/\d+ \| loss ([0-9.eE+-]+)", line)
        if m:
            loss.append((int(m.group(1)), float(m.group(2))))
        m = re.match(r"step (\d+)/\d+: training groups (.*?)(; frozen .*)?$", line)
        if m:
            phases.append((int(m.group(1)), m.group(2).strip()))
    return loss, phases


def svg(loss, phases, title, log=False, w=760, h=360, left=60, right=20, top=40, bottom=50):
    if not loss:
        raise SystemExit("plot_loss_svg.py: the log has no 'step N/T | loss X' line")
    x0, x1 = loss[0][0], max(loss[-1][0], loss[0][0] + 1)
    f = math.log10 if log else (lambda v: v)
    lo, hi = min(f(v) for _, v in loss), max(f(v) for _, v in loss)
    pad = 0.05 * (hi - lo or 1.0)
    lo, hi = lo - pad, hi + pad
    sx = lambda s: left + (s - x0) / (x1 - x0) * (w - left - right)
    sy = lambda v: top + (hi - f(v)) / (hi - lo) * (h - top - bottom)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(title)}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#333"/>']
    for k in range(5):  # ticks
        y = lo + (hi - lo) * k / 4
        v = 10**y if log else y
        out.append(f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        s = x0 + (x1 - x0) * k / 4
        out.append(f'<text x="{sx(s):.1f}" y="{h - bottom + 16}" text-anchor="middle">{s:.0f}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">optimizer step</text>')
    ylabel = "training loss (log scale)" if log else "training loss"
    out.append(f'<text x="16" y="{h / 2}" text-anchor="middle" transform="rotate(-90 16 {h / 2})">{ylabel}</text>')
    for i, (s, groups) in enumerate(phases):
        x = sx(max(s - 0.5, x0)) if i else sx(x0)
        if i:
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{h - bottom}" stroke="#b3742a" stroke-dasharray="5,4"/>')
        out.append(f'<text x="{x + 4:.1f}" y="{top + 14 + 14 * (i % 2)}" fill="#b3742a">{html.escape(groups)}</text>')
    pts = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in loss)
    out.append(f'<polyline points="{pts}" fill="none" stroke="#35609c" stroke-width="1.5"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    log = "--log" in args
    args = [a for a in args if a != "--log"]
    if len(args) not in (2, 3):
        raise SystemExit(__doc__)
    with open(args[0]) as f:
        loss, phases = parse(f)
    with open(args[1], "w") as f:
        f.write(svg(loss, phases, args[2] if len(args) == 3 else "loss", log))
