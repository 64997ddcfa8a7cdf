"""Worker: bad shapes, ranks that disagree, a raised non-finite step and dead ranks, through
stock horovod.torch.DistributedOptimizer.

Run by tests/multiproc/test_horovod_robustness.py. ``argv[1]`` is a comma-separated list of
parts, each printing ``CHECKED <part>/<case> rank=<r>`` per case that holds on this rank:

* ``sweep``: every method (and the ExDyna modes with their own code) on a one-tensor model of n
  entries, n in {1, N-1, N, 31, 32 N}: three steps, then every rank's outcome -- its weights, or
  its error's type and message -- is gathered; they must be identical on every rank, and an error
  is allowed only for n < N, naming a fix. Then a model with a zero-size parameter, which every
  method must train (``CHECKED empty/<method>``).
* ``mismatch`` (2 ranks): rank 1 builds another density, method, hyper-parameter, model (an extra
  layer, a wider layer) or parameter order; every rank must raise RankMismatchError naming it.
* ``nonfinite``: nonfinite="raise", a NaN on rank 1 at one step; every rank raises, recovers as
  docs/usage.md#non-finite-gradients says, trains on, and ends with identical weights.
* ``die <method> <kill|exit>`` (alone): rank 1 dies at step 20 (SIGKILL, or sys.exit); every
  survivor must end with an error (``SURVIVOR_ERROR``) or be ended by the launcher, not hang and
  not finish.

A job that passes prints ``PASSED rank=<r> size=<N>`` on every rank.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import sys
import time
import warnings

import horovod.torch as hvd
import torch
from checks import outcome

import hvd_sparse
import hvd_sparse.torch as hs
from hvd_sparse import RankMismatchError

warnings.simplefilter("ignore")
VARIANTS = [(m, {}) for m in hvd_sparse.available()] + [
    ("exdyna", {"rebalance": "neighbour"}), ("exdyna", {"rebalance": "histogram"}),
    ("exdyna", {"threshold_scaling": "tracking"}), ("topk", {"pattern": "union"}),
    ("randomk", {"shared_seed": True})]


def train(model: torch.nn.Module, compression, steps: int, nan_at: int | None = None,
          nan_param: str | None = None) -> str:
    """Train ``steps`` steps of SGD on rank-dependent data; returns a digest of the weights."""
    named = list(model.named_parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=named, compression=compression)
    inputs = model_inputs(model)
    for step in range(steps):
        x = inputs * (1 + hvd.rank() + step)
        optimizer.zero_grad()
        loss = (model(x) ** 2).mean()
        loss.backward()
        optimizer.step()
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def model_inputs(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(1)
    width = model.in_features if isinstance(model, (Vector, WithEmpty)) else model[0].in_features
    return torch.randn(4, width)


class Vector(torch.nn.Module):
    """A model of exactly n parameters: one vector, applied elementwise."""

    def __init__(self, n: int):
        super().__init__()
        torch.manual_seed(0)
        self.in_features = n
        self.w = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return x * self.w


class WithEmpty(torch.nn.Module):
    """A linear layer and a zero-size parameter that takes part in the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.in_features = 8
        self.fc = torch.nn.Linear(8, 4)
        self.empty = torch.nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.fc(x) + self.empty.sum()


