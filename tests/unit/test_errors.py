"""Errors that name their fix (hvd_sparse/errors.py): options renamed before the first release
are refused under their old names with an error naming the new one; the old module paths and
functions are gone."""

from __future__ import annotations

import importlib
import warnings

import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import ExDyna, MiCRO, Threshold

OLD_TO_NEW = [
    (MiCRO, {"threshold": "tracking"}, "threshold= is now threshold_scaling="),
    (MiCRO, {"band": "symmetric"}, "band= is now threshold_band="),
    (ExDyna, {"threshold": "tracking", "band": "symmetric"},
     "threshold= is now threshold_scaling=, band= is now threshold_band="),
    (ExDyna, {"over_band": "1.2", "under_band": 0.8},
     "over_band= is now overload_ratio=, under_band= is now underload_ratio="),
]


@pytest.mark.parametrize(("cls", "old", "message"), OLD_TO_NEW)
def test_old_option_names_are_refused_naming_the_new_ones(cls, old, message):
    with pytest.raises(ConfigurationError) as caught:
        cls(0.01, **old)
    assert str(caught.value) == f"{cls.__name__}: {message}"


@pytest.mark.parametrize("framework", [None, "torch", "tensorflow"])
def test_old_names_are_refused_through_create_and_the_faces(framework):
    if framework is not None:
        pytest.importorskip(f"hvd_sparse.{framework}")
    with pytest.raises(ConfigurationError, match="threshold= is now threshold_scaling="):
        hvd_sparse.create("exdyna", framework=framework, density=0.01, threshold="tracking")


def test_new_names_work_silently_and_threshold_keeps_its_value():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exdyna = ExDyna(0.01, threshold_scaling="tracking", threshold_band="symmetric",
                        overload_ratio="1.1", underload_ratio="0.9")
        assert Threshold(0.01, threshold=0.5).threshold == 0.5   # λ itself: not renamed
    assert (exdyna.threshold_scaling, exdyna.overload_ratio) == ("tracking", "1.1")
    with pytest.raises(ConfigurationError, match="threshold_scaling must be one of"):
        ExDyna(0.01, threshold_scaling=0.5)


@pytest.mark.parametrize(("module", "name"), [("hvd_sparse.sim", "summarize"), ("hvd_sparse", "renamed")])
def test_old_functions_and_modules_are_gone(module, name):
    assert not hasattr(importlib.import_module(module), name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("hvd_sparse.lags")
