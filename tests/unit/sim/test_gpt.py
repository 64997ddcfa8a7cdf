"""The transformer task (hvd_sparse/sim/gpt.py, gpt_tf.py, tasks.gpt_task): the model's tensors,
its tied decoder and causal attention, the "tree" corpus it reads, the Keras twin computing the same
function from the same weights, and the simulator training it with AdamW, plain and on the Adam
path."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_sparse.sim import gpt, simulate, words  # noqa: E402
from hvd_sparse.sim.tasks import TASKS, task_info  # noqa: E402


def test_the_model_is_gpt2s_block_at_the_tasks_size():
    model = gpt.gpt_model(seed=0)
    named = dict(model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == 929_280
    assert named["wte.weight"].shape == (gpt.VOCAB_SIZE, gpt.WIDTH)        # the tied decoder is it
    assert [n for n in named if n.startswith("blocks.0.")] == [
        f"blocks.0.{n}" for n in ("ln_1.weight", "ln_1.bias", "qkv.weight", "qkv.bias", "attn_proj.weight",
                                  "attn_proj.bias", "ln_2.weight", "ln_2.bias", "fc.weight", "fc.bias",
                                  "mlp_proj.weight", "mlp_proj.bias")]
    assert float(named["blocks.0.qkv.weight"].detach().std()) == pytest.approx(gpt.INIT_STD, rel=0.05)
    projection = named["blocks.0.mlp_proj.weight"].detach()
    assert float(projection.std()) == pytest.approx(gpt.INIT_STD / 2, rel=0.05)
    assert torch.equal(gpt.gpt_model(seed=0).wte.weight, named["wte.weight"])


def test_attention_is_causal_and_the_context_bounded():
    model = gpt.gpt_model(seed=1, vocab_size=50)
    ids = torch.randint(0, 50, (2, 12))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 50
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.equal(a[:, 8:], b[:, 8:])
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, gpt.CONTEXT + 1, dtype=torch.long))


def test_the_tree_corpus_is_the_whole_standard_library_without_tests():
    corpus = words.word_corpus(gpt.VOCAB_SIZE, scope=gpt.CORPUS_SCOPE)
    top = words.word_corpus(gpt.VOCAB_SIZE)
    info = corpus.info()
    assert info["corpus"] == "python-stdlib-tree" and info["files"] > 3 * top.info()["files"]
    assert corpus.train.size > 2 * top.train.size
    assert not any(set(name.split("/")[:-1]) & words.TREE_EXCLUDED for name in corpus.files)
    assert any(name.startswith("asyncio/") for name in corpus.files)
    assert task_info("gpt")["sha256"] == info["sha256"]
    with pytest.raises(ValueError, match="scope"):
        words.source_files(scope="everything")


def test_the_keras_twin_computes_the_same_logits_from_the_same_weights():
    tf = pytest.importorskip("tensorflow")
    from hvd_sparse.sim import gpt_tf

    keras_model = gpt_tf.keras_gpt(seed=3, vocab_size=300)
    torch_model = gpt.gpt_model(3, vocab_size=300)
    ordered = gpt_tf.ordered_weights(keras_model)
    assert [tuple(v.shape) for v in ordered] == [
        tuple(p.shape[::-1]) if n.endswith(".weight") and p.dim() == 2 and not n.startswith(("wte", "wpe"))
        else tuple(p.shape) for n, p in torch_model.named_parameters()]
    ids = np.random.default_rng(4).integers(0, 300, (2, 17))
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(keras_model(tf.constant(ids)).numpy(), expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("adam_path", [False, True])
def test_the_simulator_trains_it_with_adamw(adam_path):
    records = simulate("exdyna", 2, 12, density=0.01, task="gpt", optimizer="adamw", lr=3e-3,
                       adam_path=adam_path, options={"threshold_scaling": "tracking", "dense_steps": 4}
                       if adam_path else {"threshold_scaling": "tracking"}, evaluate_every=12,
                       task_options={"eval_tokens": 2048})
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert np.isfinite(records[-1]["perplexity"])
    if adam_path:
        assert [r["density_actual"] for r in records[:4]] == [1.0] * 4 and records[-1]["density_actual"] < 0.1


def test_the_adam_path_needs_adamw_and_a_run_longer_than_its_dense_steps():
    with pytest.raises(ValueError, match="adam_path needs optimizer='adamw'"):
        simulate("topk", 2, 5, task="gpt", adam_path=True)
    with pytest.raises(ValueError, match="ends before its dense steps"):
        simulate("topk", 2, 50, task="gpt", optimizer="adamw", adam_path=True)
    assert "gpt" in TASKS
