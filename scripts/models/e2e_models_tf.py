"""The TensorFlow (tf-keras, Keras 2) models of scripts/models/e2e_models.py, imported by it when a
TensorFlow model is built; see there for the models. The same architectures and parameter counts
as e2e_models_torch.py, written with Keras layers (channels-last images). Keras 2 is what Horovod
0.28.1 and hvd_sparse's Keras face support: ``TF_USE_LEGACY_KERAS=1`` is set here (by default)
before TensorFlow is imported, as the project's TensorFlow workers do."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import tensorflow as tf

from .e2e_sizes import GPT

layers = tf.keras.layers


def legacy_model(name: str, input_shape: tuple[int, ...]) -> tf.keras.Model:
    """mlp25m, mlp7m and cnn: the torch models' layers and sizes (Keras' own initialisation)."""
    if name in ("mlp25m", "mlp7m"):
        width = 2048 if name == "mlp25m" else 1024
        stack = [layers.Dense(width, activation="relu") for _ in range(6)]
        stack += [layers.Dense(1024, activation="relu"), layers.Dense(10)]
    else:
        def conv(channels):
            return layers.Conv2D(channels, 3, padding="same", activation="relu")

        stack = [conv(32), conv(64), layers.MaxPool2D(2), conv(128), conv(128), layers.MaxPool2D(2),
                 conv(256), layers.GlobalAveragePooling2D(), layers.Dense(10)]
    return tf.keras.Sequential([tf.keras.Input(input_shape), *stack], name=name)


# --- ResNet ------------------------------------------------------------------------------------
def conv_bn(x, channels: int, kernel: int, stride: int = 1, relu: bool = True):
    """Bias-free convolution (torch's padding kernel // 2 on every side), BatchNorm (torch's
    epsilon and momentum), ReLU when asked."""
    if kernel > 1:
        x = layers.ZeroPadding2D(kernel // 2)(x)
    he_fan_out = tf.keras.initializers.VarianceScaling(2.0, "fan_out", "truncated_normal")
    x = layers.Conv2D(channels, kernel, stride, use_bias=False, kernel_initializer=he_fan_out)(x)
    x = layers.BatchNormalization(epsilon=1e-5, momentum=0.9)(x)
    return layers.ReLU()(x) if relu else x


def residual(x, planes: int, stride: int, bottleneck: bool):
    """A BasicBlock (two 3x3) or a Bottleneck (1x1, 3x3 with the stride, 1x1 to 4x the planes),
    plus the identity or a 1x1 projection."""
    out = planes * (4 if bottleneck else 1)
    if bottleneck:
        y = conv_bn(x, planes, 1)
        y = conv_bn(y, planes, 3, stride)
        y = conv_bn(y, out, 1, relu=False)
    else:
        y = conv_bn(x, planes, 3, stride)
        y = conv_bn(y, planes, 3, relu=False)
    shortcut = conv_bn(x, out, 1, stride, relu=False) if stride != 1 or x.shape[-1] != out else x
    return layers.ReLU()(layers.Add()([y, shortcut]))


def resnet(depth: int, input_shape: tuple[int, ...], classes: int = 1000) -> tf.keras.Model:
    """ResNet-18 or ResNet-50 (torchvision's layout, as in e2e_models_torch.resnet); logits."""
    bottleneck, counts = (False, (2, 2, 2, 2)) if depth == 18 else (True, (3, 4, 6, 3))
    inputs = tf.keras.Input(input_shape)
    x = conv_bn(inputs, 64, 7, 2)
    x = layers.MaxPool2D(3, 2)(layers.ZeroPadding2D(1)(x))
    for stage, count in enumerate(counts):
        for i in range(count):
            x = residual(x, 64 * 2**stage, 2 if stage > 0 and i == 0 else 1, bottleneck)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(classes)(x), name=f"resnet{depth}")


# --- GPT ---------------------------------------------------------------------------------------
class PositionEmbedding(layers.Layer):
    """A learned vector per position (up to the context), added to the token embeddings."""

    def __init__(self, context: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.table = self.add_weight("table", (context, width), initializer=normal())

    def call(self, x):
        return x + self.table[: tf.shape(x)[1]]


class TiedHead(layers.Layer):
    """The LM head: logits = hidden x (token embedding)^T, no bias (GPT-2's tied weights)."""

    def __init__(self, embedding: layers.Embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return tf.matmul(x, self.embedding.embeddings, transpose_b=True)


def normal(std: float = 0.02):
    return tf.keras.initializers.RandomNormal(0.0, std)


def block(x, width: int, heads: int, layers_count: int):
    """Pre-LayerNorm block: x + causal attention(LN(x)), then x + MLP(LN(x)) (4x, GELU)."""
    residual_init = normal(0.02 / (2 * layers_count) ** 0.5)
    h = layers.LayerNormalization(epsilon=1e-5)(x)
    h = layers.MultiHeadAttention(heads, width // heads, kernel_initializer=normal(),
                                  output_shape=width)(h, h, use_causal_mask=True)
    x = layers.Add()([x, h])
    h = layers.LayerNormalization(epsilon=1e-5)(x)
    h = layers.Dense(4 * width, activation="gelu", kernel_initializer=normal())(h)
    return layers.Add()([x, layers.Dense(width, kernel_initializer=residual_init)(h)])


def gpt(layers_count: int, width: int, heads: int, vocab: int, context: int) -> tf.keras.Model:
    """The GPT of e2e_models_torch.GPTModel: token ids (batch, sequence) -> logits (batch,
    sequence, vocabulary). Keras' attention initialises its output projection like the others
    (N(0, 0.02)); the MLP's second projection is scaled by 1/sqrt(2 x layers)."""
    ids = tf.keras.Input((None,), dtype="int32")
    embedding = layers.Embedding(vocab, width, embeddings_initializer=normal())
    x = PositionEmbedding(context, width)(embedding(ids))
    for _ in range(layers_count):
        x = block(x, width, heads, layers_count)
    x = layers.LayerNormalization(epsilon=1e-5)(x)
    return tf.keras.Model(ids, TiedHead(embedding)(x), name="gpt")


def build_model(name: str, input_shape: tuple[int, ...], seed: int) -> tf.keras.Model:
    """The model ``name`` from ``seed`` (``tf.keras.utils.set_random_seed``: Python, numpy and
    TensorFlow seeded, so the same weights on every rank)."""
    tf.keras.utils.set_random_seed(seed)
    if name in ("mlp25m", "mlp7m", "cnn"):
        return legacy_model(name, input_shape)
    if name in ("resnet18", "resnet50"):
        return resnet(int(name.removeprefix("resnet")), input_shape)
    if name == "gpt":
        return gpt(GPT["layers"], GPT["width"], GPT["heads"], GPT["vocab"], GPT["context"])
    if name == "word-lstm":
        from hvd_sparse.sim.words_tf import keras_word_lstm

        return keras_word_lstm(seed)
    if name == "word-gpt":
        from hvd_sparse.sim.gpt_tf import keras_gpt

        return keras_gpt(seed)
    raise ValueError(f"unknown model {name!r}")
