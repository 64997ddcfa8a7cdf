"""Real torchrun jobs (Gloo; 2 ranks on one agent, 4 ranks on two agents as on two hosts) with
every method as a DDP communication hook (hvd_sparse/torch/ddp.py).

Each worker trains through DistributedDataParallel, several methods per job, and checks on every
rank and every step the applied gradient and the residual against a reference re-derived from
every rank's accumulated vector, and identical parameters at the end (workers/ddp_*.py). The
baselines job also checks the torch.distributed driver against the local one, the statistics, a
checkpoint resumed at another world size, and the refusals: a rank with another method, density
or model, and a non-finite gradient under nonfinite="raise", each raised alike on every rank.
"""

from __future__ import annotations

import pytest

from tests.multiproc.launch import REPO
from tests.multiproc.torchrun import assert_ranks_passed, print_failure, torchrun

pytestmark = pytest.mark.multiproc

EXCLUSIVE = ("exdyna/rebalance=exact", "exdyna/rebalance=neighbour", "exdyna/threshold_scaling=tracking",
             "micro", "deft/paper", "deft/agreed-heap", "lags/merged", "lags/adaptive")


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("size", "nnodes"), [(2, 1), (4, 2)])
def test_ddp_whole_model_methods_and_lags(size, nnodes):
    stdout = assert_ranks_passed(torchrun("ddp_exclusive.py", size, nnodes=nnodes, timeout=380), size)
    for config in EXCLUSIVE:
        assert stdout.count(f"CHECKED ddp/{config} ") == size, config


BASELINES = ("driver", "topk/tensor/gather", "topk/tensor/union", "topk/model/gather", "topk/model/union",
             "randomk/tensor/gather", "randomk/model/shared", "threshold/model/gather",
             "gaussiank/tensor/gather", "dgc/tensor/gather", "topk/dense_steps", "topk/float16",
             "topk/bfloat16", "topk/nan-skip", "topk/find_unused", "exdyna/saved")
REFUSALS = ("density", "method", "model", "nan-raise")


@pytest.mark.timeout(500)
@pytest.mark.parametrize(("size", "resume_size"), [(2, 3), (4, 2)])
def test_ddp_baselines_refusals_and_a_resume_at_another_world_size(size, resume_size, tmp_path):
    result = torchrun("ddp_baselines.py", size, [str(tmp_path)], timeout=400)
    stdout = assert_ranks_passed(result, size)
    for config in BASELINES:
        assert stdout.count(f"CHECKED ddp/{config} ") == size, config
    for what in REFUSALS:   # every rank raised, with one message for all (checked in the worker)
        assert stdout.count(f"REFUSED {what} rank=") == size, what
    assert stdout.count("AVERAGED rank=") == size
    assert stdout.count("SKIPPED topk/nan-skip step 3") == 6   # rank 1, each of 6 tensors
    assert "non-finite gradient" in result.stderr and "on rank 1 at step 3" in result.stderr
    assert (tmp_path / "ddp_stats.jsonl").read_text().count("\n") == 1
    assert len(list(tmp_path.glob("exdyna.rank*.pt"))) == size
    resumed = torchrun("ddp_baselines.py", resume_size, [str(tmp_path), "resume"], timeout=200)
    assert assert_ranks_passed(resumed, resume_size).count("CHECKED ddp/exdyna/resumed ") == resume_size
    assert "resuming at" in resumed.stderr   # the world-size change is announced


@pytest.mark.timeout(200)
def test_the_digits_example_learns_under_torchrun():
    result = torchrun(str(REPO / "examples" / "digits_ddp.py"), 2,
                      ["--method", "exdyna", "--epochs", "4", "--min-accuracy", "0.5"], timeout=180)
    print_failure(result)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "done: weights identical on all 2 ranks" in result.stdout


@pytest.mark.timeout(300)
def test_ddp_adam_path():
    """Methods on the Adam path as DDP hooks, with hvd_sparse.torch.optim.AdamW (workers/ddp_adam.py)."""
    stdout = assert_ranks_passed(torchrun("ddp_adam.py", 2, timeout=280), 2)
    for config in ("exdyna", "deft", "lags", "topk", "dgc", "exdyna/shared-v", "resume"):
        assert stdout.count(f"CHECKED ddp/{config} ") == 2, config
