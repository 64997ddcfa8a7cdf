"""Renamed options, functions and modules (README, "Renamed options"): the new names work
silently, the old ones still work and warn with RenamedWarning, both at once is an error."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError
from hvd_sparse.algorithms import ExDyna, MiCRO, Threshold
from hvd_sparse.renamed import RenamedWarning

REPO = Path(__file__).resolve().parents[2]

OLD_TO_NEW = [
    (MiCRO, {"threshold": "tracking"}, {"threshold_scaling": "tracking"}),
    (MiCRO, {"band": "symmetric"}, {"threshold_band": "symmetric"}),
    (ExDyna, {"threshold": "tracking", "band": "symmetric"},
     {"threshold_scaling": "tracking", "threshold_band": "symmetric"}),
    (ExDyna, {"over_band": "1.2", "under_band": 0.8},
     {"overload_ratio": "1.2", "underload_ratio": 0.8}),
]


def test_renamed_warning_is_shown_by_default():
    assert issubclass(RenamedWarning, FutureWarning)
    assert not issubclass(RenamedWarning, DeprecationWarning)


@pytest.mark.parametrize(("cls", "old", "new"), OLD_TO_NEW)
def test_old_option_names_warn_and_mean_the_new_ones(cls, old, new):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = cls(0.01, **new)
    with pytest.warns(RenamedWarning) as caught:
        built = cls(0.01, **old)
    assert built.describe() == expected.describe()
    messages = " ".join(str(w.message) for w in caught)
    for old_name, new_name in zip(old, new, strict=True):
        assert f"({old_name}=...) was renamed to {new_name}=" in messages
    assert caught[0].filename == __file__   # points at the caller's line


@pytest.mark.parametrize("framework", [None, "torch", "tensorflow"])
def test_old_names_work_through_create_and_the_faces(framework):
    if framework is not None:
        pytest.importorskip(f"hvd_sparse.{framework}")
    with pytest.warns(RenamedWarning) as caught:
        built = hvd_sparse.create("exdyna", framework=framework, density=0.01, threshold="tracking",
                                  over_band="1.1")
    messages = " ".join(str(w.message) for w in caught)
    assert "renamed to threshold_scaling=" in messages and "renamed to overload_ratio=" in messages
    algorithm = built if framework is None else built.algorithm
    assert algorithm.threshold_scaling == "tracking" and algorithm.overload_ratio == "1.1"


def test_both_spellings_at_once_is_refused():
    with pytest.raises(ConfigurationError, match="pass threshold_scaling= only"):
        MiCRO(0.01, threshold="paper", threshold_scaling="tracking")


def test_new_names_do_not_warn_and_threshold_keeps_its_value():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ExDyna(0.01, threshold_scaling="tracking", threshold_band="symmetric", overload_ratio="1.1",
               underload_ratio="0.9")
        assert Threshold(0.01, threshold=0.5).threshold == 0.5   # λ itself: not renamed
    with pytest.raises(ConfigurationError, match="threshold_scaling must be one of"):
        ExDyna(0.01, threshold_scaling=0.5)


def test_sim_summarize_is_the_old_name_of_summarize_run():
    from hvd_sparse import sim

    records = [{"density_actual": 0.01, "density_target": 0.01, "buildup": 1.0, "imbalance": 0.1,
                "loss": 2.0, "seconds": 0.5}] * 3
    with pytest.warns(RenamedWarning, match="sim.summarize_run"):
        old = sim.summarize(records, skip=1)
    assert old == sim.summarize_run(records, skip=1)


def test_the_old_lags_module_path_warns_and_holds_the_same_objects():
    code = ("import warnings\n"
            "warnings.simplefilter('error')\n"
            "import hvd_sparse.algorithms.lags as new\n"
            "try:\n"
            "    import hvd_sparse.lags\n"
            "except FutureWarning as w:\n"
            "    print(type(w).__name__, w)\n"
            "warnings.simplefilter('ignore')\n"
            "import hvd_sparse.lags as old\n"
            "print(all(getattr(old, n) is getattr(new, n) for n in old.__all__))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RenamedWarning hvd_sparse: hvd_sparse.lags was renamed to hvd_sparse.algorithms.lags" \
        in result.stdout
    assert result.stdout.strip().endswith("True")
