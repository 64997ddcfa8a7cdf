"""The hvd_sparse.torch face of the magnitude baselines, one class each: written by
tools/generate_faces.py from hvd_sparse/algorithms and the face's options; do not edit
(tests/unit/test_face_modules.py checks that it is current)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .. import algorithms
from ..algorithms.corrections import AdamPath
from ..faces import build_face
from .compressor import SparseCompressor


class TopK(SparseCompressor):
    """Error-feedback top-k.

    Args:
        density: fraction of entries each rank sends per step, in (0, 1]; k = floor(density * n),
            at least 1.
        pattern: "gather" (classic allgather of pairs) or "union" (index allgather + value
            allreduce at the union).
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

    Options of the hvd_sparse.torch face (SparseCompressor):
        named_parameters: the model's ``named_parameters()`` (recommended). Gradients are then
            matched to parameters by identity and collectives are named after the parameter;
            without it they are named by their order within the step, which relies on every rank
            running the backward hooks in the same order. With it, the first gradient hook also
            checks that every rank has the same model (docs/usage.md#ranks-that-disagree).
        process_set: the Horovod process set the optimizer reduces over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the torch optimizer then wrapped in ``hvd.DistributedOptimizer``.
            ``hvd_sparse.torch.optim.AdamW`` (or ``Adam``) turns the Adam path on
            (docs/methods.md#adam-and-adamw); torch's own Adam/AdamW is refused, naming that fix;
            another optimizer is only checked.
    """

    __module__ = "hvd_sparse.torch"

    def __init__(self, density: float = 0.01, *, pattern: str = 'gather', scope: str = 'tensor',
                 momentum: float = 0.0, nesterov: bool = False, momentum_masking: bool = True,
                 dense_steps: int | None = None, warmup_steps: int = 0, dense_below: int = 0,
                 clip_norm: float | None = None, adam: AdamPath | None = None, second_moment_refresh: int = 0,
                 total_steps: int | None = None, named_parameters: Iterable | None = None,
                 process_set: Any = None, prefix: str = 'hvd_sparse', nonfinite: str = 'skip',
                 optimizer: Any = None) -> None:
        build_face(self, SparseCompressor, algorithms.TopK, locals())


class GaussianK(SparseCompressor):
    """Error-feedback Gaussian-k.

    Args:
        density: target fraction of entries each rank sends per step, in (0, 1]; k = floor(density
            * n), at least 1. The count sent is only approximately k.
        variant: "original" (paper mode) or "rescale" (see module docstring).
        max_loops: refinement loops at most (default 100 for "original", 3 for "rescale").
        scope: "tensor" (per gradient tensor) or "model" (the whole model).

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

    Options of the hvd_sparse.torch face (SparseCompressor):
        named_parameters: the model's ``named_parameters()`` (recommended). Gradients are then
            matched to parameters by identity and collectives are named after the parameter;
            without it they are named by their order within the step, which relies on every rank
            running the backward hooks in the same order. With it, the first gradient hook also
            checks that every rank has the same model (docs/usage.md#ranks-that-disagree).
        process_set: the Horovod process set the optimizer reduces over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the torch optimizer then wrapped in ``hvd.DistributedOptimizer``.
            ``hvd_sparse.torch.optim.AdamW`` (or ``Adam``) turns the Adam path on
            (docs/methods.md#adam-and-adamw); torch's own Adam/AdamW is refused, naming that fix;
            another optimizer is only checked.
    """

    __module__ = "hvd_sparse.torch"

    def __init__(self, density: float = 0.01, *, variant: str = 'original', max_loops: int | None = None,
                 scope: str = 'tensor', momentum: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, dense_steps: int | None = None, warmup_steps: int = 0,
                 dense_below: int = 0, clip_norm: float | None = None, adam: AdamPath | None = None,
                 second_moment_refresh: int = 0, total_steps: int | None = None,
                 named_parameters: Iterable | None = None, process_set: Any = None,
                 prefix: str = 'hvd_sparse', nonfinite: str = 'skip', optimizer: Any = None) -> None:
        build_face(self, SparseCompressor, algorithms.GaussianK, locals())


class DGC(SparseCompressor):
    """Deep Gradient Compression: momentum correction and factor masking, sampled threshold,
    optional local clipping, density warm-up.

    Args:
        density: fraction of entries each rank sends per step after warm-up, in (0, 1];
            k = ceil(density * n).
        momentum: μ of the momentum correction (0 disables it: plain error feedback); the
            engine's correction, which every method has (algorithms/corrections.py). Default
            0.9, and 0 on the Adam path (``adam``), whose momentum is Adam's.
        nesterov: Nesterov form of the momentum correction.
        momentum_masking: clear ``u`` where this rank sent (the paper's factor masking).
        sample_ratio: fraction of entries sampled for the threshold (the authors' floor of
            0.01 applies).
        strided_sample: strided sampling with a random start (else uniform with replacement).
        upper, lower: the adaptation band around k (1.3 and 0.8).
        max_adaptation_iters: adaptation loops at most (10).
        resample: above ``upper * k``, take the exact top-k of the selection.
        warmup_epochs: epochs of exponential density warm-up (0: none); see ``set_epoch``.
        seed: seeds the sampling start (with the step and the bucket).
        scope: "tensor" (per gradient tensor) or "model".

    Corrections (every method, applied by the engine: algorithms/corrections.py):
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

    Options of the hvd_sparse.torch face (SparseCompressor):
        named_parameters: the model's ``named_parameters()`` (recommended). Gradients are then
            matched to parameters by identity and collectives are named after the parameter;
            without it they are named by their order within the step, which relies on every rank
            running the backward hooks in the same order. With it, the first gradient hook also
            checks that every rank has the same model (docs/usage.md#ranks-that-disagree).
        process_set: the Horovod process set the optimizer reduces over (default: global).
        prefix: prefix of every collective's name; give two compressors in one job distinct ones.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank raises FloatingPointError; the step is
            applied nowhere and training can go on, docs/usage.md#non-finite-gradients) or "ignore".
        optimizer: the torch optimizer then wrapped in ``hvd.DistributedOptimizer``.
            ``hvd_sparse.torch.optim.AdamW`` (or ``Adam``) turns the Adam path on
            (docs/methods.md#adam-and-adamw); torch's own Adam/AdamW is refused, naming that fix;
            another optimizer is only checked.
    """

    __module__ = "hvd_sparse.torch"

    def __init__(self, density: float = 0.001, *, momentum: float | None = None, nesterov: bool = False,
                 momentum_masking: bool = True, sample_ratio: float = 0.01, strided_sample: bool = True,
                 upper: float = 1.3, lower: float = 0.8, max_adaptation_iters: int = 10,
                 resample: bool = True, warmup_epochs: int = 0, seed: int = 0, scope: str = 'tensor',
                 dense_steps: int | None = None, warmup_steps: int = 0, dense_below: int = 0,
                 clip_norm: float | None = None, adam: AdamPath | None = None, second_moment_refresh: int = 0,
                 total_steps: int | None = None, named_parameters: Iterable | None = None,
                 process_set: Any = None, prefix: str = 'hvd_sparse', nonfinite: str = 'skip',
                 optimizer: Any = None) -> None:
        build_face(self, SparseCompressor, algorithms.DGC, locals())


FACES: dict[str, type[SparseCompressor]] = {
    "TopK": TopK,
    "GaussianK": GaussianK,
    "DGC": DGC,
}
