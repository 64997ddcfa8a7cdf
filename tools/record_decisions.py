"""Record every method's decisions in a short simulator run, to show that a change of code keeps
them (issue 21: "the simulator records of every method before and after the change agree").

Each configuration trains ``hvd_sparse.sim``'s digits CNN for a few steps at N = 4; every
collective a rank issues (its name and the exact bytes it sends: selected indices, values,
riders) is hashed per step, with the step's record (counts, thresholds, partitions, residual
norms) and the parameters after the step. Same hashes, same decisions.

    python tools/record_decisions.py --out before.json
    ... change the code ...
    python tools/record_decisions.py --compare before.json    # exit 1, naming the first difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any
from unittest import mock

import numpy as np

from hvd_sparse import sim
from hvd_sparse.comm import local

# (label, method, options): every registered method, and the variants with code paths of their own.
CONFIGS = [
    ("topk/tensor", "topk", {}),
    ("topk/model", "topk", {"scope": "model"}),
    ("randomk/shared", "randomk", {"shared_seed": True}),
    ("randomk/tensor", "randomk", {}),
    ("threshold/model", "threshold", {}),
    ("gaussiank/original", "gaussiank", {}),
    ("gaussiank/original-model", "gaussiank", {"scope": "model"}),
    ("gaussiank/rescale", "gaussiank", {"variant": "rescale"}),
    ("dgc", "dgc", {}),
    ("lags", "lags", {}),
    ("deft", "deft", {}),
    ("micro", "micro", {}),
    ("micro/tracking-local", "micro", {"threshold_scaling": "tracking", "threshold_start": "local"}),
    ("exdyna", "exdyna", {}),
    ("exdyna/neighbour", "exdyna", {"rebalance": "neighbour"}),
    ("exdyna/histogram", "exdyna", {"rebalance": "histogram"}),
    ("exdyna/corrections", "exdyna", {"momentum": 0.9, "warmup_steps": 3, "dense_below": 100}),
    ("topk/corrections", "topk", {"momentum": 0.9, "nesterov": True, "dense_steps": 2}),
    ("dense", "dense", {}),
]


class Recorder:
    """Wraps ``LocalGroup._collective`` to hash what every rank sends in each collective."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.original = local.LocalGroup._collective

    def recording(self, group: local.LocalGroup, first: Any, tensors: list) -> list:
        """Hash the collective's name and every rank's tensor, then run it."""
        self.digest.update(f"{first.op}:{first.name}:{first.root}".encode())
        for tensor in tensors:
            array = np.ascontiguousarray(group.backend.to_numpy(tensor))
            self.digest.update(f"{array.dtype}{array.shape}".encode())
            self.digest.update(array.tobytes())
        return self.original(group, first, tensors)

    def __enter__(self) -> Recorder:
        recorder = self

        def recording(group: local.LocalGroup, first: Any, tensors: list) -> list:
            return recorder.recording(group, first, tensors)

        self.patch = mock.patch.object(local.LocalGroup, "_collective", recording)
        self.patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.patch.stop()

    def step_hash(self, record: dict) -> str:
        """The digest of the step's collectives and its record (less its wall time); restarts."""
        facts = {key: value for key, value in record.items() if key != "seconds"}
        self.digest.update(json.dumps(facts, sort_keys=True, default=str).encode())
        out = self.digest.hexdigest()[:16]
        self.digest = hashlib.sha256()
        return out


def record(steps: int) -> dict[str, list[str]]:
    """Per configuration, one hash per step."""
    out = {}
    for label, method, options in CONFIGS:
        with Recorder() as recorder:
            hashes: list[str] = []
            sim.simulate(method, 4, steps, density=0.02, task="digits", seed=1, options=options,
                         momentum=0.0 if options.get("momentum") else 0.9,
                         on_record=lambda r, rec=recorder, h=hashes: h.append(rec.step_hash(r)))
        out[label] = hashes
        print(f"{label:28} {hashes[-1]}", flush=True)
    return out


def main() -> None:
    """Record to ``--out``, or compare with ``--compare``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", help="write the hashes here (JSON)")
    parser.add_argument("--compare", help="compare with hashes written before (JSON)")
    args = parser.parse_args()
    hashes = record(args.steps)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(hashes, f, indent=1)
    if args.compare:
        with open(args.compare, encoding="utf-8") as f:
            before = json.load(f)
        for label, steps in before.items():
            now = hashes.get(label)
            if now != steps:
                first = next((i for i, (a, b) in enumerate(zip(steps, now or [], strict=False)) if a != b), 0)
                sys.exit(f"{label}: decisions differ from step {first} on")
        print(f"identical: {len(before)} configurations, {args.steps} steps each")


if __name__ == "__main__":
    main()
