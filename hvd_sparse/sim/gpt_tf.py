"""The transformer task's model in TensorFlow / Keras, for real Horovod TensorFlow jobs.

``KerasGPT`` computes ``gpt.GPT``'s function with the same tensors, created in the same order as
``GPT.named_parameters()`` (``weights_for_keras`` transposes the linear layers' matrices), so a
dense step moves the same bytes in both frameworks and the two start from the same weights. The
data are ``words.word_corpus(scope="tree")`` / ``words.word_batch`` (NumPy). TensorFlow is imported
inside the functions; under Horovod's Keras optimizer use Keras 2 (``TF_USE_LEGACY_KERAS=1``).
"""

from __future__ import annotations

import math

import numpy as np

from . import gpt

LAYER_NORM_EPS = 1e-5   # torch.nn.LayerNorm's


BLOCK_TENSORS = ("ln_1.weight", "ln_1.bias", "qkv.weight", "qkv.bias", "attn_proj.weight", "attn_proj.bias",
                 "ln_2.weight", "ln_2.bias", "fc.weight", "fc.bias", "mlp_proj.weight", "mlp_proj.bias")


def keras_gpt(seed: int = 0, vocab_size: int = gpt.VOCAB_SIZE, width: int = gpt.WIDTH,
              layers: int = gpt.LAYERS, heads: int = gpt.HEADS, context: int = gpt.CONTEXT):
    """A ``tf.keras.Model`` from int token ids (batch, time) to next-token logits (batch, time,
    vocab_size), its weights ``gpt.gpt_model(seed, ...)``'s."""
    import tensorflow as tf

    class KerasGPT(tf.keras.Model):
        """GPT's blocks over weights made in ``GPT.named_parameters()`` order."""

        def __init__(self):
            super().__init__(name="gpt")
            shapes = _block_shapes(width)

            def weight(name: str, shape: tuple) -> tf.Variable:
                return self.add_weight(name=name, shape=shape, initializer="zeros", trainable=True)

            self.wte, self.wpe = weight("wte", (vocab_size, width)), weight("wpe", (context, width))
            self.block_weights = [{n: weight(f"blocks.{b}.{n}", shapes[n]) for n in BLOCK_TENSORS}
                                  for b in range(layers)]
            self.ln_f = (weight("ln_f.weight", (width,)), weight("ln_f.bias", (width,)))

        def call(self, ids, training=False):
            x = tf.gather(self.wte, ids) + self.wpe[:tf.shape(ids)[1]]
            for w in self.block_weights:
                x = _block(tf, x, w, heads)
            return tf.matmul(_norm(tf, x, *self.ln_f), self.wte, transpose_b=True)

    model = KerasGPT()
    torch_model = gpt.gpt_model(seed, vocab_size, width, layers, heads, context)
    names = [n for n, _ in torch_model.named_parameters()]
    values = weights_for_keras([p.detach().numpy() for _, p in torch_model.named_parameters()], names)
    for variable, value in zip(ordered_weights(model), values, strict=True):
        variable.assign(value)
    return model


def _block_shapes(width: int) -> dict[str, tuple[int, ...]]:
    return {"ln_1.weight": (width,), "ln_1.bias": (width,), "qkv.weight": (width, 3 * width),
            "qkv.bias": (3 * width,), "attn_proj.weight": (width, width), "attn_proj.bias": (width,),
            "ln_2.weight": (width,), "ln_2.bias": (width,), "fc.weight": (width, 4 * width),
            "fc.bias": (4 * width,), "mlp_proj.weight": (4 * width, width), "mlp_proj.bias": (width,)}


def _norm(tf, x, gamma, beta):
    """LayerNorm over the last axis, torch's epsilon."""
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + LAYER_NORM_EPS) * gamma + beta


def _block(tf, x, w: dict, heads: int):
    """gpt.Block: x + attn(ln(x)), then x + mlp(ln(x))."""
    x = x + _attention(tf, _norm(tf, x, w["ln_1.weight"], w["ln_1.bias"]), w, heads)
    h = _norm(tf, x, w["ln_2.weight"], w["ln_2.bias"])
    h = tf.nn.gelu(h @ w["fc.weight"] + w["fc.bias"], approximate=True)
    return x + h @ w["mlp_proj.weight"] + w["mlp_proj.bias"]


def _attention(tf, x, w: dict, heads: int):
    """Causal multi-head self-attention, as torch's scaled_dot_product_attention computes it."""
    batch, time, width = tf.shape(x)[0], tf.shape(x)[1], x.shape[-1]
    q, k, v = tf.split(x @ w["qkv.weight"] + w["qkv.bias"], 3, axis=-1)

    def heads_of(t):
        return tf.transpose(tf.reshape(t, [batch, time, heads, width // heads]), [0, 2, 1, 3])

    q, k, v = heads_of(q), heads_of(k), heads_of(v)
    scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(width // heads)
    causal = tf.linalg.band_part(tf.ones([time, time], dtype=scores.dtype), -1, 0)
    scores = tf.where(causal > 0, scores, tf.fill(tf.shape(scores), tf.constant(-1e30, scores.dtype)))
    out = tf.matmul(tf.nn.softmax(scores, axis=-1), v)
    out = tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [batch, time, width])
    return out @ w["attn_proj.weight"] + w["attn_proj.bias"]


def ordered_weights(model) -> list:
    """``model``'s weights in ``GPT.named_parameters()`` order (Keras lists a subclassed model's
    weights in its own order): what a training loop differentiates, so that the gradients reach
    Horovod -- and the compressor's buckets -- as PyTorch's do."""
    out = [model.wte, model.wpe]
    for block in model.block_weights:
        out += list(block.values())
    return [*out, *model.ln_f]


def weights_for_keras(arrays: list[np.ndarray], names: list[str]) -> list[np.ndarray]:
    """``KerasGPT``'s weights from ``GPT.named_parameters()`` (``names``, ``arrays``): the linear
    layers' matrices transposed (torch keeps them as (out, in), the model multiplies x @ W)."""
    return [a.T if n.endswith(".weight") and a.ndim == 2 and not n.startswith(("wte", "wpe")) else a
            for a, n in zip(arrays, names, strict=True)]
