"""bitsandbytes' NF4 quantisation, double quantisation and 8-bit blockwise quantisation,
transcribed from its algorithm (functional.py: create_dynamic_map, quantize_4bit,
dequantize_4bit, quantize_blockwise; kernels.cu: kQuantizeBlockwise, dQuantizeNF4, dQuantize),
the oracle of tests/quant/nf4_test.cpp. numpy float32 arithmetic, one IEEE rounding per
operation as on the GPU; the dynamic map is built with torch as bitsandbytes builds it.

usage: bnb_nf4_reference.py DIR
  DIR/params.txt: rows cols block_size absmax_block_size n8
  DIR/w.f32: rows * cols float32 (row-major); DIR/v8.f32: n8 float32 for the 8-bit quantiser
writes DIR/map.f32 (256), and for the weight without (nodq_*) and with (dq_*) double
quantisation: codes.u8, absmax.f32 (first level; dq: qabsmax.u8, offset.f32, absmax2.f32),
deq.f32; and codes8.u8 / absmax8.f32 for v8 in blocks of absmax_block_size.
"""
import sys
from decimal import Decimal
from fractions import Fraction

import numpy as np
import torch

f32 = np.float32


def create_dynamic_map():
    # create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for each exponent i,
    # the midpoints of linspace(0.1, 1, 2^i + 1) scaled by +-10^(i - 6), plus 0 and 1.0.
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mid = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * mid).tolist()
        data += (-(10 ** (-6 + i)) * mid).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256
    return np.array(sorted(data), dtype=f32)


def f32_literal(s):
    """The float32 a C/CUDA compiler makes of the literal `s`f: rounded once from the decimal.
    (np.float32(float(s)) rounds twice and takes the other neighbour for four of the NF4
    thresholds, which sit within 1e-17 of a float32 midpoint.)"""
    exact = Fraction(Decimal(s))
    a = f32(float(s))
    cands = [np.nextafter(a, f32(-np.inf)), a, np.nextafter(a, f32(np.inf))]
    return min(cands, key=lambda c: abs(Fraction(float(c)) - exact))


NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], dtype=f32)
# dQuantizeNF4's tree compares x > threshold at every node; its thresholds, ascending. Since the
# tree is monotone, the code is the number of thresholds x exceeds (0 for NaN).
THRESHOLDS = np.array([f32_literal(s) for s in [
    "-0.8480964004993439", "-0.6106329262256622", "-0.4599952697753906", "-0.33967943489551544",
    "-0.23460740596055984", "-0.13791173323988914", "-0.045525018125772476", "0.03979014977812767",
    "0.1202552504837513", "0.2035212516784668", "0.2920137718319893", "0.3893125355243683",
    "0.5016634166240692", "0.6427869200706482", "0.8614784181118011"]], dtype=f32)


def nf4_codes(scaled):
    return np.sum(scaled[:, None] > THRESHOLDS[None, :], axis=1).astype(np.uint8)


def dynamic_code(code, x):
    # dQuantize<0>: a search halving its step from 64, then the nearer by fp32 midpoint of the
    # landing entry and the last entry passed on x's side (bounds start at -1 and 1).
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = f32(-1.0), f32(1.0)
    val = code[pivot]
    step = 64
    while step > 0:
        if x > val:
            lower_pivot, lower = pivot, val
            pivot += step
        else:
            upper_pivot, upper = pivot, val
            pivot -= step
        val = code[pivot]
        step >>= 1
    if upper_pivot == 255:
        upper = code[255]
    if lower_pivot == 0:
        lower = code[0]
    if x > val:
        return upper_pivot if x > (upper + val) * f32(0.5) else pivot
    return lower_pivot if x < (lower + val) * f32(0.5) else pivot


def quantize_blockwise(code, x, block):
    # kQuantizeBlockwise (8-bit): absmax per block, values times the fp32 reciprocal
    nb = (x.size + block - 1) // block
    absmax = np.zeros(nb, dtype=f32)
    q = np.zeros(x.size, dtype=np.uint8)
    for b in range(nb):
        v = x[b * block:(b + 1) * block]
        absmax[b] = np.max(np.abs(v))
        inv = f32(1.0) / absmax[b]
        for i, e in enumerate(v * inv):
            q[b * block + i] = dynamic_code(code, e)
    return q, absmax


def quantize_nf4(w, block):
    blocks = w.reshape(-1, block)
    absmax = np.max(np.abs(blocks), axis=1).astype(f32)
    inv = f32(1.0) / absmax  # a zero block: inf, and 0 * inf = NaN -> code 0
    codes = nf4_codes((blocks * inv[:, None]).reshape(-1))
    return (codes[0::2] << 4 | codes[1::2]).astype(np.uint8), absmax


def dequantize_nf4(packed, absmax, block):
    codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)
    return (NF4[codes].reshape(-1, block) * absmax[:, None]).reshape(-1)


def main(d):
    rows, cols, block, block2, n8 = (int(t) for t in open(f"{d}/params.txt").read().split())
    w = np.fromfile(f"{d}/w.f32", dtype=f32, count=rows * cols)
    v8 = np.fromfile(f"{d}/v8.f32", dtype=f32, count=n8)
    code = create_dynamic_map()
    code.tofile(f"{d}/map.f32")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        packed, absmax = quantize_nf4(w, block)
        packed.tofile(f"{d}/nodq_codes.u8")
        absmax.tofile(f"{d}/nodq_absmax.f32")
        dequantize_nf4(packed, absmax, block).tofile(f"{d}/nodq_deq.f32")
        # quantize_4bit(compress_statistics=True): offset = mean(absmax) (here: a double sum in
        # block order, rounded once), absmax - offset quantised in blocks of block2
        s = 0.0
        for a in absmax:
            s += float(a)
        offset = f32(s / absmax.size)
        qabsmax, absmax2 = quantize_blockwise(code, absmax - offset, block2)
        packed.tofile(f"{d}/dq_codes.u8")
        qabsmax.tofile(f"{d}/dq_qabsmax.u8")
        np.array([offset], dtype=f32).tofile(f"{d}/dq_offset.f32")
        absmax2.tofile(f"{d}/dq_absmax2.f32")
        # dequantize_4bit: absmax = dequantize_blockwise(qabsmax, state2); absmax += offset
        deq_absmax = (code[qabsmax].reshape(-1) * np.repeat(absmax2, block2)[:qabsmax.size]) + offset
        dequantize_nf4(packed, deq_absmax.astype(f32), block).tofile(f"{d}/dq_deq.f32")
        q8, a8 = quantize_blockwise(code, v8, block2)
        q8.tofile(f"{d}/codes8.u8")
        a8.tofile(f"{d}/absmax8.f32")


if __name__ == "__main__":
    main(sys.argv[1])
