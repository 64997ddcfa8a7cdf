"""The TensorFlow face's step graphs: how the steps of the buckets a trace holds become graph
ops, and what runs inside them every step (docs/architecture.md#tensorflow-face).

Horovod calls the compressor while it *traces* its allreduce function, so Python here runs once
per trace, not once per step; the engine's step is eager Python, embedded with
``tf.py_function``, which runs every step, through the step assembly (engine/assembly.py):

* phased graphs: each bucket's step becomes py_function phases joined by Horovod graph
  collectives (asynchronous kernels, matched by name), phase p of every bucket built together in
  one py_function; the graph is the driver that advances each protocol;
* one py_function with eager, blocking collectives, bucket after bucket, where a step's phases are
  not known before it runs (whole-model scope, ``dense_steps``, collectives while selecting).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from ..algorithms.base import MODEL, Algorithm
from ..backends import get_backend
from ..backends.tf_backend import Packed, unpack
from ..comm import Collective, Protocol
from ..comm.horovod_tf import HorovodTFComm
from ..engine import Engine
from ..engine.assembly import StepAssembly, Together
from ..engine.planning import pack_tensors, plan_buckets, step_members
from ..errors import ConfigurationError, RankMismatchError


def _specs(tensors: list) -> tuple:
    """The specs of a bucket's gradients (what the engine reads of each: shape and dtype)."""
    return tuple(tf.TensorSpec(t.shape, t.dtype) for t in tensors)


def _parts_of(average: Any, inputs: Any) -> list:
    """A bucket step's average (fp32), one tensor per gradient, any shape (the graph's ``unpack``
    shapes them): ``Packed.parts``, or the inputs themselves for a bucket the engine returned
    untouched (every tensor empty). No eager op where the part is fp32 already."""
    parts = average.parts if isinstance(average, Packed) else inputs
    return [p if p.dtype == tf.float32 else tf.cast(p, tf.float32) for p in parts]