def mlp(*widths: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return torch.nn.Sequential(*layers)


def sweep(size: int, rank: int) -> None:
    for case, (method, options) in enumerate(VARIANTS):
        for n in sorted({1, size - 1, size, 31, 32 * size} - {0}):
            label = f"{method}{options or ''}/n={n}"
            model = Vector(n)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)

            def body(model=model, method=method, options=options, n=n, case=case):
                compression = hvd_sparse.create(method, framework="torch", density=0.1,
                                                named_parameters=list(model.named_parameters()),
                                                prefix=f"sweep{case}.{n}", **options)
                return train(model, compression, 3)

            results = outcome(hvd, f"sweep{case}.{n}", body)
            assert all(r == results[0] for r in results), f"{label}: ranks differ: {results}"
            kind, detail = results[0]
            if kind != "ok":
                assert n < size and kind == "ConfigurationError", f"{label}: {results[0]}"
                assert "use a larger model" in detail, f"{label}: {detail}"
            print(f"CHECKED sweep/{label} {kind} rank={rank}", flush=True)
    # A zero-size parameter next to a real layer: passed through by every method.
    for method, options in (("topk", {}), ("lags", {"merge_threshold": 0}), ("exdyna", {})):
        model = WithEmpty()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)

        def body(model=model, method=method, options=options):
            compression = hvd_sparse.create(method, framework="torch", density=0.1, prefix=f"empty.{method}",
                                            named_parameters=list(model.named_parameters()), **options)
            return train(model, compression, 3)

        results = outcome(hvd, f"empty.{method}", body)
        assert results[0][0] == "ok" and all(r == results[0] for r in results), f"{method}: {results}"
        print(f"CHECKED empty/{method} rank={rank}", flush=True)


def mismatch(size: int, rank: int) -> None:
    odd = rank == 1

    def pair(mine: str, other: str, density: float = 0.01, **options):
        """A compressor factory: method ``mine`` on rank 0, ``other`` on rank 1."""
        return lambda **kw: getattr(hs, other if odd else mine)(density, **options, **kw)

    cases = {
        "density": (lambda **kw: hs.ExDyna(0.02 if odd else 0.01, **kw), mlp(8, 16, 4), None,
                    "density=0.01 on rank 0, 0.02 on rank 1"),
        "method-topk": (pair("ExDyna", "TopK"), mlp(8, 16, 4), None,
                        "rank 0 runs 'exdyna', ranks [1] run 'topk'"),
        "method-micro": (pair("ExDyna", "MiCRO"), mlp(8, 16, 4), None, "ranks [1] run 'micro'"),
        "method-deft": (pair("ExDyna", "DEFT"), mlp(8, 16, 4), None, "ranks [1] run 'deft'"),
        "hyperparameter": (lambda **kw: hs.ExDyna(0.01, threshold_scaling="tracking" if odd else "paper",
                                                  **kw),
                           mlp(8, 16, 4), None, "threshold_scaling='paper' on rank 0, 'tracking' on rank 1"),
        "wider-layer": (pair("TopK", "TopK", 0.1), mlp(8, 17 if odd else 16, 4), None,
                        "0.weight [16, 8] float32 on rank 0, [17, 8] float32 on rank 1"),
        "order": (pair("TopK", "TopK", 0.1), mlp(8, 16, 4), "reversed", "same order on every rank"),
    }
    for method in ("ExDyna", "DEFT", "LAGS", "TopK"):
        cases[f"extra-layer-{method}"] = (lambda m=method, **kw: getattr(hs, m)(0.1, **kw),
                                          mlp(8, 16, 16, 4) if odd else mlp(8, 16, 4), None,
                                          "rank 0 has 4 tensors, rank 1 6")
    for label, (make, model, order, expected) in cases.items():
        named = list(model.named_parameters())
        if order == "reversed" and odd:
            named = named[::-1]

        def body(make=make, model=model, named=named, label=label):
            compression = make(named_parameters=named, prefix=f"mm.{label}")
            return train(model, compression, 2)

        results = outcome(hvd, f"mm.{label}", body)
        for r, (kind, detail) in enumerate(results):
            assert kind == RankMismatchError.__name__, f"{label}: rank {r} got {kind}: {detail}"
            assert expected in detail, f"{label}: rank {r}: {detail}"
        print(f"CHECKED mismatch/{label} rank={rank}", flush=True)


