"""How a step's gradients become buckets, the same in every face: the tensors under ``dense_below``
set apart, the method's grouping (``Algorithm.group``: per tensor, the whole model, LAGS's groups),
and per-tensor steps packed into shared buckets. Pure functions of the keys, sizes and dtypes, so
every rank plans alike. The method keeps only what is its idea (its grouping, and whether it can
select in packed tensors as in buckets of their own: ``Algorithm.tensor_packing``)."""

from __future__ import annotations

from ..algorithms.base import DENSE_BUCKET, TENSOR, Algorithm

Buckets = list[tuple[str, list[str]]]   # (bucket name, member keys) in a rank-independent order

# In PyTorch (Horovod's and DDP's faces) a bucket packing per-tensor steps holds at most this many
# entries: an engine step costs about half a millisecond of Python and collectives whatever its
# size, which a bucket per gradient pays 62 times on ResNet-18, while a few buckets of this size
# still start during the backward pass, so their exchange overlaps it. TensorFlow packs the
# gradients of one graph build without a limit.
PACKED_BUCKET_ENTRIES = 1 << 22


def plan_buckets(algorithm: Algorithm, keys: list[str], sizes: list[int]) -> Buckets:
    """The model's gradients in buckets; ``keys`` are in parameter (forward) order. Tensors under
    ``dense_below`` entries are taken out first: one bucket each in per-tensor scope, else one
    bucket of their own (``DENSE_BUCKET``) averaged densely; the method groups the rest."""
    dense = algorithm.corrections.is_dense_tensor
    small = {key for key, n in zip(keys, sizes, strict=True) if dense(n)}
    if not small or algorithm.scope == TENSOR:
        return algorithm.group(keys, sizes)
    kept = [(key, n) for key, n in zip(keys, sizes, strict=True) if key not in small]
    plan = algorithm.group([k for k, _ in kept], [n for _, n in kept]) if kept else []
    return [*plan, (DENSE_BUCKET, [key for key in keys if key in small])]


def packable(algorithm: Algorithm, numel: int) -> bool:
    """Whether a tensor of ``numel`` entries may share a bucket of per-tensor steps: one neither
    empty nor averaged densely (``dense_below``), which ``pack_tensors`` bundles apart."""
    return algorithm.tensor_packing and numel > 0 and not algorithm.corrections.is_dense_tensor(numel)


def pack_tensors(algorithm: Algorithm, plan: Buckets, sizes: dict[str, int], dtypes: dict[str, str],
                 limit: int | None = None) -> Buckets:
    """``plan`` with its packable one-tensor buckets packed, per dtype in plan order, into buckets
    of at most ``limit`` entries (None: no limit; a larger tensor alone), each named by its first
    and last member and placed where it closes; other buckets as they were. Runs go on past the
    buckets they do not take. The ``dense_below`` tensors of a dtype met since its last run closed
    (they sit between the layers' weights) are bundled into a dense bucket that closes with the
    run, right after it: one allreduce instead of one per tensor, still started during the
    backward pass. The packed step makes the decisions of the buckets it replaces
    (``Algorithm.tensor_segments``) at one bucket's per-step cost."""
    packed: Buckets = []
    runs: dict[str, list[str]] = {}     # dtype -> the open run
    dense: dict[str, list[str]] = {}    # dtype -> the dense_below tensors met since it opened
    entries: dict[str, int] = {}

    def close(dtype: str) -> None:
        for run in (runs.pop(dtype, []), dense.pop(dtype, [])):
            if run:
                packed.append((f"{run[0]}-{run[-1]}" if len(run) > 1 else run[0], run))

    for bucket, members in plan:
        key = members[0] if len(members) == 1 and bucket == members[0] else None
        if key is None or not algorithm.tensor_packing or sizes[key] == 0:
            packed.append((bucket, members))
            continue
        dtype = dtypes[key]
        if not packable(algorithm, sizes[key]):
            dense.setdefault(dtype, []).append(key)
            continue
        if dtype in runs and limit is not None and entries[dtype] + sizes[key] > limit:
            close(dtype)
        if dtype not in runs:
            runs[dtype], entries[dtype] = [], 0
        runs[dtype].append(key)
        entries[dtype] += sizes[key]
    for dtype in list({**runs, **dense}):
        close(dtype)
    return packed


def face_plan(algorithm: Algorithm, keys: list[str], sizes: list[int], dtypes: list[str],
              limit: int | None = PACKED_BUCKET_ENTRIES) -> Buckets:
    """The buckets a face runs: ``plan_buckets`` with per-tensor steps packed (``pack_tensors``)."""
    return pack_tensors(algorithm, plan_buckets(algorithm, keys, sizes), dict(zip(keys, sizes, strict=True)),
                        dict(zip(keys, dtypes, strict=True)), limit)


def step_members(algorithm: Algorithm, members: list[str]) -> tuple[str, ...]:
    """What a face hands ``Engine.step`` as ``members`` for a bucket of a packed plan: its keys
    when it packs per-tensor steps, else nothing (one tensor, or a method's own group)."""
    return tuple(members) if len(members) > 1 and algorithm.tensor_packing else ()