class StepGraphs:
    """The step graphs of one compressor. ``engine`` and ``comm`` give the compressor's current
    ones (new after an elastic reset); ``begin_step`` runs at each step's start, at run time
    (the compressor follows the world there)."""

    def __init__(self, algorithm: Algorithm, engine: Callable[[], Engine],
                 comm: Callable[[], HorovodTFComm], begin_step: Callable[[], None]):
        self.algorithm = algorithm
        # Buckets here are planned per trace (``bucket_graphs``, ``tensor_graphs``); the assembly
        # starts them, finishes the blocking ones and takes a failed step back.
        self.assembly = StepAssembly(algorithm, get_backend("tensorflow"))
        self.members: dict[str, tuple[str, ...]] = {}   # bucket -> its gradients' keys, if it packs them
        self._engine, self._comm, self._begin_step = engine, comm, begin_step
        self._inflight: dict[str, Protocol] = {}        # run time: the bucket protocols in flight

    # --- graph construction (trace time) ----------------------------------------------------------
    def bucket_graphs(self, grads: list) -> list:
        """Outputs for every stashed gradient, bucketed by the algorithm's plan. Whole-model
        scope -- one bucket, or the model and the ``dense_below`` bucket -- runs in one
        py_function with blocking collectives, bucket after bucket: any protocol works there (one
        that selects with a broadcast, or averages densely for its first ``dense_steps``), and a
        step that raises is taken back whole. Merged groups run as phased graphs, which may
        complete in any order, unless some group's phases are not known before it runs; then
        they too run in one py_function."""
        keys = [f"g{i}" for i in range(len(grads))]
        plan = plan_buckets(self.algorithm, keys, [g.shape.num_elements() for g in grads])
        position = {key: i for i, key in enumerate(keys)}
        buckets = [(bucket, [grads[position[key]] for key in members]) for bucket, members in plan]
        if self.algorithm.scope == MODEL or len(plan) == 1 or not self._phases_known(buckets):
            inputs = [t for _, tensors in buckets for t in tensors]
            averages = tf.py_function(
                functools.partial(self._run_blocking, [(bucket, _specs(ts)) for bucket, ts in buckets]),
                inputs, Tout=[tf.float32] * len(inputs))   # the average is fp32 (engine/patterns.py)
            results, offset = [], 0
            for _, tensors in buckets:
                results.append(unpack(averages[offset:offset + len(tensors)], _specs(tensors)))
                offset += len(tensors)
        else:
            results = self._phased_graphs(buckets)
        outputs: list = [None] * len(grads)
        for (_, members), (_, tensors), outs in zip(plan, buckets, results, strict=True):
            for key, out, grad in zip(members, outs, tensors, strict=True):
                out.set_shape(grad.shape)
                outputs[position[key]] = out
        return outputs

    def tensor_graphs(self, grads: list, first: int) -> list:
        """Scope "tensor": the outputs of ``grads`` (the stash's from position ``first`` on), their
        steps built as phased graphs. A method that packs per-tensor steps
        (``Algorithm.packs_tensors``) takes the gradients of each dtype in one bucket
        (``planning.pack_tensors`` without a limit), selecting in each as in a bucket of its own: a step's
        cost in the graph and in the engine is per bucket, and a bucket per gradient cost
        ResNet-18 a tenth of its step on loopback (docs/architecture.md#tensorflow-face).
        Gradients under ``dense_below`` (averaged densely) and empty ones keep buckets of their
        own, as does every gradient otherwise."""
        keys = [f"g{p}" for p in range(first, first + len(grads))]
        by_key = dict(zip(keys, grads, strict=True))
        plan = pack_tensors(self.algorithm, [(key, [key]) for key in keys],
                            {key: g.shape.num_elements() for key, g in by_key.items()},
                            {key: g.dtype.name for key, g in by_key.items()})
        for bucket, members in plan:
            self.members[bucket] = step_members(self.algorithm, members)
        outputs = self._phased_graphs([(bucket, [by_key[k] for k in members]) for bucket, members in plan])
        position = {key: i for i, key in enumerate(keys)}
        result: list = [None] * len(grads)
        for (_, members), outs in zip(plan, outputs, strict=True):
            for key, out in zip(members, outs, strict=True):
                result[position[key]] = out
        return result

    def _phases_known(self, buckets: list) -> bool:
        """Whether every bucket's phases are known before it runs (``Engine.schedule``), so that
        it can be built as a phased graph: not with ``dense_steps`` (the collectives change after
        them) or a method that exchanges messages while selecting."""
        try:
            for bucket, tensors in buckets:
                sizes = tuple(t.shape.num_elements() for t in tensors)
                self._engine().schedule(bucket, sum(sizes), tuple(t.dtype.name for t in tensors), sizes)
        except ConfigurationError:
            return False
        return True

    def _phased_graphs(self, buckets: list) -> list:
        """The steps of ``buckets`` ((key, tensors), in plan order) as phased graphs, every
        bucket's phase p in one py_function (a bucket whose schedule is shorter finishes in the
        py_function after its last phase), joined by each phase's Horovod graph collectives, which
        Horovod matches by name; each bucket's averaged tensors."""
        schedules = [self._engine().schedule(key, sum(t.shape.num_elements() for t in ts),
                                             tuple(t.dtype.name for t in ts),
                                             tuple(t.shape.num_elements() for t in ts))
                     for key, ts in buckets]
        specs = [_specs(ts) for _, ts in buckets]
        inputs: list = [list(ts) for _, ts in buckets]
        outputs: list = [None] * len(buckets)
        for position in range(max(len(s) for s in schedules) + 1):
            active = [i for i, s in enumerate(schedules) if position <= len(s)]
            plan = [(buckets[i][0], schedules[i][position] if position < len(schedules[i]) else None,
                     specs[i], len(inputs[i])) for i in active]
            tout = [dtype for _, phase, specs_i, _ in plan
                    for _, _, dtype in phase or [(None, None, tf.float32)] * len(specs_i)]
            flat = tf.py_function(functools.partial(self._advance_all, position, plan),
                                  [t for i in active for t in inputs[i]], Tout=tout)
            offset = 0
            for i, (_, phase, _, _) in zip(active, plan, strict=True):
                if phase is None:   # finished: the fp32 average, a tensor per gradient (engine/patterns.py)
                    outputs[i] = unpack(flat[offset:offset + len(specs[i])], specs[i])
                    offset += len(specs[i])
                    continue
                inputs[i] = [self._comm().graph_op(op, t, name) for (op, name, _), t in
                             zip(phase, flat[offset:offset + len(phase)], strict=True)]
                offset += len(phase)
        for outs, (_, tensors) in zip(outputs, buckets, strict=True):
            for out, tensor in zip(outs, tensors, strict=True):
                out.set_shape(tensor.shape)
        return outputs

    # --- run time (inside tf.py_function, eager) --------------------------------------------------
    def _advance_all(self, position: int, plan: list, *results) -> list:
        """Phase ``position`` of every bucket of ``plan`` ((key, expected phase, specs, number of
        inputs), in plan order), run by one ``tf.py_function``: ``_advance`` of each, on its share
        of ``results``; their outputs, concatenated."""
        out, offset = [], 0
        for key, expected, specs, count in plan:
            out += self._advance(key, position, expected, specs, *results[offset:offset + count])
            offset += count
        return out

    def _advance(self, key: str, position: int, expected: list | None, specs: tuple, *results) -> list:
        """Phase ``position`` of bucket ``key``'s step, run by its ``tf.py_function``: the tensors
        of the next phase's collectives (checked against ``expected``, what the graph was built
        for), or the bucket's average after the last (a tensor per gradient). ``results`` are
        the gradients (``specs``: theirs) at position 0, else what the last phase's collectives
        returned."""
        if position == 0:
            if not self._inflight:   # the first phase of a step's first tensor
                self._begin_step()
                self.assembly.begin(time.perf_counter())
            self.assembly.start_inputs(key, Packed(specs, results), self._engine(), self,
                                       check_layout=False, members=self.members.get(key, ()))
            protocol, sent = self._inflight[key], None
        else:
            protocol, sent = self._inflight[key], list(results)
        try:
            phase: list[Collective] = next(protocol) if sent is None else protocol.send(sent)
        except StopIteration as done:
            del self._inflight[key]
            self.assembly.mark_done(key)
            return _parts_of(done.value, results)
        if expected is None or [(c.op, c.name) for c in phase] != [(op, n) for op, n, _ in expected]:
            raise RankMismatchError(f"step of {key!r} issued {[c.signature() for c in phase]}, the "
                                    f"graph was built for {expected}")
        return [c.tensor for c in phase]

    def start(self, bucket: str, protocol: Protocol) -> None:
        """Take a started bucket's protocol (``Starts``): the graph's phases advance it."""
        self._inflight[bucket] = protocol

    def forget(self) -> None:
        """A reset (elastic): the step in flight is abandoned."""
        self._inflight = {}

    def _run_blocking(self, layout: list[tuple[str, tuple]], *grads) -> list:
        """Every bucket of ``layout`` ((bucket, its tensors' specs), in plan order, the same on
        every rank) one after the other, with eager blocking collectives; ``grads``: every
        bucket's gradients, in order. Every bucket's average, a tensor per gradient. A bucket
        that raises (on every rank alike: ``nonfinite="raise"``) takes back the ones that finished,
        so the step is applied nowhere (docs/usage.md#non-finite-gradients); the later ones have
        not started on any rank."""
        self._begin_step()
        engine, assembly, outputs = self._engine(), self.assembly, []
        driver = Together(self._comm().execute)
        assembly.begin(time.perf_counter())
        offset = 0
        for key, specs in layout:
            tensors = grads[offset:offset + len(specs)]
            offset += len(specs)
            assembly.start_inputs(key, Packed(specs, tensors), engine, driver)
            outputs += _parts_of(assembly.finish(engine, driver, keep=False)[key], tensors)
        return outputs
