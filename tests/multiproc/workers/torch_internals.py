"""Worker: what hvd_sparse/torch/horovod_internals.py reads from Horovod, seen in a real job.

A probe compressor records, inside ``compress``, the op ``calling_optimizer_op`` reads, for every
way stock ``hvd.DistributedOptimizer`` calls it (per tensor, grouped, the Adasum optimizer) and
every reduction, then stops the step; the op must be exactly the one the optimizer was given, and
the optimizer ``calling_optimizer`` finds the one Horovod built, with the wrapped optimizer's
momentum (what the face warns about when its own momentum correction is on).
Then ``hs.TopK`` must be refused under Adasum and other ops, and train under Average. Run by
tests/multiproc/test_horovod_refusals.py; prints ``CHECKED torch/<case> rank=<r>``.
"""

from __future__ import annotations

import contextlib

import horovod.torch as hvd
import torch
from checks import check_op_refused
from horovod.torch.compression import Compressor

import hvd_sparse.torch as hs
from hvd_sparse.torch.compressor import optimizer_momentum
from hvd_sparse.torch.horovod_internals import calling_optimizer, calling_optimizer_op

OPS = {"Average": hvd.Average, "Sum": hvd.Sum, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}


class ProbeStopError(Exception):
    """Raised by the probe once it has recorded the op, so no collective of the step is issued."""


class Probe(Compressor):
    def __init__(self):
        self.seen: list = []
        self.optimizers: list = []
        self.expected = None   # the optimizer Horovod built, set before the backward pass

    def compress(self, tensor):
        self.seen.append(calling_optimizer_op(self))
        self.optimizers.append(calling_optimizer(self)[0])
        raise ProbeStopError

    def decompress(self, tensor, ctx):
        return tensor


def backward_through(compression, op, groups=None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    named = list(model.named_parameters())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                         named_parameters=named, compression=compression, op=op,
                                         groups=groups)
    if isinstance(compression, Probe):
        compression.expected = optimizer
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()


def probe(case: str, op, groups=None) -> None:
    compression = Probe()
    with contextlib.suppress(ProbeStopError):
        backward_through(compression, op, groups)
    assert compression.seen == [op], f"{case}: read {compression.seen}, the optimizer has op={op}"
    assert compression.optimizers == [compression.expected], f"{case}: found {compression.optimizers}"
    assert optimizer_momentum(compression.optimizers[0]) == "SGD(momentum=0.5)", case
    print(f"CHECKED torch/{case} rank={hvd.rank()}", flush=True)


def refused(case: str, op, groups=None) -> None:
    name = {hvd.Adasum: "Adasum", **{v: k for k, v in OPS.items()}}[op]
    check_op_refused(f"torch/{case}",
                     lambda: backward_through(hs.TopK(0.5, prefix=f"refused.{case}"), op, groups),
                     name, hvd.rank())


def main() -> None:
    hvd.init()
    assert hvd.size() > 1, "the Adasum optimizer is used only on more than one rank"
    for name, op in OPS.items():
        probe(f"probe/tensor/{name}", op)
        probe(f"probe/grouped/{name}", op, groups=1)
    probe("probe/adasum-optimizer", hvd.Adasum)
    assert calling_optimizer_op(Probe()) is None          # not called from compress at all
    assert calling_optimizer(Probe()) == (None, None)
    refused("refused/adasum", hvd.Adasum)
    refused("refused/sum", hvd.Sum)
    refused("refused/grouped-min", hvd.Min, groups=1)
    backward_through(hs.TopK(0.5, prefix="average"), hvd.Average)   # Average trains
    print(f"CHECKED torch/average-trains rank={hvd.rank()}", flush=True)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="test.final").item() == hvd.size()
    print(f"PASSED rank={hvd.rank()} size={hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
