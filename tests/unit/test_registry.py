"""The registry (hvd_sparse/registry.py): every method of hvd_sparse.algorithms once, under its
own name; ``create`` building the algorithm or a framework's face class from it; and refusals of
unknown names that list the choices."""

from __future__ import annotations

import re

import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError, algorithms, registry
from hvd_sparse.algorithms import DGC, Algorithm, GaussianK, RandomK, Threshold

FACE_MODULES = {"torch": "hvd_sparse.torch", "pytorch": "hvd_sparse.torch",
                "tensorflow": "hvd_sparse.tensorflow", "tf": "hvd_sparse.tensorflow"}


def test_every_method_is_listed_once_under_its_own_name():
    names = [cls.name for cls in algorithms.METHODS]
    assert len(set(names)) == len(names) == len(set(algorithms.METHODS))
    assert all(name == name.lower() for name in names)
    assert {cls.name: cls for cls in algorithms.METHODS} == registry.METHODS
    assert registry.available() == sorted(names)
    exported = {cls for cls in vars(algorithms).values()
                if isinstance(cls, type) and issubclass(cls, Algorithm) and cls is not Algorithm}
    assert exported == set(algorithms.METHODS)   # no method left out of the list
    assert hvd_sparse.available is registry.available and hvd_sparse.create is registry.create


def test_create_without_a_framework_builds_the_algorithm():
    for cls in algorithms.METHODS:
        algorithm = registry.create(cls.name.upper(), density=0.05)   # names are case-insensitive
        assert type(algorithm) is cls and algorithm.density == 0.05
    assert registry.create("topk", density=0.1, scope="model").scope == "model"


@pytest.mark.parametrize("framework", sorted(FACE_MODULES))
def test_create_with_a_framework_builds_that_faces_class(framework):
    module = pytest.importorskip(FACE_MODULES[framework])
    for cls in algorithms.METHODS:
        compressor = registry.create(cls.name, framework=framework.upper(), density=0.05, prefix="r")
        assert type(compressor) is module.FACES[cls.__name__]
        assert type(compressor.algorithm) is cls and compressor.algorithm.density == 0.05
        assert compressor.prefix == "r"


def test_unknown_names_are_refused_listing_the_choices():
    choices = ", ".join(registry.available())
    with pytest.raises(ConfigurationError, match=re.escape(f"unknown method 'top-k'; available: {choices}")):
        registry.create("top-k")
    with pytest.raises(ConfigurationError,
                       match="unknown framework 'jax': use 'torch', 'tensorflow' or 'ddp'"):
        registry.create("topk", framework="jax")


def test_registry_knows_every_baseline():
    assert {"topk", "randomk", "threshold", "gaussiank", "dgc"} <= set(hvd_sparse.available())
    for name, cls in [("randomk", RandomK), ("threshold", Threshold), ("gaussiank", GaussianK),
                      ("dgc", DGC)]:
        algorithm = hvd_sparse.create(name, density=0.02)
        assert type(algorithm) is cls and algorithm.density == 0.02
