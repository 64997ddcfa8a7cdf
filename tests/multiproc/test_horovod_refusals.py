"""Real Horovod jobs (2 ranks, Gloo) that observe what hvd_sparse/{torch,tensorflow}/
horovod_internals.py read from Horovod: the reduction op, under every way stock Horovod calls a
compressor and every op, and the refusals it drives (tests/unit/test_horovod_internals.py checks
the same structure statically). A Horovod upgrade that moves any of it fails here."""

from __future__ import annotations

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

TORCH_CASES = ([f"probe/{kind}/{op}" for kind in ("tensor", "grouped")
                for op in ("Average", "Sum", "Min", "Max", "Product")]
               + ["probe/adasum-optimizer", "refused/adasum", "refused/sum", "refused/grouped-min",
                  "average-trains"])
TF_CASES = ([f"probe/{kind}/{op}" for kind in ("allreduce", "grouped", "tape")
             for op in ("Average", "Sum", "Min", "Max", "Product", "Adasum")]
            + ["probe/eager/Sum", "probe/keras", "refused/tape-adasum", "refused/tape-sum",
               "refused/grouped-min"])


@pytest.mark.timeout(300)
def test_torch_internals():
    stdout = assert_passed(launch("torch_internals.py", 2, "gloo", timeout=280), 2)
    for case in TORCH_CASES:
        assert stdout.count(f"CHECKED torch/{case} ") == 2, case


@pytest.mark.timeout(300)
def test_tensorflow_internals():
    stdout = assert_passed(launch("tf_internals.py", 2, "gloo", timeout=280), 2)
    for case in TF_CASES:
        assert stdout.count(f"CHECKED tf/{case} ") == 2, case
