"""The end-to-end benchmarks' model zoo (scripts/models/e2e_models.py): the standard parameter counts in
both frameworks, forward shapes on tiny inputs, seed-0 determinism, the earlier benchmark models
unchanged, and the throughput column bench_e2e prints. Small inputs only (ResNet-50 at 224x224 is
slow on a CPU)."""

from __future__ import annotations

import bench_e2e
import numpy as np
import pytest
from models import e2e_models

# torchvision's resnet18/resnet50 (1000 classes); the GPT: 6 x 512, vocabulary 16384, context 128;
# the word-level LSTM and the small GPT of the time-to-accuracy studies (hvd_sparse/sim/tasks.py,
# hvd_sparse/sim/gpt.py).
COUNTS = {"mlp25m": 25_189_386, "mlp7m": 7_357_450, "cnn": 538_570, "resnet18": 11_689_512,
          "resnet50": 25_557_032, "gpt": 27_369_472, "word-lstm": 6_178_576, "word-gpt": 929_280}


def test_every_model_has_its_count():
    assert set(COUNTS) == set(e2e_models.MODELS)


def test_torch_parameter_counts():
    pytest.importorskip("torch")
    for name, count in COUNTS.items():
        assert e2e_models.count_parameters(e2e_models.build(name, "torch").model) == count, name


TINY = [("resnet18", 32, (2, 1000)), ("resnet50", 32, (2, 1000)), ("cnn", None, (2, 10)),
        ("gpt", None, (2, 8, 16384)), ("word-lstm", None, (2, 8, 10000)),
        ("word-gpt", None, (2, 8, 4096))]


def forward(spec, framework: str) -> None:
    """One forward pass of a tiny batch (2 samples): the logits' shape, and a loss about
    ln(classes), as it is at the start."""
    x, y = spec.make_batch(2, spec.generator(0))
    outputs = spec.model(x, training=True) if framework == "tensorflow" else spec.model(x)
    out = dict((name, shape) for name, _, shape in TINY)[spec.name]
    assert tuple(outputs.shape) == out, spec.name
    loss = spec.loss(outputs, y)
    loss = float(loss.detach() if framework == "torch" else loss)
    assert 0.5 * np.log(out[-1]) < loss < 2 * np.log(out[-1]), spec.name


def test_torch_forward_on_tiny_inputs():
    pytest.importorskip("torch")
    for name, size, _ in TINY:
        forward(e2e_models.build(name, "torch", image_size=size, seq_len=8), "torch")


def test_tensorflow_parameter_counts_equal_torch_and_forward():
    """Every model once (TensorFlow builds are slow): the count (the image side changes no
    parameter) and, but for the MLPs, a forward pass."""
    pytest.importorskip("tensorflow")
    for name, count in COUNTS.items():
        spec = e2e_models.build(name, "tensorflow", image_size=32, seq_len=8)
        assert e2e_models.count_parameters(spec.model) == count, name
        if not name.startswith("mlp"):
            forward(spec, "tensorflow")


def test_specs_describe_inputs_and_throughput():
    gpt = e2e_models.describe("gpt")
    assert (gpt.input_shape, gpt.unit, gpt.items(4)) == ((128,), "tokens/s", 512)
    assert e2e_models.describe("resnet50", image_size=64).input_shape == (3, 64, 64)
    assert e2e_models.describe("resnet50", "tensorflow").input_shape == (224, 224, 3)
    assert e2e_models.describe("resnet18").unit == "img/s"
    assert e2e_models.describe("mlp25m").items(8) == 8
    with pytest.raises(ValueError, match="context"):
        e2e_models.describe("gpt", seq_len=129)
    with pytest.raises(ValueError, match="unknown model"):
        e2e_models.describe("vgg16")


def test_torch_batches():
    torch = pytest.importorskip("torch")
    spec = e2e_models.build("gpt", "torch", seq_len=16, with_model=False)
    assert spec.model is None
    x, y = spec.make_batch(3, spec.generator(5))
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64 and int(x.max()) < 16384
    again, _ = spec.make_batch(3, spec.generator(5))
    assert torch.equal(x, again)
    images, labels = e2e_models.describe("resnet18", image_size=40).make_batch(2, torch.Generator())
    assert images.shape == (2, 3, 40, 40) and labels.shape == (2,) and int(labels.max()) < 1000


def test_torch_builds_are_seeded():
    torch = pytest.importorskip("torch")
    first, second = (e2e_models.build("resnet18", "torch").model.state_dict() for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = e2e_models.build("resnet18", "torch", seed=1).model.state_dict()
    assert not torch.equal(first["0.weight"], other["0.weight"])
    gpt = e2e_models.build("gpt", "torch").model
    assert gpt.head.weight is gpt.tokens.weight   # tied: one parameter, counted once


def earlier_models(torch):
    """mlp7m and cnn as scripts/workers/bench_e2e_worker.py built them before the zoo (seed 0)."""
    nn = torch.nn
    torch.manual_seed(0)
    layers = [nn.Linear(1024, 1024), nn.ReLU()]
    for _ in range(5):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    mlp = nn.Sequential(*layers, nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    torch.manual_seed(0)

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    cnn = nn.Sequential(*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                        *block(128, 128), nn.MaxPool2d(2), *block(128, 256), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(256, 10))
    return {"mlp7m": mlp, "cnn": cnn}


def test_the_earlier_models_keep_their_weights_and_batches():
    torch = pytest.importorskip("torch")
    for name, before in earlier_models(torch).items():
        spec = e2e_models.build(name, "torch")
        old, new = before.state_dict(), spec.model.state_dict()
        assert list(old) == list(new) and all(torch.equal(old[k], new[k]) for k in old), name
        generator = torch.Generator().manual_seed(1000)
        shape = (1024,) if name == "mlp7m" else (3, 32, 32)
        x, y = torch.randn(8, *shape, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        x2, y2 = spec.make_batch(8, spec.generator(1000))
        assert torch.equal(x, x2) and torch.equal(y, y2), name


def test_tensorflow_builds_are_seeded():
    pytest.importorskip("tensorflow")
    first, second = (e2e_models.build("cnn", "tensorflow").model for _ in range(2))
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(first.weights, second.weights,
                                                                     strict=True))
    spec = e2e_models.build("resnet18", "tensorflow", image_size=32, with_model=False)
    x, y = spec.make_batch(2, spec.generator(0))
    assert tuple(x.shape) == (2, 32, 32, 3) and tuple(y.shape) == (2,)


def test_bench_e2e_reports_throughput_per_rank():
    job = {"records": [{"config": "dense", "repeat": r, "step_seconds": 2.0, "density_actual": 1.0}
                       for r in range(2)],
           "size": 2, "batch_per_rank": 4, "items_per_sample": 128, "unit": "tokens/s"}
    row = bench_e2e.summarize_job(job)["dense"]
    assert row["throughput_per_rank"]["median"] == pytest.approx(4 * 128 / 2.0)
    assert row["samples_per_second"]["median"] == pytest.approx(2 * 4 / 2.0)
    assert bench_e2e.input_text({"input_shape": [3, 64, 64]}) == ", input 3×64×64"
