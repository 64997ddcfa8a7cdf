"""Independent NumPy reference of one DEFT step (docs/algorithms.md#deft), for the tests.

Written from the specification, not from hvd_sparse, with plain loops: the unit table, every
rank's norm-proportional k split from its own accumulated vector, the master's largest-first
packing by linear scans, the rotating bin assignment, top-k by a full sort inside each owned
unit, and the union with the common units. Two conventions are the package's own and are
re-stated here: norms are taken at float32 precision, and a rank whose bin is empty sends the
i-th common index (i-th such rank in rank order), which the union then does not repeat.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def units(tensor_sizes: list[int], size: int) -> list[tuple[int, int]]:
    """(start, end) of every unit: tensors larger than n/N split into N near-equal parts."""
    n = sum(tensor_sizes)
    out, pos = [], 0
    for s in tensor_sizes:
        if s > n / size:
            for i in range(size):
                part = s // size + (1 if i < s % size else 0)
                if part:
                    out.append((pos, pos + part))
                pos += part
        else:
            if s:
                out.append((pos, pos + s))
            pos += s
    return out


def k_split(norms: list[float], lengths: list[int], k: int) -> list[int]:
    order = list(np.argsort(np.array(norms), kind="stable"))[::-1]
    rk, rw = k, sum(norms)
    ks = [0] * len(norms)
    for u in order:
        q = int(rk * (norms[u] / rw)) if rw > 0 else 0
        ks[u] = lengths[u] if lengths[u] < q else max(1, q)
        rk -= ks[u]
        rw -= norms[u]
    return ks


def pack(ks: list[int], lengths: list[int], bins: int) -> tuple[list[list[int]], list[int]]:
    cost = [lengths[u] * math.log2(ks[u]) if ks[u] > 1 else float(lengths[u]) for u in range(len(ks))]
    load = [0.0] * bins
    packed: list[list[int]] = [[] for _ in range(bins)]
    common = []
    for _ in range(len(ks)):
        u = max(range(len(ks)), key=lambda i: (cost[i], -i))
        b = min(range(bins), key=lambda j: (load[j], j))
        if ks[u] == lengths[u]:
            common.append(u)
        else:
            packed[b].append(u)
            load[b] += cost[u]
        cost[u] = -1.0
    return packed, common


@dataclass
class DeftStep:
    average: np.ndarray            # the applied gradient (mean over ranks on the union)
    residuals: list[np.ndarray]    # every rank's new residual
    counts: list[int]              # indices each rank sent
    union: int
    common: int                    # common entries appended besides the gathered ones
    fallback: int                  # ranks whose bin was empty


def deft_step(accs: list[np.ndarray], tensor_sizes: list[int], density: float, step: int,
              agreed_k: bool = False) -> DeftStep:
    size, n = len(accs), accs[0].size
    table = units(tensor_sizes, size)
    lengths = [e - s for s, e in table]
    k = int(density * n)
    rank_ks = []
    for acc in accs:
        norms = [float(np.float32(np.linalg.norm(acc[s:e].astype(np.float64)))) for s, e in table]
        rank_ks.append(k_split(norms, lengths, k))
    master = step % size
    bins, common = pack(rank_ks[master], lengths, size)
    common_idx = [i for u in common for i in range(*table[u])]
    selections, spare = [], 0
    for r in range(size):
        ks = rank_ks[master] if agreed_k else rank_ks[r]
        own = bins[(master + r) % size]
        sel = []
        for u in own:
            s, e = table[u]
            largest_first = np.argsort(-np.abs(accs[r][s:e]), kind="stable")
            sel.extend(s + int(i) for i in largest_first[:ks[u]])
        if not own:
            sel = [common_idx[spare]]
            spare += 1
        selections.append(sel)
    union = [i for sel in selections for i in sel] + common_idx[spare:]
    assert len(set(union)) == len(union), "reference union has duplicates"
    union_arr = np.array(union, dtype=np.int64)
    total = np.zeros(n, dtype=np.float64)
    residuals = []
    for acc in accs:
        total[union_arr] += acc[union_arr].astype(np.float64)
        residual = acc.copy()
        residual[union_arr] = 0
        residuals.append(residual)
    return DeftStep((total / size).astype(np.float32), residuals, [len(s) for s in selections],
                    len(union), len(common_idx) - spare, spare)
