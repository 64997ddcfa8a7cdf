"""One step as every face assembles it, framework-free: gradients filed by key as they arrive,
the method's buckets over them (``Plan``), each bucket started on the engine as soon as it is
complete, every started bucket driven to completion, the once-per-step protocol, and a failed
step taken back. A face is an adapter: it maps its callbacks (Horovod's ``compress`` and
``decompress``, the DDP hook, TensorFlow's traced phases) onto ``StepAssembly`` and hands it a
``Driver``, its way of moving collectives (Horovod's asynchronous handles, blocking collectives on
a worker thread, graph ops).

``Plan`` lives across steps (it changes only when the set of gradients does, which a started
bucket forbids); ``Arrivals`` is one step's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from typing import Protocol as Interface

from ..algorithms.base import Algorithm
from ..backends import Backend
from ..comm import Phase, Protocol, run_blocking, run_together
from ..errors import ConfigurationError
from .core import Engine
from .planning import PACKED_BUCKET_ENTRIES, Buckets, face_plan, step_members

# (keys in a rank-independent order, their sizes, their dtypes) -> [(bucket, member keys)]
Planner = Callable[[list[str], list[int], list[str]], Buckets]


class Starts(Interface):
    """What takes a started bucket's protocol: a ``Driver``, or a graph that advances it phase by
    phase (TensorFlow's traced steps)."""

    def start(self, bucket: str, protocol: Protocol) -> None:
        """Take a started bucket's protocol (issue its first phase, or queue it)."""


class Driver(Starts, Interface):
    """How a face moves the collectives of the buckets it starts."""

    def finish(self) -> tuple[dict[str, Any], dict[str, Exception]]:
        """Drive every protocol taken since the last call to completion: (results, errors) by
        bucket, where the results may repeat buckets returned before in the step (Horovod's
        driver returns the step's; ``StepAssembly.finish`` counts each once). A protocol that
        raises must not stop the others (an error raised alike on every rank then leaves no
        collective half issued)."""
        ...

    def execute(self, phase: Phase) -> list:
        """Run one phase, blocking (the once-per-step protocol, the configuration check)."""
        ...


class Together:
    """A ``Driver`` over blocking collectives: started buckets wait, and ``finish`` runs them
    together, each phase of all of them joined into one (``run_together``)."""

    def __init__(self, execute: Callable[[Phase], list]):
        self.execute = execute
        self._queued: dict[str, Protocol] = {}

    def start(self, bucket: str, protocol: Protocol) -> None:
        """Queue the protocol until ``finish``."""
        self._queued[bucket] = protocol

    def finish(self) -> tuple[dict[str, Any], dict[str, Exception]]:
        """Run the queued protocols together, to completion."""
        queued, self._queued = self._queued, {}
        return run_together(queued, self.execute)


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


class StepAssembly:
    """A face's steps over one engine's buckets (module docstring): what arrived, what started,
    what finished and when, what a failure takes back.

    ``backend``: the gradients' (their sizes and dtypes); ``limit``: the most entries a bucket
    packing per-tensor steps holds (None: no limit)."""

    def __init__(self, algorithm: Algorithm, backend: Backend, limit: int | None = PACKED_BUCKET_ENTRIES):
        self.algorithm = algorithm
        self.backend = backend
        self.plan = Plan()
        self.arrivals = Arrivals()
        self.done: list[str] = []           # the buckets finished this step, in order
        self.results: dict[str, Any] = {}   # bucket -> its averaged tensors, where kept (``finish``)
        self.issued: dict[str, float] = {}   # bucket -> perf_counter when it was started
        self.completed: dict[str, float] = {}   # ... when its driver returned its result
        self._planner: Planner = partial(face_plan, algorithm, limit=limit)

    # --- arrivals and planning -------------------------------------------------------------------
    def begin(self, now: float) -> None:
        """A new step, whose first gradient arrived at ``now`` (perf_counter)."""
        self.arrivals = Arrivals(began=now)
        self.done, self.results, self.issued, self.completed = [], {}, {}, {}

    def replan(self, keys: list[str], sizes: list[int], dtypes: list[str]) -> None:
        """The method's buckets over ``keys`` (in a rank-independent order)."""
        self.plan.replan(self._planner, keys, sizes, dtypes, self.arrivals.started)

    def plan_arrived(self, order: Callable[[list[str]], list[str]]) -> None:
        """Plan over the gradients that arrived, in the rank-independent ``order`` of their keys,
        unless the plan is over exactly them already (first step, or a changed set of gradients)."""
        arrived = self.arrivals.tensors
        if not self.plan.covers(arrived):
            keys = order(list(arrived))
            self.replan(keys, [self.backend.numel(arrived[k]) for k in keys],
                        [self.backend.dtype_name(arrived[k]) for k in keys])

    def layout(self) -> list[tuple[str, tuple, str]]:
        """(key, shape, dtype) of every planned gradient that arrived, in plan order: what every
        rank must agree on (engine/agreement.py)."""
        arrived = self.arrivals.tensors
        return [(key, tuple(arrived[key].shape), self.backend.dtype_name(arrived[key]))
                for keys in self.plan.members.values() for key in keys]

    def file(self, key: str, tensor: Any, now: float) -> str | None:
        """Keep a gradient that arrived at ``now``; the bucket it completes, if planned."""
        self.arrivals.file(key, tensor, now)
        planned = self.plan.bucket_of.get(key)
        if planned is not None and self.arrivals.complete(self.plan, planned[0]):
            return planned[0]
        return None

    # --- running the buckets ---------------------------------------------------------------------
    def start(self, bucket: str, engine: Engine, driver: Starts, **step_options: Any) -> None:
        """Start ``bucket``'s step on the engine with its gradients; the driver moves it."""
        tensors = self.arrivals.take(self.plan, bucket)
        members = step_members(self.algorithm, self.plan.members[bucket])
        self.start_inputs(bucket, tensors, engine, driver, members=members, **step_options)

    def start_inputs(self, bucket: str, inputs: Any, engine: Engine, driver: Starts, **step_options: Any
                     ) -> None:
        """Start ``bucket``'s step on ``inputs`` the face gathered itself (TensorFlow hands a
        bucket's gradients over together, packed, from inside its graph)."""
        self.issued[bucket] = time.perf_counter()
        driver.start(bucket, engine.step(bucket, inputs, **step_options))

    def mark_done(self, bucket: str) -> None:
        """A bucket a graph drove to completion itself (TensorFlow's phased steps)."""
        self.done.append(bucket)
        self.completed[bucket] = time.perf_counter()

    def start_ready(self, engine: Engine, driver: Starts, **step_options: Any) -> list[str]:
        """Start every bucket complete and not started yet, in plan order; those buckets."""
        ready = self.arrivals.ready(self.plan)
        for bucket in ready:
            self.start(bucket, engine, driver, **step_options)
        return ready

    def finish(self, engine: Engine, driver: Driver, keep: bool = True) -> dict[str, Any]:
        """Drive every started bucket to completion; the buckets that finished now, with their
        averages, which ``result`` gives until the next step when ``keep`` (a face that copies
        them out at once passes False: they would hold a copy of the gradients). If any raised
        (alike on every rank: ``nonfinite="raise"``), every bucket that finished this step takes
        its step back, so it is applied nowhere, and the first error is raised once all have
        finished."""
        results, errors = driver.finish()
        done = time.perf_counter()
        new = [bucket for bucket in results if bucket not in self.completed]
        self.done += new
        self.completed.update(dict.fromkeys(new, done))
        if keep:
            self.results.update(results)
        if errors:
            self.take_back(engine)
            raise next(iter(errors.values()))
        return results

    def end(self, engine: Engine, driver: Driver) -> None:
        """The step's end: every planned bucket must have run; then the method's once-per-step
        protocol, told when each bucket became ready. A failure takes the step back."""
        missing = self.arrivals.missing(self.plan)
        try:
            if missing:
                raise ConfigurationError(
                    f"the step ended without the gradients of {missing[:5]}; a compressor (or DDP "
                    "state) serves one fixed set of parameters: create a new one")
            run_blocking(engine.end_step(self.arrivals.ready_times(self.plan)), driver.execute)
        except Exception:
            self.take_back(engine)
            raise

    def take_back(self, engine: Engine) -> None:
        """Undo the step of every bucket that finished this step (at most once)."""
        finished, self.done, self.results = self.done, [], {}
        engine.take_back(finished)

    def result(self, key: str) -> Any:
        """The average of gradient ``key`` (its bucket finished this step)."""
        bucket, position = self.plan.bucket_of[key]
        return self.results[bucket][position]

    def timeline(self) -> dict[str, tuple[float, float | None]]:
        """This step's buckets: (started, finished or None), seconds after the step began."""
        began = self.arrivals.began
        return {bucket: (issued - began, self.completed[bucket] - began if bucket in self.completed else None)
                for bucket, issued in self.issued.items()}