def late_after_compress(compression, param, flags: dict) -> None:
    """While ``flags["late"]``, hold this rank between compressing ``param``'s gradient (the
    last hook of the backward pass) and Horovod's allreduce of what compress returned: the other
    rank then raises long before that allreduce can complete, and its next step must not find
    the name still in flight."""
    compress = compression.compress

    def held(tensor):
        out = compress(tensor)
        if flags["late"] and tensor.shape == param.shape:
            time.sleep(1.0)
        return out
    compression.compress = held


def nonfinite(size: int, rank: int) -> None:
    """A NaN on rank 1 at step 2 (in one tensor only: the other buckets finish their step). Per
    tensor, TopK packs 0.weight, 0.bias and 1.weight into one bucket, which raises; 1.bias, under
    ``dense_below``, has a bucket of its own, which finishes and takes its step back."""
    def topk(density, **options):
        return hs.TopK(density, dense_below=5, **options)

    for label, make in (("exdyna", hs.ExDyna), ("topk-tensor", topk)):
        model = mlp(8, 16, 4)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        named = list(model.named_parameters())
        compression = make(0.1, named_parameters=named, nonfinite="raise", prefix=f"nf.{label}")
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                             named_parameters=named, compression=compression)
        poison = {"on": False, "late": False}
        model[0].weight.register_hook(lambda g, poison=poison: g * float("nan") if poison["on"] else g)
        late_after_compress(compression, model[0].weight, poison)
        inputs, raised = model_inputs(model), 0
        for step in range(6):
            poison["on"] = step == 2 and rank == 1
            poison["late"] = step == 2 and rank == 0
            optimizer.zero_grad()
            (model(inputs * (1 + rank + step)) ** 2).mean().backward()
            try:
                optimizer.step()
            except FloatingPointError as error:
                assert "applied nowhere" in str(error), error
                raised += 1
                # The recovery docs/usage.md#non-finite-gradients gives: reset Horovod's per-step bookkeeping.
                optimizer.load_state_dict(optimizer.state_dict())
        assert raised == 1, f"{label}: raised {raised} times"
        if label == "topk-tensor":
            assert set(compression.state_dict()["buckets"]) == {"0.weight-1.weight", "1.bias"}
        digests = hvd.allgather_object(
            (b"".join(p.detach().numpy().tobytes() for p in model.parameters()),
             compression.stats()["step"]), name=f"nf.{label}.end")
        assert all(d == digests[0] for d in digests), f"{label}: ranks differ after the raised step"
        assert digests[0][1] == 5, digests[0][1]   # 6 steps, one of them applied nowhere
        print(f"CHECKED nonfinite/{label} rank={rank}", flush=True)


def die(method: str, how: str, rank: int) -> None:
    model = mlp(8, 64, 64, 4)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    compression = hs.ExDyna(0.05, named_parameters=named) if method == "exdyna" else \
        hs.TopK(0.05, named_parameters=named)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=named, compression=compression)
    inputs = model_inputs(model)
    try:
        for step in range(400):
            if step == 20 and rank == 1:
                print(f"DYING rank={rank} how={how} at={time.time():.3f}", flush=True)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                sys.exit(0)
            optimizer.zero_grad()
            (model(inputs * (1 + rank)) ** 2).mean().backward()
            optimizer.step()
    except Exception as error:
        print(f"SURVIVOR_ERROR rank={rank} {type(error).__name__}: {str(error)[:200]}", flush=True)
        os._exit(1)   # what a training script does with an unhandled error, without the atexit hang
    print(f"SURVIVOR_FINISHED rank={rank}", flush=True)


def main() -> None:
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    torch.set_num_threads(1)
    parts = sys.argv[1].split(",")
    if parts == ["die"]:
        die(sys.argv[2], sys.argv[3], rank)
        return
    for part in parts:
        {"sweep": sweep, "mismatch": mismatch, "nonfinite": nonfinite}[part](size, rank)
    hvd.allreduce(torch.ones(1), name="final")   # no rank left behind
    print(f"PASSED rank={rank} size={size}", flush=True)


if __name__ == "__main__":
    main()
