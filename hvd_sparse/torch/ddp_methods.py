"""The hvd_sparse.torch.ddp face of the exclusive-partition seed methods, one class each: written by
tools/generate_faces.py from hvd_sparse/algorithms and the face's options; do not edit
(tests/unit/test_face_modules.py checks that it is current)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from .. import algorithms
from ..algorithms.corrections import AdamPath
from ..errors import renamed_options
from ..faces import build_face
from .ddp_state import SparseHookState


class ExDyna(SparseHookState):
    """ExDyna: block-based exclusive partitions with dynamic rebalancing and online threshold
    scaling.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1].
        rebalance: "exact" (paper: replicated sweep), "neighbour" (counts exchanged with ranks
            r±1 only), "histogram" (boundaries placed from per-block loads) or "off".
        num_blocks: blocks the model is cut into (paper: 1024), or "auto" = max(1024, 16·N).
        threshold_scaling: "paper" or "tracking" (see hvd_sparse.algorithms.micro). Formerly
            ``threshold``.
        threshold_band: "code" (paper) or "symmetric" band of the threshold scaling. Formerly
            ``band``.
        overload_ratio, underload_ratio: a partition is over-loaded above overload_ratio × mean
            load and under-loaded below underload_ratio × mean (paper: "1.05", "0.95238";
            decimal strings or numbers, compared exactly). Formerly ``over_band``/``under_band``.
        histogram_decay: weight of the past in the per-block load average of
            ``rebalance="histogram"`` (0: the last step alone).
        threshold_start: "paper" (λ0 = 1/(2√k)) or "local" (the first step selects each rank's
            share of k by magnitude; see hvd_sparse.algorithms.micro). Default "paper", "local" on
            the Adam path.
        tracking_gain: "auto" (adaptive under the momentum correction and on the Adam path, fixed
            otherwise), "fixed"
            or "adaptive": the tracking controller's step (see hvd_sparse.algorithms.micro).

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

    @renamed_options(threshold="threshold_scaling", band="threshold_band", over_band="overload_ratio",
                     under_band="underload_ratio")
    def __init__(self, density: float = 0.001, *, rebalance: str = 'exact', num_blocks: int | str = 1024,
                 threshold_scaling: str = 'paper', threshold_band: str = 'code',
                 overload_ratio: str | float = '1.05', underload_ratio: str | float = '0.95238',
                 histogram_decay: float = 0.8, threshold_start: str | None = None,
                 tracking_gain: str = 'auto', momentum: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, dense_steps: int | None = None, warmup_steps: int = 0,
                 dense_below: int = 0, clip_norm: float | None = None, adam: AdamPath | None = None,
                 second_moment_refresh: int = 0, total_steps: int | None = None,
                 named_parameters: Iterable | None = None, process_group: Any = None, nonfinite: str = 'skip',
                 timeout: timedelta | None = None, optimizer: Any = None) -> None:
        build_face(self, SparseHookState, algorithms.ExDyna, locals())


class MiCRO(SparseHookState):
    """MiCRO: exclusive rotating partitions, threshold selection, online threshold scaling.

    Args:
        density: target fraction of entries aggregated per step, in (0, 1].
        threshold_scaling: how λ is scaled online: "paper" (the code's multiplicative rule) or
            "tracking" (see module docstring). Formerly ``threshold``.
        threshold_band: the scaling rule's band, "code" (paper mode, dead branch included) or
            "symmetric". Formerly ``band``.
        threshold_start: the first step's threshold: "paper" (λ0 = 1/(2√k) on every rank) or
            "local" (each rank's share of k by magnitude; see module docstring). Default "paper",
            and "local" on the Adam path, whose accumulated update is in units of the learning
            rate, where λ0 would send nearly everything.
        tracking_gain: the tracking controller's step: "fixed", "adaptive" (see module
            docstring) or "auto" (adaptive under the momentum correction, fixed otherwise).

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

    @renamed_options(threshold="threshold_scaling", band="threshold_band")
    def __init__(self, density: float = 0.001, *, threshold_scaling: str = 'paper',
                 threshold_band: str = 'code', threshold_start: str | None = None,
                 tracking_gain: str = 'auto', momentum: float = 0.0, nesterov: bool = False,
                 momentum_masking: bool = True, dense_steps: int | None = None, warmup_steps: int = 0,
                 dense_below: int = 0, clip_norm: float | None = None, adam: AdamPath | None = None,
                 second_moment_refresh: int = 0, total_steps: int | None = None,
                 named_parameters: Iterable | None = None, process_group: Any = None, nonfinite: str = 'skip',
                 timeout: timedelta | None = None, optimizer: Any = None) -> None:
        build_face(self, SparseHookState, algorithms.MiCRO, locals())


FACES: dict[str, type[SparseHookState]] = {
    "ExDyna": ExDyna,
    "MiCRO": MiCRO,
}
