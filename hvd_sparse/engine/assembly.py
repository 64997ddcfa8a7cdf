"""The part of a step every PyTorch face shares, framework-free: gradients filed by key as they
arrive, the method's buckets over them (the plan), which bucket is complete and not started yet,
and when each became ready. A face maps its callbacks onto it -- Horovod's ``compress`` and
``decompress``, the DDP hook's buckets -- and drives the engine's protocols its own way (Horovod's
asynchronous handles, a worker thread with blocking collectives); the bookkeeping is written once.

``Plan`` lives across steps (it changes only when the set of gradients does, which a started
bucket forbids); ``Arrivals`` is one step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError

# (keys in a rank-independent order, their sizes, their dtypes) -> [(bucket, member keys)]
Planner = Callable[[list[str], list[int], list[str]], list[tuple[str, list[str]]]]


@dataclass
class Plan:
    """The method's buckets over the gradients: bucket -> member keys, and key -> (bucket,
    position in it)."""

    members: dict[str, list[str]] = field(default_factory=dict)
    bucket_of: dict[str, tuple[str, int]] = field(default_factory=dict)

    def covers(self, keys: Any) -> bool:
        """Whether the plan is over exactly these keys."""
        return set(keys) == set(self.bucket_of)

    def replan(self, planner: Planner, keys: list[str], sizes: list[int], dtypes: list[str],
               started: set[str]) -> None:
        """Plan again over ``keys`` (in a rank-independent order); a bucket already started this
        step must keep its members, else the set of gradients changed between steps."""
        plan = planner(keys, sizes, dtypes)
        members = {bucket: list(ks) for bucket, ks in plan}
        for bucket in started:
            if members.get(bucket) != self.members.get(bucket):
                raise ConfigurationError(
                    f"the set of gradients changed between steps (bucket {bucket!r} was "
                    f"{self.members.get(bucket)}, is now {members.get(bucket)}); a compressor "
                    "serves one fixed set of parameters: create a new one")
        self.members = members
        self.bucket_of = {key: (bucket, i) for bucket, ks in plan for i, key in enumerate(ks)}


@dataclass
class Arrivals:
    """One step's gradients as they arrive: by key, when (seconds after ``began``), and which
    planned buckets were started."""

    began: float = 0.0
    tensors: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)

    def file(self, key: str, tensor: Any, now: float) -> None:
        """Keep ``tensor`` under ``key``, arrived at ``now`` (a perf_counter reading)."""
        self.tensors[key] = tensor
        self.seconds[key] = now - self.began

    def complete(self, plan: Plan, bucket: str) -> bool:
        """Whether every member of ``bucket`` has arrived."""
        return all(key in self.tensors for key in plan.members[bucket])

    def ready(self, plan: Plan) -> list[str]:
        """The planned buckets complete and not started yet, in plan order."""
        return [bucket for bucket in plan.members
                if bucket not in self.started and self.complete(plan, bucket)]

    def take(self, plan: Plan, bucket: str) -> list[Any]:
        """Mark ``bucket`` started; its members' tensors, in bucket order."""
        self.started.add(bucket)
        return [self.tensors[key] for key in plan.members[bucket]]

    def missing(self, plan: Plan) -> list[str]:
        """The planned buckets that were never started."""
        return sorted(set(plan.members) - self.started)

    def ready_times(self, plan: Plan) -> dict[str, float]:
        """When each bucket's last member arrived (seconds after ``began``): what the method's
        once-per-step protocol learns the backward pass from (LAGS)."""
        return {bucket: max(self.seconds[key] for key in keys) for bucket, keys in plan.members.items()}
