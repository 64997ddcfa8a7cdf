"""The DDP face and the Horovod face make the same decisions: for the same model, data and seed,
a torchrun job through DDP hooks and a horovodrun job through ``hvd.DistributedOptimizer`` end
every step with bit-identical residuals, momentum velocities and control states (thresholds,
partitions and rebalancing, DEFT's unit tables, ...) and apply bit-identical gradients, for
every method (workers/ddp_vs_horovod.py records; this test compares).

At 2 ranks, where a sum over ranks is exact whatever order each library adds in; at more ranks
Gloo's allreduce in Horovod and in torch.distributed may add in different orders, and the last
bit of an average may differ.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tests.multiproc.launch import assert_passed, launch
from tests.multiproc.torchrun import assert_ranks_passed, torchrun

pytestmark = pytest.mark.multiproc

SIZE = 2


def assert_same(a, b, where: str) -> None:
    """Equal, recursively; arrays bit for bit (NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.timeout(400)
def test_ddp_and_horovod_faces_decide_alike(tmp_path):
    ddp_out, horovod_out = tmp_path / "ddp", tmp_path / "horovod"
    assert_ranks_passed(torchrun("ddp_vs_horovod.py", SIZE, ["ddp", str(ddp_out)], timeout=180), SIZE)
    assert_passed(launch("ddp_vs_horovod.py", SIZE, "gloo", ["horovod", str(horovod_out)], timeout=180),
                  SIZE)
    names = sorted(p.name for p in ddp_out.glob("*.pkl"))
    assert names == sorted(p.name for p in horovod_out.glob("*.pkl")) and len(names) == 13 * SIZE
    for name in names:
        with open(ddp_out / name, "rb") as a, open(horovod_out / name, "rb") as b:
            assert_same(pickle.load(a), pickle.load(b), name)
