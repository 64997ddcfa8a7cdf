"""The end-to-end benchmarks' model zoo, in PyTorch and TensorFlow (tf-keras), with synthetic data.

    python scripts/models/e2e_models.py                 # every model's parameter count, both frameworks
    python scripts/models/e2e_models.py --framework torch --models resnet18 gpt

``build(name, framework)`` gives a ``ModelSpec``: the model built from seed 0 (identical weights on
every rank, no broadcast), the synthetic batch maker, the loss and the throughput unit -- what a
benchmark needs to train the model one step, as Horovod's synthetic benchmarks do. The frameworks are
imported only when a model of theirs is built (e2e_models_torch.py, e2e_models_tf.py), so either one
alone is enough. Written in the project: the PyPI torchvision wheel expects a CUDA torch and fails
to load its C++ ops against the CPU torch of the tested stack.

Models (parameter counts are equal in both frameworks: torch ``parameters()`` and Keras
``trainable_weights``; BatchNorm's running statistics are buffers / non-trainable in both):

- ``mlp25m``: 1024 -> 2048 (x6 hidden) -> 1024 -> 10, 25.2M parameters in 8 weight tensors, little
  arithmetic per parameter (communication-bound at a small batch on a slow network). ``mlp7m``: the
  same shape at 1024 wide (7.4M). ``cnn``: 5 convolutions on 3x32x32 images, a small head, 0.54M
  parameters, much arithmetic per parameter (compute-bound). Unchanged from the builders that were
  in scripts/workers/bench_e2e_worker.py (same architecture, same seed-0 weights in torch), so earlier
  results stay comparable.
- ``resnet18`` (11.69M) and ``resnet50`` (25.56M): the standard ImageNet ResNets (He et al. 2016;
  torchvision's layout: BasicBlock [2,2,2,2] / Bottleneck [3,4,6,3] with the stride on the 3x3
  convolution ("v1.5"), bias-free convolutions, BatchNorm, 1000 classes), the papers' CNNs. Inputs
  3x224x224 by default; ``image_size`` (e.g. 64 or 112) makes a step cheaper on a slow CPU host
  without changing a parameter (global average pooling before the classifier), so the exchanged
  gradients are the same and only the computation shrinks (~ image_size^2). TensorFlow takes
  images channels-last (NHWC: TensorFlow's CPU convolutions need it).
- ``gpt``: a GPT-2-style decoder (pre-LayerNorm blocks of causal self-attention and a 4x GELU MLP,
  learned positional embedding, final LayerNorm, LM head tied to the token embedding), 6 layers x
  512 wide, 8 heads, vocabulary 16384, context 128: 27.4M parameters. Sized like mlp25m and
  resnet50 (about 25M: the same gradient volume per step) while being a standard architecture; 6 x
  512 is the small end of the GPT family (GPT-2 small is 12 x 768, 124M, too slow to step on two
  shared cores), and a 16k vocabulary is what a BPE tokenizer trained on a small corpus gives.
  About 70% of its parameters are in the blocks and 30% in the tied embedding, whose gradient is
  dense (the LM head touches every row). Throughput in tokens/s (128 per sample).
- ``word-lstm``: the word-level language model of the time-to-accuracy task (hvd_sparse/sim/tasks.py:
  embedding 256, two bias-free LSTM layers of 256, an untied decoder over a 10,000-word
  vocabulary; 6.18M parameters, 83% in the embedding and the decoder), 32 tokens per sample, so
  the step times time_to_accuracy.py composes are those of the model it trains.
- ``word-gpt``: the simulator's transformer task (hvd_sparse/sim/gpt.py: 2 GPT-2 blocks, 128 wide,
  4 heads, a 4096-word vocabulary, context 64; 0.93M parameters, 56% in the tied embedding),
  32 tokens per sample: the model of time_to_accuracy.py's ``--task gpt``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

FRAMEWORKS = ("torch", "tensorflow")

# name -> (input kind, classes or vocabulary, throughput unit, default per-sample shape argument)
CATALOG: dict[str, dict] = {
    "mlp25m": {"kind": "vector", "classes": 10, "unit": "samples/s", "features": 1024},
    "mlp7m": {"kind": "vector", "classes": 10, "unit": "samples/s", "features": 1024},
    "cnn": {"kind": "image", "classes": 10, "unit": "img/s", "image_size": 32},
    "resnet18": {"kind": "image", "classes": 1000, "unit": "img/s", "image_size": 224},
    "resnet50": {"kind": "image", "classes": 1000, "unit": "img/s", "image_size": 224},
    "gpt": {"kind": "tokens", "classes": 16384, "unit": "tokens/s", "seq_len": 128, "context": 128},
    "word-lstm": {"kind": "tokens", "classes": 10000, "unit": "tokens/s", "seq_len": 32,
                  "context": None},
    "word-gpt": {"kind": "tokens", "classes": 4096, "unit": "tokens/s", "seq_len": 32, "context": 64},
}
MODELS = tuple(CATALOG)
# The transformer's shape (``gpt``: layers, width, heads, vocabulary, context) is e2e_sizes.GPT,
# which the framework modules import (they cannot import this module, which imports them).


@dataclass
class ModelSpec:
    """A model ready to benchmark: ``model`` (a ``torch.nn.Module`` or a ``tf.keras.Model``, or
    None when built with ``with_model=False``), what one sample is (``input_shape``, in the
    framework's layout, and ``classes``: the number of labels, or the vocabulary), and the
    throughput unit: ``items_per_sample`` items (1 image, 1 sample, or ``seq_len`` tokens) per
    sample, counted in ``unit``."""

    name: str
    framework: str
    kind: str
    input_shape: tuple[int, ...]
    classes: int
    unit: str
    items_per_sample: int
    model: Any = field(default=None, repr=False)

    def generator(self, seed: int) -> Any:
        """A seeded random source for ``make_batch``: a ``torch.Generator`` or a numpy one."""
        if self.framework == "torch":
            import torch

            return torch.Generator().manual_seed(seed)
        import numpy as np

        return np.random.default_rng(seed)

    def make_batch(self, batch: int, generator: Any) -> tuple[Any, Any]:
        """(inputs, targets) of ``batch`` synthetic samples: standard-normal vectors or images and
        uniform labels; for ``gpt`` uniform token ids and next-token targets, both (batch, seq_len).
        In torch the draws are those of the earlier benchmark (inputs, then labels, from one
        generator), so mlp25m/mlp7m/cnn see the same data as before."""
        if self.framework == "torch":
            import torch

            if self.kind == "tokens":
                x = torch.randint(0, self.classes, (batch, *self.input_shape), generator=generator)
                return x, torch.randint(0, self.classes, (batch, *self.input_shape), generator=generator)
            x = torch.randn(batch, *self.input_shape, generator=generator)
            return x, torch.randint(0, self.classes, (batch,), generator=generator)
        import tensorflow as tf

        if self.kind == "tokens":
            x = generator.integers(0, self.classes, (batch, *self.input_shape), dtype="int32")
            y = generator.integers(0, self.classes, (batch, *self.input_shape), dtype="int32")
            return tf.constant(x), tf.constant(y)
        x = generator.standard_normal((batch, *self.input_shape), dtype="float32")
        return tf.constant(x), tf.constant(generator.integers(0, self.classes, (batch,), dtype="int32"))

    def loss(self, outputs: Any, targets: Any) -> Any:
        """Mean cross-entropy of the logits (per token for ``gpt``)."""
        if self.framework == "torch":
            import torch

            return torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]),
                                                     targets.reshape(-1))
        import tensorflow as tf

        return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            targets, outputs, from_logits=True))

    def items(self, batch: int) -> int:
        """Items (images, samples or tokens) in a batch of ``batch`` samples."""
        return batch * self.items_per_sample


def describe(name: str, framework: str = "torch", *, image_size: int | None = None,
             seq_len: int | None = None) -> ModelSpec:
    """The spec of a model without building it (cheap): shapes, loss, unit. ``image_size`` changes
    the ResNets' (and cnn's) input side, ``seq_len`` the transformer's sequence (at most its
    context, 128); neither changes a parameter."""
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    entry = CATALOG[name]
    kind, items = entry["kind"], 1
    if kind == "vector":
        shape: tuple[int, ...] = (entry["features"],)
    elif kind == "image":
        side = image_size or entry["image_size"]
        shape = (3, side, side) if framework == "torch" else (side, side, 3)
    else:
        items = seq_len or entry["seq_len"]
        if items <= 0 or (entry["context"] and items > entry["context"]):
            raise ValueError(f"seq_len {items}: {name}'s context is {entry['context']}")
        shape = (items,)
    return ModelSpec(name, framework, kind, shape, entry["classes"], entry["unit"], items)


def build(name: str, framework: str = "torch", *, image_size: int | None = None,
          seq_len: int | None = None, seed: int = 0, with_model: bool = True) -> ModelSpec:
    """The spec of ``name`` in ``framework`` ("torch" or "tensorflow") with its model built from
    ``seed`` (the same weights on every rank); ``with_model=False``: the spec alone."""
    spec = describe(name, framework, image_size=image_size, seq_len=seq_len)
    if with_model:
        if framework == "torch":
            from . import e2e_models_torch as zoo
        else:
            from . import e2e_models_tf as zoo
        spec.model = zoo.build_model(name, spec.input_shape, seed)
    return spec


def count_parameters(model: Any) -> int:
    """Trainable parameters of a torch module (``parameters()``, a tied weight once) or a Keras
    model (``trainable_weights``)."""
    if hasattr(model, "trainable_weights"):
        return int(sum(w.shape.num_elements() for w in model.trainable_weights))
    return int(sum(p.numel() for p in model.parameters()))


def main() -> None:
    """Print each model's parameter count in each framework asked for."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--framework", choices=(*FRAMEWORKS, "both"), default="both")
    args = parser.parse_args()
    frameworks = FRAMEWORKS if args.framework == "both" else (args.framework,)
    if "tensorflow" in frameworks:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    print("| model | " + " | ".join(frameworks) + " | input per sample | unit |")
    print("|---|" + "---|" * len(frameworks) + "---|---|")
    for name in args.models:
        counts = [f"{count_parameters(build(name, fw).model) / 1e6:.3f}M" for fw in frameworks]
        spec = describe(name)
        print(f"| {name} | " + " | ".join(counts) + f" | {spec.input_shape} | {spec.unit} |")


if __name__ == "__main__":
    main()
