"""The word-level language model in TensorFlow / Keras, for real Horovod TensorFlow jobs.

The architecture of ``tasks.WordLSTM`` (embedding, stacked LSTM layers without biases, untied
linear decoder): the same seven tensors with the same sizes, so a dense step moves the same bytes
in both frameworks. The data are ``words.word_corpus`` / ``words.word_batch`` (NumPy). TensorFlow
is imported inside the functions, so importing this module costs nothing until a model is built;
under Horovod's Keras optimizer use Keras 2 (``TF_USE_LEGACY_KERAS=1``, docs/architecture.md#keras).
"""

from __future__ import annotations

import numpy as np

from . import words


def keras_word_lstm(seed: int = 0, vocab_size: int = words.VOCAB_SIZE, embedding: int = 256,
                    hidden: int = 256, layers: int = 2):
    """A ``tf.keras.Model`` from int token ids (batch, time) to next-token logits (batch, time,
    vocab_size); every weight uniform in ±``words.INIT_RANGE`` from ``seed``, the decoder's bias 0."""
    import tensorflow as tf

    def uniform(i: int):
        return tf.keras.initializers.RandomUniform(-words.INIT_RANGE, words.INIT_RANGE,
                                                   seed=seed * 64 + i)

    inputs = tf.keras.Input((None,), dtype="int64")
    x = tf.keras.layers.Embedding(vocab_size, embedding, embeddings_initializer=uniform(0))(inputs)
    for layer in range(layers):
        x = tf.keras.layers.LSTM(hidden, return_sequences=True, use_bias=False,
                                 kernel_initializer=uniform(2 * layer + 1),
                                 recurrent_initializer=uniform(2 * layer + 2))(x)
    outputs = tf.keras.layers.Dense(vocab_size, kernel_initializer=uniform(2 * layers + 1))(x)
    return tf.keras.Model(inputs, outputs, name="word_lstm")


def weights_from_torch(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The Keras model's weights (``model.set_weights``) from ``tasks.WordLSTM``'s parameters as
    NumPy arrays, in ``named_parameters`` order: the LSTM and decoder matrices are transposed (the
    gate order, input-forget-cell-output, is the same), so both models compute the same function."""
    embed, *rest = arrays
    *lstm, decoder, bias = rest
    return [embed, *(w.T for w in lstm), decoder.T, bias]


def keras_perplexity(model, x: np.ndarray, y: np.ndarray, batch_size: int = 64) -> float:
    """exp(mean cross-entropy) of ``model`` on inputs ``x`` and targets ``y`` (e.g.
    ``words.eval_windows``), in batches of ``batch_size`` windows."""
    import tensorflow as tf

    nats = 0.0
    for i in range(0, len(x), batch_size):
        logits = model(x[i: i + batch_size], training=False)
        nats += float(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y[i: i + batch_size], logits=logits)))
    return float(np.exp(nats / y.size))
