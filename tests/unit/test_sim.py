"""The N-rank simulator's command line (python -m hvd_sparse.sim), its dense baseline and the
character-level LSTM task. Short runs (a few steps on 2-4 simulated ranks)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from hvd_sparse.sim import RECORD_FIELDS, simulate  # noqa: E402
from hvd_sparse.sim.__main__ import main, parse_options, parse_value  # noqa: E402
from hvd_sparse.sim.tasks import CHARSET, TASKS, UNKNOWN, VOCAB, encode, english_text, split_text  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_cli(tmp_path, *args: str) -> dict:
    out = tmp_path / "run.json"
    assert main([*args, "--out", str(out), "--log-every", "0"]) == 0
    return json.loads(out.read_text())


# --- the command line --------------------------------------------------------------------------------
EXDYNA_MODES = [[], ["--option", "threshold_scaling=tracking"], ["--option", "rebalance=neighbour"]]


@pytest.mark.parametrize("options", EXDYNA_MODES, ids=["paper", "tracking", "neighbour"])
def test_cli_writes_every_field_per_step(tmp_path, options):
    size, steps = 4, 6
    run = run_cli(tmp_path, "--method", "exdyna", "--world-size", str(size), "--density", "0.01",
                  "--model", "digits", "--steps", str(steps), "--evaluate-every", "3", *options)
    assert run["config"]["hyperparameters"]["density"] == 0.01
    for option in options[1::2]:
        key, value = option.split("=")
        assert run["config"]["hyperparameters"][key] == value
    records = run["records"]
    assert [r["step"] for r in records] == list(range(steps))
    numel = sum(p.numel() for p in TASKS["digits"]().model.parameters())
    for r in records:
        assert set(RECORD_FIELDS) <= set(r)
        for per_rank in ("counts", "bytes_sent", "bytes_received", "residual_norm"):
            assert len(r[per_rank]) == size
        assert r["density_target"] == 0.01
        assert r["density_actual"] == pytest.approx(r["union"] / numel)
        assert r["buildup"] == pytest.approx(r["union"] / r["k"])
        assert isinstance(r["threshold"], float)           # one λ shared by every rank
        assert r["union"] == sum(r["counts"])              # exclusive: no build-up
        assert r["imbalance"] == pytest.approx(size * max(r["counts"]) / sum(r["counts"]) - 1)
        bounds = r["partition"]                            # neighbour mode: rebuilt from own ranges
        assert len(bounds) == size + 1 and bounds[0] == 0 and bounds[-1] == numel
        assert all(lo < hi for lo, hi in itertools.pairwise(bounds))
        assert all(norm > 0 for norm in r["residual_norm"])
    assert "accuracy" in records[2] and "accuracy" in records[5] and "accuracy" not in records[3]
    assert run["summary"]["accuracy"] == records[-1]["accuracy"]


@pytest.mark.parametrize("method", ["micro", "deft"])
def test_exclusive_methods_union_is_the_sum_of_counts(tmp_path, method):
    run = run_cli(tmp_path, "--method", method, "--world-size", "3", "--density", "0.02",
                  "--steps", "5", "--model", "digits-mlp")
    for r in run["records"]:
        assert r["union"] == sum(r["counts"]) + r["common"]
        assert r["common"] == 0 or method == "deft"


def test_independent_selections_build_up(tmp_path):
    run = run_cli(tmp_path, "--method", "topk", "--world-size", "4", "--density", "0.01", "--steps", "4")
    for r in run["records"]:
        assert r["counts"] == [r["k"]] * 4 and r["imbalance"] == 0
        assert r["k"] < r["union"] <= 4 * r["k"]
        assert r["threshold"] is None


def test_per_rank_thresholds_are_listed(tmp_path):
    run = run_cli(tmp_path, "--method", "gaussiank", "--world-size", "3", "--steps", "3",
                  "--momentum", "0")
    assert all(isinstance(r["threshold"], list) and len(r["threshold"]) == 3 for r in run["records"])


def test_option_values_and_refusals(tmp_path):
    assert parse_value("tracking") == "tracking" and parse_value("8") == 8
    assert parse_value("0.5") == 0.5 and parse_value("True") is True and parse_value("none") is None
    assert parse_options(["num-blocks=auto", "agreed_k=true"]) == {"num_blocks": "auto", "agreed_k": True}
    with pytest.raises(SystemExit, match="key=value"):
        parse_options(["tracking"])
    with pytest.raises(SystemExit):
        main(["--method", "nonsense", "--steps", "1"])
    from hvd_sparse.errors import ConfigurationError
    with pytest.raises(ConfigurationError, match="threshold_scaling"):
        main(["--method", "exdyna", "--option", "threshold_scaling=magic", "--steps", "1"])


# --- the dense baseline ---------------------------------------------------------------------------------
def plain_average_losses(task: str, size: int, steps: int, lr: float, momentum: float) -> list[float]:
    """The reference: per-rank gradients averaged with torch.stack(...).mean(0), no engine."""
    job = TASKS[task](batch_size=16, seed=0)
    params = list(job.model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    losses = []
    for step in range(steps):
        grads, step_losses = [], []
        for rank in range(size):
            job.model.zero_grad(set_to_none=True)
            loss = job.loss(job.model, job.batch(rank, step))
            loss.backward()
            grads.append([p.grad.clone() for p in params])
            step_losses.append(loss.item())
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        optimizer.step()
        losses.append(float(np.mean(step_losses)))
    return losses


def test_dense_baseline_is_the_plain_average():
    size, steps = 4, 8
    reference = plain_average_losses("digits", size, steps, lr=0.1, momentum=0.9)
    records = simulate("dense", size, steps, task="digits", lr=0.1, momentum=0.9)
    np.testing.assert_allclose([r["loss"] for r in records], reference, rtol=1e-5)
    for r in records:
        assert r["density_actual"] == 1.0 and r["buildup"] == 1.0 and r["imbalance"] == 0.0
        assert r["residual_norm"] == [0.0] * size
        assert r["bytes_sent"] == [4 * r["k"]] * size     # one fp32 allreduce of the whole model
    sparse = simulate("topk", size, steps, task="digits", lr=0.1, momentum=0.9, density=0.01)
    assert not np.allclose([r["loss"] for r in sparse], reference, rtol=1e-3)


# --- the character-level LSTM task ---------------------------------------------------------------------
def test_text_encoding_and_held_out_split():
    text = english_text()
    assert len(text) > 100_000 and "def" in text
    codes = encode(text)
    assert codes.size == len(text) and codes.max() < VOCAB
    ascii_ok = np.array([c in CHARSET for c in text[:5000]])
    np.testing.assert_array_equal(codes[:5000] == UNKNOWN, ~ascii_ok)
    assert "".join(CHARSET[c] for c in codes[:200]) == text[:200] or not ascii_ok[:200].all()
    train, held = split_text(codes)
    assert train.size + held.size == codes.size
    assert 0.08 < held.size / codes.size < 0.12
    np.testing.assert_array_equal(held[:1000], codes[9000:10000])   # the 10th chunk, held out


def test_lstm_batches_and_perplexity():
    job = TASKS["lstm"](batch_size=4, seed=0, seq_len=32, eval_chars=4000)
    x, y = job.batch(0, 0)
    assert x.shape == y.shape == (4, 32)
    np.testing.assert_array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())   # next character
    np.testing.assert_array_equal(job.batch(0, 0)[0].numpy(), x.numpy())  # deterministic ...
    assert not torch.equal(job.batch(1, 0)[0], x)                       # ... and per rank
    before = job.evaluate(job.model)
    assert 40 < before["perplexity"] < 2 * VOCAB                       # untrained: near uniform
    assert before["bits_per_char"] == pytest.approx(np.log2(before["perplexity"]))
    records = simulate("dense", 2, 40, task="lstm", lr=2.0, clip_norm=1.0, evaluate_every=40,
                       batch_size=4, task_options={"seq_len": 32, "eval_chars": 4000})
    assert records[-1]["perplexity"] < 0.5 * before["perplexity"]
