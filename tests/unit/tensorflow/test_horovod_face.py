"""The Horovod TensorFlow face (hvd_sparse/tensorflow/compressor.py, step_graphs.py) driven in this
process: two ranks as threads, each tracing ``compress``/``decompress`` into a ``tf.function`` as
Horovod's grouped allreduce does, with collectives matched by name (comm/threads.py): phased graphs
(per-tensor steps, their collectives as graph ops) and the blocking py_function (whole model). The
averages are compared bit for bit with the engine run on the same gradients by the lockstep local
driver. Real horovodrun jobs: tests/multiproc/test_horovod_*.py."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
hvd = pytest.importorskip("horovod.tensorflow")
hst = pytest.importorskip("hvd_sparse.tensorflow")

import hvd_sparse  # noqa: E402
from hvd_sparse.backends import get_backend  # noqa: E402
from hvd_sparse.backends.tf_backend import Packed  # noqa: E402
from hvd_sparse.comm.local import LocalGroup  # noqa: E402
from hvd_sparse.comm.threads import ThreadGroup, run_ranks  # noqa: E402
from hvd_sparse.engine import Engine  # noqa: E402
from hvd_sparse.engine.planning import pack_tensors, plan_buckets, step_members  # noqa: E402

SIZE, STEPS = 2, 3
SHAPES = [(6, 5), (5,), (4, 3, 2), (40,)]


def gradients(rank: int, step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def face_averages(make_algorithm, nonfinite: str = "skip") -> list[list[list[np.ndarray]]]:
    """Per rank, per step: the face's averages of ``gradients``, traced as Horovod traces them
    (every gradient in one group: all ``compress`` calls, then all ``decompress`` calls)."""
    group = ThreadGroup(SIZE, "tensorflow", timeout=30)

    def rank_body(rank: int) -> list[list[np.ndarray]]:
        compressor = hst.SparseCompressor(make_algorithm(), nonfinite=nonfinite)
        compressor._make_comm = lambda: group.comm(rank)
        compressor._current_world = lambda: (rank, SIZE)

        @tf.function
        def reduce(grads):
            sent = [compressor.compress(g) for g in grads]
            return [compressor.decompress(placeholder, ctx) for placeholder, ctx in sent]

        return [[out.numpy() for out in reduce([tf.constant(g) for g in gradients(rank, step)])]
                for step in range(STEPS)]

    return run_ranks(SIZE, rank_body, timeout=120)


def reference_averages(make_algorithm, packed: bool) -> list[list[np.ndarray]]:
    """The engine on the lockstep local driver, over the buckets the face builds."""
    algorithm, backend = make_algorithm(), get_backend("tensorflow")
    engines = [Engine(algorithm, backend, r, SIZE) for r in range(SIZE)]
    group = LocalGroup(SIZE, backend)
    keys = [f"g{i}" for i in range(len(SHAPES))]
    sizes = [int(np.prod(s)) for s in SHAPES]
    plan = plan_buckets(algorithm, keys, sizes)
    if packed:
        plan = pack_tensors(algorithm, plan, dict(zip(keys, sizes, strict=True)),
                            dict.fromkeys(keys, "float32"))
    out = []
    for step in range(STEPS):
        grads = [dict(zip(keys, gradients(r, step), strict=True)) for r in range(SIZE)]
        averages: dict[str, np.ndarray] = {}
        for bucket, members in plan:
            specs = tuple(tf.TensorSpec(SHAPES[keys.index(m)], tf.float32) for m in members)
            kept = step_members(algorithm, members) if packed else ()
            inputs = [Packed(specs, [tf.constant(grads[r][m]) for m in members]) for r in range(SIZE)]
            results = group.run([engines[r].step(bucket, inputs[r], members=kept) for r in range(SIZE)])
            for member, part in zip(members, results[0].parts, strict=True):
                averages[member] = tf.reshape(part, SHAPES[keys.index(member)]).numpy()
        out.append([averages[k] for k in keys])
    return out


@pytest.mark.parametrize(("method", "packed"), [
    (lambda: hvd_sparse.algorithms.TopK(0.2), True),                     # phased graphs, packed
    (lambda: hvd_sparse.algorithms.ExDyna(0.2, num_blocks=8), False),    # one blocking py_function
    (lambda: hvd_sparse.algorithms.DGC(0.2, scope="model", momentum=0.9), False),
], ids=["topk", "exdyna", "dgc-model"])
def test_the_face_makes_the_engines_decisions_on_every_rank(method, packed):
    faces = face_averages(method)
    reference = reference_averages(method, packed)
    for per_rank in faces:
        for got_step, want_step in zip(per_rank, reference, strict=True):
            for got, want in zip(got_step, want_step, strict=True):
                np.testing.assert_array_equal(got, want)
