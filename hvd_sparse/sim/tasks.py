"""Small real training tasks for the N-rank simulator: data that ships with installed packages.

* ``digits``: a small CNN on scikit-learn's ``load_digits`` (8x8 images, 10 classes).
* ``digits-mlp``: a three-layer MLP on the same data, whose gradient mass is concentrated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


class DigitsCNN(torch.nn.Module):
    """38k parameters: two 3x3 convolutions, one pooling, two dense layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@dataclass
class Task:
    """A model, its loss on a batch, per-rank batches and an evaluation metric."""

    name: str
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    batch: Callable[[int, int], tuple]          # (rank, step) -> batch
    evaluate: Callable[[torch.nn.Module], dict]


class DigitsMLP(torch.nn.Module):
    """A wide first layer (sparse, small gradients per entry) before a narrow classifier: the
    gradient mass is far from uniform along the flat vector, as in real models."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def digits_task(batch_size: int = 16, seed: int = 0, model: str = "cnn") -> Task:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    model = DigitsCNN() if model == "cnn" else DigitsMLP()

    def batch(rank: int, step: int) -> tuple:
        rng = np.random.default_rng([seed, rank, step])
        pick = torch.from_numpy(rng.choice(len(x_train), batch_size, replace=False))
        return x_train[pick], y_train[pick]

    def loss(module: torch.nn.Module, data: tuple) -> torch.Tensor:
        return F.cross_entropy(module(data[0]), data[1])

    def evaluate(module: torch.nn.Module) -> dict:
        with torch.no_grad():
            accuracy = (module(x_test).argmax(1) == y_test).float().mean().item()
        return {"accuracy": accuracy}

    return Task(f"digits-{'cnn' if isinstance(model, DigitsCNN) else 'mlp'}", model, loss, batch, evaluate)


def digits_mlp_task(batch_size: int = 16, seed: int = 0) -> Task:
    return digits_task(batch_size, seed, model="mlp")


TASKS = {"digits": digits_task, "digits-mlp": digits_mlp_task}
