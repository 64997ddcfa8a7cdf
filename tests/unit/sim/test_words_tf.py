"""The word-level language model in Keras (hvd_sparse/sim/words_tf.py): the PyTorch model's
tensors and parameter count, the same function given the same weights, and its perplexity."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("tensorflow")

from hvd_sparse.sim import words, words_tf  # noqa: E402
from hvd_sparse.sim.tasks import word_lstm_model  # noqa: E402


def test_the_keras_model_has_the_torch_models_tensors():
    keras_model = words_tf.keras_word_lstm(seed=0)
    torch_model = word_lstm_model(seed=0)
    assert keras_model.count_params() == sum(p.numel() for p in torch_model.parameters()) == 6_178_576
    converted = words_tf.weights_from_torch([p.detach().numpy() for p in torch_model.parameters()])
    assert [w.shape for w in converted] == [tuple(w.shape) for w in keras_model.weights]
    weights = keras_model.get_weights()
    assert max(float(np.abs(w).max()) for w in weights) <= np.float32(words.INIT_RANGE)
    assert not weights[-1].any()                                        # the decoder's bias
    again, other = words_tf.keras_word_lstm(seed=0), words_tf.keras_word_lstm(seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(weights, again.get_weights(), strict=True))
    assert not np.array_equal(weights[0], other.get_weights()[0])


def test_with_the_torch_weights_it_computes_the_same_logits_and_perplexity():
    vocab, size = 50, 8
    torch_model = word_lstm_model(seed=3, vocab_size=vocab, embedding=size, hidden=size)
    with torch.no_grad():                       # weights large enough for every gate to matter
        for p in torch_model.parameters():
            p.uniform_(-1.0, 1.0)
    keras_model = words_tf.keras_word_lstm(vocab_size=vocab, embedding=size, hidden=size)
    keras_model.set_weights(words_tf.weights_from_torch(
        [p.detach().numpy() for p in torch_model.parameters()]))
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocab, (5, 9)), rng.integers(0, vocab, (5, 9))
    expected = torch_model(torch.from_numpy(x)).detach()
    np.testing.assert_allclose(keras_model(x).numpy(), expected.numpy(), rtol=1e-4, atol=1e-4)
    nats = torch.nn.functional.cross_entropy(expected.reshape(-1, vocab), torch.from_numpy(y).reshape(-1))
    assert words_tf.keras_perplexity(keras_model, x, y, batch_size=2) == pytest.approx(
        float(np.exp(nats.item())), rel=1e-4)
