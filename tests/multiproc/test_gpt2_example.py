"""examples/gpt2.py as users run it: a Hugging Face GPT-2 with the Adam path, under torchrun (the
DDP hook) and horovodrun (the Horovod face), with the repository root on the path (the top-level
``kernels/`` folder that used to shadow the PyPI ``kernels`` package transformers imports is gone)."""

from __future__ import annotations

import json

import pytest

from tests.multiproc.launch import REPO, launch
from tests.multiproc.torchrun import torchrun

pytestmark = pytest.mark.multiproc

EXAMPLE = str(REPO / "examples" / "gpt2.py")
# 300 steps: the path's 100 dense steps, then 200 sparse ones (the loss rises for about 100 steps
# after the switch, then falls below where the dense steps left it).
STEPS = 300
ARGS = ["--method", "exdyna", "--option", "threshold_scaling=tracking", "--density", "0.01",
        "--steps", str(STEPS), "--log-every", "50"]


def check(result, out) -> dict:
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "done: weights identical on all 2 ranks" in result.stdout
    record = json.loads(out.read_text())
    losses = record["losses"]
    assert len(losses) == STEPS
    # It learns through the sparse steps: bytes are ~5.5 (ln 256) at the start.
    assert sum(losses[-20:]) / 20 < sum(losses[:10]) / 10 - 1.5
    assert sum(losses[-20:]) / 20 < sum(losses[90:110]) / 20
    # 100 dense steps of 300, then 1% of the entries (values and indices): about 0.35 of dense.
    assert 0.33 < record["bytes_sent"] / record["dense_bytes"] < 0.4
    return record


@pytest.mark.timeout(300)
def test_gpt2_learns_on_the_adam_path_under_torchrun(tmp_path):
    out = tmp_path / "ddp.json"
    check(torchrun(EXAMPLE, 2, [*ARGS, "--out", str(out)], timeout=280), out)


@pytest.mark.timeout(300)
def test_gpt2_learns_on_the_adam_path_under_horovodrun(tmp_path):
    out = tmp_path / "horovod.json"
    record = check(launch(EXAMPLE, 2, "gloo", [*ARGS, "--out", str(out)], timeout=280), out)
    assert record["face"] == "horovod"
