"""The hvd_sparse.tensorflow face of the random-k and hard-threshold baselines, one class each: written by
tools/generate_faces.py from hvd_sparse/algorithms and the face's options; do not edit
(tests/unit/test_face_modules.py checks that it is current)."""

from __future__ import annotations

from typing import Any

from .. import algorithms
from ..algorithms.corrections import AdamPath
from ..faces import build_face
from .compressor import SparseCompressor


class RandomK(SparseCompressor):
    """Error-feedback random-k.

    Args:
        density: fraction of entries each rank sends per step, in (0, 1]; k = floor(density * n),
            at least 1.
        seed: non-negative integer; the draws depend on it, the step and the bucket (and the rank
            unless ``shared_seed``).
        shared_seed: every rank draws the same indices and only values are allreduced.
        scope: "tensor" (k per gradient tensor) or "model" (k over the whole model).

    Corrections (every method, applied by the engine: algorithms/corrections.py):
        momentum: mu of the momentum correction, in [0, 1); 0 turns it off. Pair it with an
            optimizer without momentum (``SGD(..., momentum=0)``): the momentum is in the update.
        nesterov: Nesterov form of the correction.
        momentum_masking: clear ``u`` where this rank's values were sent (DGC's factor masking).
        dense_steps: steps averaged densely before sparsification starts (default 0; with
            ``adam``, ``ADAM_DENSE_STEPS``).
        warmup_steps: steps over which the density falls exponentially from 1 to ``density``.
        dense_below: tensors with fewer entries than this are averaged densely (0: none).
        clip_norm: local gradient clipping: each rank's gradient of a sparse bucket is scaled to
            an L2 norm of at most ``clip_norm / sqrt(N)`` before it is accumulated (None: off).
            The dense recipe's clipping norm, or 1.0 where it has none: it keeps bursts out of
            the residual at small k (docs/methods.md#corrections).
        adam: the Adam path (``AdamPath``), which the faces set from their ``optimizer=``.
        second_moment_refresh: on the Adam path, K > 0 shares Adam's v among the ranks: every K
            sparse steps the raw gradient is also allreduced densely (1/K of dense's bytes) and v
            is refreshed from that average, identically on every rank, and frozen in between.
            0 (default): each rank's own v, from its own batch. A rank's own v holds its batch's
            noise, N times the average's, so its steps are up to sqrt(N) smaller than dense
            AdamW's. At 16 ranks K = 20 took TopK and LAGS to dense's quality in 550 steps
            instead of 1200 (dense: 450); at 4 ranks it brought TopK, DGC and LAGS within 2.3%
            of dense's perplexity at ρ = 0.01. It hurts ExDyna and DEFT: leave it off for them
            (docs/methods.md#adam-and-adamw).
        total_steps: the run's length in steps, when known: checked against the dense steps and
            the warm-up, which must end before it.

    Options of the hvd_sparse.tensorflow face (SparseCompressor):
        process_set: the Horovod process set the gradients are reduced over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the optimizer the compressor serves (under Horovod, the one then wrapped in
            ``hvd.DistributedOptimizer``). hvd_sparse's Adam or AdamW turns the Adam path on
            (docs/methods.md#adam-and-adamw); another optimizer is checked (momentum applied
            twice) and otherwise left as it is.
    """

    __module__ = "hvd_sparse.tensorflow"

    def __init__(self, density: float = 0.01, *, seed: int = 0, shared_seed: bool = False,
                 scope: str = 'tensor', momentum: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, dense_steps: int | None = None, warmup_steps: int = 0,
                 dense_below: int = 0, clip_norm: float | None = None, adam: AdamPath | None = None,
                 second_moment_refresh: int = 0, total_steps: int | None = None, process_set: Any = None,
                 prefix: str = 'hvd_sparse', nonfinite: str = 'skip', optimizer: Any = None) -> None:
        build_face(self, SparseCompressor, algorithms.RandomK, locals())


class Threshold(SparseCompressor):
    """Error-feedback hard threshold.

    Args:
        density: only sets the default λ (``1/(2*sqrt(floor(density * n)))``); the density
            actually sent is not controlled.
        threshold: λ itself (a positive number); overrides the default rule.
        pattern: "gather" (allgather of pairs) or "union" (index allgather + value allreduce).
        scope: "model" (one λ over the flattened model) or "tensor" (one bucket per tensor).

    Corrections (every method, applied by the engine: algorithms/corrections.py):
        momentum: mu of the momentum correction, in [0, 1); 0 turns it off. Pair it with an
            optimizer without momentum (``SGD(..., momentum=0)``): the momentum is in the update.
        nesterov: Nesterov form of the correction.
        momentum_masking: clear ``u`` where this rank's values were sent (DGC's factor masking).
        dense_steps: steps averaged densely before sparsification starts (default 0; with
            ``adam``, ``ADAM_DENSE_STEPS``).
        warmup_steps: steps over which the density falls exponentially from 1 to ``density``.
        dense_below: tensors with fewer entries than this are averaged densely (0: none).
        clip_norm: local gradient clipping: each rank's gradient of a sparse bucket is scaled to
            an L2 norm of at most ``clip_norm / sqrt(N)`` before it is accumulated (None: off).
            The dense recipe's clipping norm, or 1.0 where it has none: it keeps bursts out of
            the residual at small k (docs/methods.md#corrections).
        adam: the Adam path (``AdamPath``), which the faces set from their ``optimizer=``.
        second_moment_refresh: on the Adam path, K > 0 shares Adam's v among the ranks: every K
            sparse steps the raw gradient is also allreduced densely (1/K of dense's bytes) and v
            is refreshed from that average, identically on every rank, and frozen in between.
            0 (default): each rank's own v, from its own batch. A rank's own v holds its batch's
            noise, N times the average's, so its steps are up to sqrt(N) smaller than dense
            AdamW's. At 16 ranks K = 20 took TopK and LAGS to dense's quality in 550 steps
            instead of 1200 (dense: 450); at 4 ranks it brought TopK, DGC and LAGS within 2.3%
            of dense's perplexity at ρ = 0.01. It hurts ExDyna and DEFT: leave it off for them
            (docs/methods.md#adam-and-adamw).
        total_steps: the run's length in steps, when known: checked against the dense steps and
            the warm-up, which must end before it.

    Options of the hvd_sparse.tensorflow face (SparseCompressor):
        process_set: the Horovod process set the gradients are reduced over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the optimizer the compressor serves (under Horovod, the one then wrapped in
            ``hvd.DistributedOptimizer``). hvd_sparse's Adam or AdamW turns the Adam path on
            (docs/methods.md#adam-and-adamw); another optimizer is checked (momentum applied
            twice) and otherwise left as it is.
    """

    __module__ = "hvd_sparse.tensorflow"

    def __init__(self, density: float = 0.01, *, threshold: float | None = None, pattern: str = 'gather',
                 scope: str = 'model', momentum: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, dense_steps: int | None = None, warmup_steps: int = 0,
                 dense_below: int = 0, clip_norm: float | None = None, adam: AdamPath | None = None,
                 second_moment_refresh: int = 0, total_steps: int | None = None, process_set: Any = None,
                 prefix: str = 'hvd_sparse', nonfinite: str = 'skip', optimizer: Any = None) -> None:
        build_face(self, SparseCompressor, algorithms.Threshold, locals())


FACES: dict[str, type[SparseCompressor]] = {
    "RandomK": RandomK,
    "Threshold": Threshold,
}
