"""Evidence for grouped_quantize_persistent.patch (delete with it): find_span (grouped_tile.cuh, each CTA's
warp scan of the group sizes) and the patch's table_span (the table in shared memory, a binary search)
transliterated to Python and compared on generated sizes, M and block rows: python3 grouped_span_check.py."""
import numpy as np
T, CA = 128, 16
def cdiv(a, b): return -(-a // b)
def find_span(sizes, M, Mc, S, x):
    rows_before = slots_before = cols_before = 0
    for g0 in range(0, len(sizes), 32):
        chunk = [min(max(int(s), 0), M) for s in sizes[g0:g0+32]]
        for i, size in enumerate(chunk):
            incl = sum(chunk[:i+1]) + rows_before
            end, beg = min(M, incl), min(M, incl - size)
            n = cdiv(end - beg, T)
            ns = [cdiv(min(M, sum(chunk[:j+1]) + rows_before) - min(M, sum(chunk[:j+1]) + rows_before - chunk[j]), T) for j in range(i+1)]
            nincl = sum(ns) + slots_before
            ws = [cdiv(min(M, sum(chunk[:j+1]) + rows_before) - min(M, sum(chunk[:j+1]) + rows_before - chunk[j]), CA) * CA for j in range(i+1)]
            cincl = sum(ws) + cols_before
            width = ws[-1]
            if x < S and nincl - n <= x < nincl:
                off = (x - (nincl - n)) * T
                s0 = beg + off
                return (s0, min(end, s0 + T), cincl - width + off, min(cincl, cincl - width + off + T))
        # carries
        last = len(chunk) - 1
        incl = sum(chunk) + rows_before
        ns = [cdiv(min(M, sum(chunk[:j+1]) + rows_before) - min(M, sum(chunk[:j+1]) + rows_before - chunk[j]), T) for j in range(len(chunk))]
        ws = [cdiv(min(M, sum(chunk[:j+1]) + rows_before) - min(M, sum(chunk[:j+1]) + rows_before - chunk[j]), CA) * CA for j in range(len(chunk))]
        rows_before, slots_before, cols_before = incl, slots_before + sum(ns), cols_before + sum(ws)
    if x < S: return (M, M, Mc, Mc)
    off = (x - S) * T
    s0 = min(M, min(M, rows_before) + off); c0 = min(Mc, cols_before + off)
    return (s0, min(M, s0 + T), c0, min(Mc, c0 + T))
def table(sizes, M):
    beg, end, se, ce = [], [], [], []
    rb = sb = cb = 0
    for s in sizes:
        size = min(max(int(s), 0), M); incl = rb + size
        e, b = min(M, incl), min(M, incl - size)
        sb += cdiv(e - b, T); cb += cdiv(e - b, CA) * CA; rb = incl
        beg.append(b); end.append(e); se.append(sb); ce.append(cb)
    return beg, end, se, ce, rb, sb, cb
def table_span(t, G, M, Mc, S, x):
    beg, end, se, ce, rt, st, ct = t
    if x >= S:
        off = (x - S) * T; s0 = min(M, min(M, rt) + off); c0 = min(Mc, ct + off)
        return (s0, min(M, s0 + T), c0, min(Mc, c0 + T))
    if x >= st: return (M, M, Mc, Mc)
    lo, hi = 0, G - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if se[mid] > x: hi = mid
        else: lo = mid + 1
    rows = end[lo] - beg[lo]; n = cdiv(rows, T); width = cdiv(rows, CA) * CA; off = (x - (se[lo] - n)) * T
    s0 = beg[lo] + off; c0 = ce[lo] - width + off
    return (s0, min(end[lo], s0 + T), c0, min(ce[lo], c0 + T))
rng = np.random.default_rng(0)
def block_slots(M, G, bm):
    n = min(G, M); return n + (M - n) // bm if n > 0 else 0
n = 0
for trial in range(400):
    G = int(rng.integers(1, 70)); M = int(rng.integers(1, 1200))
    kind = trial % 4
    if kind == 0: sizes = rng.integers(0, 2 * M // G + 2, G)
    elif kind == 1: sizes = rng.integers(-5, 300, G)
    elif kind == 2: sizes = np.zeros(G, int); sizes[rng.integers(G)] = M
    else: sizes = (rng.integers(0, 5, G) * 128)
    S = block_slots(M, G, T); Mc = CA * block_slots(M, G, CA)
    t = table(sizes, M)
    for x in range(S + cdiv(Mc, T)):
        a, b = find_span(list(sizes), M, Mc, S, x), table_span(t, G, M, Mc, S, x)
        assert a == b, (trial, G, M, list(sizes), x, a, b); n += 1
print("ok", n)
