"""Do all ranks run the same compressor on the same model? One check at the first step.

A rank that builds another method, another density or another model than the others would
either hang a job (its collectives have other names or shapes) or, worse, train on silently: two
ranks running ExDyna at different densities use different thresholds. So before its first
exchange every rank describes its configuration -- the method, its hyper-parameters, the face's
options and the parameter layout (name, shape and dtype of every tensor, in order) -- as a few
fields, and the ranks compare them:

1. one allgather of a small int64 vector: a digest of each field, and the length of the text of
   all fields;
2. only when some digest differs, one allgather of every rank's text, so that every rank can
   say what differs, and on which ranks.

Both steps are decided from gathered data, identical on every rank, so every rank issues the
same collectives and every rank raises the same ``RankMismatchError``.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import re
from typing import Any

import numpy as np

from ..comm import ALLGATHER, Collective, Protocol
from ..errors import RankMismatchError

FIELDS = ("method", "hyper-parameters", "options", "layout")

# A layout: one (name, shape, dtype) per tensor, in order; None where this rank cannot know it.
Layout = list[tuple[str, tuple[int, ...], str]] | None


def config_fields(method: str, hyperparameters: dict, options: dict, layout: Layout) -> dict:
    """The compared fields, as plain JSON-able data (option values as text)."""
    return {
        "method": method,
        "hyper-parameters": {k: _plain(v) for k, v in sorted(hyperparameters.items())},
        "options": {k: _plain(v) for k, v in sorted(options.items())},
        "layout": None if layout is None else [[name, list(shape), dtype] for name, shape, dtype in layout],
    }


def _plain(value: Any) -> str:
    """A value's text, NumPy scalars as the Python numbers they equal (``np.int64(8)`` -> ``8``)."""
    if isinstance(value, (bool, np.bool_)):
        return repr(bool(value))
    if isinstance(value, numbers.Integral):
        return repr(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    return repr(value)


def _digest(value: Any) -> int:
    text = json.dumps(value, sort_keys=True).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "little")


def agree(fields: dict, backend: Any, like: Any, name: str, rank: int) -> Protocol:
    """Protocol: raise ``RankMismatchError`` on every rank unless every rank's ``fields`` are
    equal. Costs one tiny allgather when they are (two when they are not)."""
    text = json.dumps(fields, sort_keys=True).encode()
    mine = np.array([_digest(fields[f]) for f in FIELDS] + [len(text)], dtype=np.int64)
    (gathered,) = yield [Collective(ALLGATHER, f"{name}.config", backend.from_numpy(mine, like=like))]
    table = backend.to_numpy(gathered).reshape(-1, len(FIELDS) + 1)
    if (table[:, :-1] == table[0, :-1]).all():
        return
    payload = backend.from_numpy(np.frombuffer(text, dtype=np.uint8).copy(), like=like)
    (texts,) = yield [Collective(ALLGATHER, f"{name}.config_text", payload)]
    raw = backend.to_numpy(texts).tobytes()
    ends = np.cumsum(table[:, -1])
    configs = [json.loads(raw[end - length:end]) for end, length in zip(ends, table[:, -1], strict=True)]
    raise RankMismatchError(describe_disagreement(configs, rank))


def describe_disagreement(configs: list[dict], rank: int) -> str:
    """What differs between the ranks' configurations (one dict of ``FIELDS`` per rank), and the
    fix; the same text on every rank but for the line naming ``rank``."""
    reference = configs[0]
    lines = []
    for field in FIELDS:
        odd = [r for r, c in enumerate(configs) if c[field] != reference[field]]
        if odd:
            lines.append(_describe_field(field, configs, odd))
    return (f"hvd_sparse: the ranks' compressors disagree (seen on rank {rank}, before any gradient "
            "was exchanged):\n  " + "\n  ".join(lines) +
            "\nEvery rank must build the same compressor, with the same options, for the same model.")


def _describe_field(field: str, configs: list[dict], odd: list[int]) -> str:
    first = odd[0]
    mine, theirs = configs[0][field], configs[first][field]
    if field == "method":
        return f"method: rank 0 runs {mine!r}, ranks {odd} run {theirs!r} (rank {first})"
    if field in ("hyper-parameters", "options"):
        keys = sorted(set(mine) | set(theirs))
        diffs = [f"{k}={mine.get(k, '-')} on rank 0, {theirs.get(k, '-')} on rank {first}"
                 for k in keys if mine.get(k) != theirs.get(k)]
        return f"{field} differ on ranks {odd}: " + "; ".join(diffs)
    return _describe_layout(mine, theirs, odd, first)


def _describe_layout(mine: list | None, theirs: list | None, odd: list[int], first: int) -> str:
    if mine is None or theirs is None:
        has = "rank 0" if mine is not None else f"rank {first}"
        return (f"layout: named_parameters was passed to the compressor on {has} but not on all "
                "ranks: pass it on every rank")
    names, their_names = [t[0] for t in mine], [t[0] for t in theirs]
    if len(mine) != len(theirs) or set(names) != set(their_names):
        extra = [n for n in their_names if n not in names]
        missing = [n for n in names if n not in their_names]
        return (f"model: rank 0 has {len(mine)} tensors, rank {first} {len(theirs)} (ranks {odd} "
                f"differ); only on rank {first}: {extra[:5]}; only on rank 0: {missing[:5]}: "
                "every rank must train the same model")
    if names != their_names:
        return (f"parameter order differs on ranks {odd} (rank 0: {names[:6]}..., rank {first}: "
                f"{their_names[:6]}...): build the model, and pass named_parameters, in the same "
                "order on every rank")
    other = {t[0]: (t[1], t[2]) for t in theirs}
    diffs = [f"{n} {shape} {dtype} on rank 0, {other[n][0]} {other[n][1]} on rank {first}"
             for n, shape, dtype in mine if (shape, dtype) != other[n]]
    # PyTorch without named_parameters names gradients by their arrival ("t0", "t1", ...): a rank
    # whose backward hooks ran in another order shows the same model with shapes in another order.
    by_arrival = all(re.fullmatch(r"t\d+", n) for n in names)
    return (f"tensor shapes or dtypes differ on ranks {odd}: " + "; ".join(diffs[:5]) +
            ": every rank must train the same model" +
            (" (if they do, pass named_parameters to the compressor so that gradients are matched by "
             "name, not by the order of the backward hooks)" if by_arrival else ""))


def layout_of(backend: Any, key: str, tensors: list[Any]) -> Layout:
    """A bucket's layout for ``Engine.agree_on_config``: its tensors' (name, shape, dtype)."""
    return [(f"{key}[{i}]" if len(tensors) > 1 else key, tuple(int(d) for d in t.shape),
             backend.dtype_name(t)) for i, t in enumerate(tensors)]
