"""Real Horovod jobs with the baseline sparsifiers (random-k, hard threshold, Gaussian-k, DGC),
fp16/bf16 gradients, backward_passes_per_step, non-finite gradients, and every refused input.

Each worker (workers/torch_baselines.py, workers/tf_baselines.py) checks, on every rank and every
step, the applied gradient and the residual against a reference built from every rank's vectors,
and identical parameters at the end; then it provokes each refused input and prints
``REFUSED <what> rank=<r>`` on every rank that raised; the job ends with a collective, so a rank
left hanging fails it (under a stall timeout). Four launches: 2 and 4 ranks, Gloo and MPI.
"""

from __future__ import annotations

import json

import pytest

from tests.multiproc.launch import assert_passed, launch

pytestmark = pytest.mark.multiproc

TORCH_CONFIGS = ("randomk/tensor/gather", "randomk/model/shared", "threshold/model/gather",
                 "threshold/tensor/union", "gaussiank/tensor/gather", "dgc/tensor/gather",
                 "topk/bpps2", "topk/float16", "topk/bfloat16", "topk/nan-skip")
TORCH_REFUSALS = ("adasum", "sum", "complex", "nan-raise")


def assert_refused_everywhere(stdout: str, size: int, refusals: tuple[str, ...]) -> None:
    for what in refusals:
        for rank in range(size):
            assert f"REFUSED {what} rank={rank}:" in stdout, f"{what} not refused on rank {rank}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("size", "controller"), [(2, "gloo"), (4, "mpi")])
def test_torch_baselines(size, controller, tmp_path):
    result = launch("torch_baselines.py", size, controller, [str(tmp_path)], timeout=400)
    stdout = assert_passed(result, size)
    for config in TORCH_CONFIGS:
        assert stdout.count(f"CHECKED torch/{config} ") == size, config
    assert_refused_everywhere(stdout, size, TORCH_REFUSALS)
    assert stdout.count("AVERAGED rank=") == size
    # rank 1 sent zeros for every tensor at the non-finite step, with a warning naming it
    assert stdout.count("SKIPPED topk/nan-skip step 3") == 4
    assert "non-finite gradient" in result.stderr and "on rank 1 at step 3" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "torch_stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4, 8]
    assert all(0 < r["density_actual"] <= 1 and r["buildup"] > 0 for r in records)


TF_CONFIGS = ("randomk/tensor/gather", "randomk/model/shared", "threshold/model/union",
              "threshold/tensor/gather", "gaussiank/tensor/gather", "dgc/tensor/gather",
              "topk/bfloat16", "topk/nan-skip", "keras/topk/bpps2", "keras/dgc")
TF_REFUSALS = ("adasum", "sum", "grouping", "complex", "nan-raise")


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("size", "controller"), [(2, "mpi"), (4, "gloo")])
def test_tensorflow_baselines(size, controller, tmp_path):
    result = launch("tf_baselines.py", size, controller, [str(tmp_path)], timeout=480)
    stdout = assert_passed(result, size)
    for config in TF_CONFIGS:
        assert stdout.count(f"CHECKED tf/{config} ") == size, config
    assert_refused_everywhere(stdout, size, TF_REFUSALS)
    assert stdout.count("AVERAGED rank=") == size
    assert stdout.count("SKIPPED topk/nan-skip step 3") == 4
    assert "non-finite gradient" in result.stderr and "on rank 1 at step 3" in result.stderr
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
