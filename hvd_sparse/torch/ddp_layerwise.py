"""The hvd_sparse.torch.ddp face of the layer-wise seed methods, one class each: written by
tools/generate_faces.py from hvd_sparse/algorithms and the face's options; do not edit
(tests/unit/test_face_modules.py checks that it is current)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from .. import algorithms
from ..algorithms.corrections import AdamPath
from ..faces import build_face
from .ddp_state import SparseHookState


class DEFT(SparseHookState):
    """DEFT (docs/algorithms.md#deft): per-unit k in proportion to the gradient norm, units packed into
    one bin per rank by a rotating master, each rank selecting top-k inside its own units.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1]; k = int(density * n).
        agreed_k: option (off in paper mode): the master also broadcasts its per-unit k and every
            rank uses it, so the aggregated count is exactly the master's total.
        packing: "linear" (paper mode: the code's O(L^2) scans) or "heap" (O(L log L), identical
            result).

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

    Options of the hvd_sparse.torch.ddp face (SparseHookState):
        named_parameters: the model's ``named_parameters()`` (recommended): buckets, checkpoints
            and errors then use the parameters' names, and the whole-model vector is laid out in
            this order, as under Horovod. Without it parameters are named ``p0``, ``p1``, ... in
            the order of DDP's first-iteration buckets (the model's parameter order when every
            parameter has one dtype).
        process_group: the group DDP reduces over (default: the default group); pass DDP's own.
            The state runs its collectives on a new group over the same ranks (created here, on
            every rank of that group), so that they never interleave with DDP's or the
            training loop's own.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank's ``loss.backward()`` raises; the step is
            applied nowhere and training can go on, docs/ddp.md) or "ignore".
        timeout: how long one of the state's collectives may wait for the other ranks before it
            fails (a ``datetime.timedelta``; default: torch.distributed's default for the backend).
        optimizer: the torch optimizer stepping the DDP model. ``hvd_sparse.torch.optim.AdamW``
            (or ``Adam``) turns the Adam path on (docs/methods.md#adam-and-adamw); torch's own
            Adam/AdamW is refused, naming that fix; another optimizer is only checked.
    """

    __module__ = "hvd_sparse.torch.ddp"

    def __init__(self, density: float = 0.001, *, agreed_k: bool = False, packing: str = 'linear',
                 momentum: float = 0.0, nesterov: bool = False, momentum_masking: bool = True,
                 dense_steps: int | None = None, warmup_steps: int = 0, dense_below: int = 0,
                 clip_norm: float | None = None, adam: AdamPath | None = None, second_moment_refresh: int = 0,
                 total_steps: int | None = None, named_parameters: Iterable | None = None,
                 process_group: Any = None, nonfinite: str = 'skip', timeout: timedelta | None = None,
                 optimizer: Any = None) -> None:
        build_face(self, SparseHookState, algorithms.DEFT, locals())


class LAGS(SparseHookState):
    """LAGS-SGD: per-group top-k whose allgathers start during the backward pass.

    Args:
        density: fraction of each group's entries a rank sends, in (0, 1]; with ``adaptive`` the
            floor of every group's density.
        merge_threshold: merge consecutive tensors (in backward order) until a group holds at
            least this many elements; 0 = one group per tensor. Default 8192 (the authors').
        adaptive: choose each group's density from its measured backward time and the allgather
            cost model (docs/algorithms.md#adaptive-density); PyTorch only (TensorFlow warns, stays uniform).
        comp_time: ``"own"`` (the group's own backward time, the authors' definition) or
            ``"remaining"`` (backward time left after the group is ready).
        profile_steps: steps measured before the densities are fixed.
        alpha, beta: allgather cost model (seconds per log2(P); seconds per element). Both
            ``None`` (default): measured by a calibration on the job. ``PAPER_ALPHA`` and
            ``PAPER_BETA`` are the authors' values.
        calibration_sizes: elements per rank of the two calibration allgathers.
        calibration_repeats: timed allgathers per size (the fastest is used).
        min_density, overflow_density: the rule's floor and the value it takes when the solved
            density exceeds 1 (the authors' 0.001 and 0.05).

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

    Options of the hvd_sparse.torch.ddp face (SparseHookState):
        named_parameters: the model's ``named_parameters()`` (recommended): buckets, checkpoints
            and errors then use the parameters' names, and the whole-model vector is laid out in
            this order, as under Horovod. Without it parameters are named ``p0``, ``p1``, ... in
            the order of DDP's first-iteration buckets (the model's parameter order when every
            parameter has one dtype).
        process_group: the group DDP reduces over (default: the default group); pass DDP's own.
            The state runs its collectives on a new group over the same ranks (created here, on
            every rank of that group), so that they never interleave with DDP's or the
            training loop's own.
        nonfinite: what a rank does with a NaN/Inf gradient: "skip" (send zeros this step, keep
            the residual, warn), "raise" (every rank's ``loss.backward()`` raises; the step is
            applied nowhere and training can go on, docs/ddp.md) or "ignore".
        timeout: how long one of the state's collectives may wait for the other ranks before it
            fails (a ``datetime.timedelta``; default: torch.distributed's default for the backend).
        optimizer: the torch optimizer stepping the DDP model. ``hvd_sparse.torch.optim.AdamW``
            (or ``Adam``) turns the Adam path on (docs/methods.md#adam-and-adamw); torch's own
            Adam/AdamW is refused, naming that fix; another optimizer is only checked.
    """

    __module__ = "hvd_sparse.torch.ddp"

    def __init__(self, density: float = 0.01, *, merge_threshold: int = 8192, adaptive: bool = False,
                 comp_time: str = 'own', profile_steps: int = 5, alpha: float | None = None,
                 beta: float | None = None, calibration_sizes: tuple[int, int] = (256, 1048576),
                 calibration_repeats: int = 5, min_density: float = 0.001, overflow_density: float = 0.05,
                 momentum: float = 0.0, nesterov: bool = False, momentum_masking: bool = True,
                 dense_steps: int | None = None, warmup_steps: int = 0, dense_below: int = 0,
                 clip_norm: float | None = None, adam: AdamPath | None = None, second_moment_refresh: int = 0,
                 total_steps: int | None = None, named_parameters: Iterable | None = None,
                 process_group: Any = None, nonfinite: str = 'skip', timeout: timedelta | None = None,
                 optimizer: Any = None) -> None:
        build_face(self, SparseHookState, algorithms.LAGS, locals())


FACES: dict[str, type[SparseHookState]] = {
    "DEFT": DEFT,
    "LAGS": LAGS,
}
