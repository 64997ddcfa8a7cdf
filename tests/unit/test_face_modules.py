"""The face classes are written out (tools/generate_faces.py), not made at import time: the
committed modules are what the generator writes from today's methods and face options, every
registered method has its class in every face, and no module makes public names at run time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvd_sparse import registry

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("torch")
pytest.importorskip("horovod.torch")
pytest.importorskip("tensorflow")

from tools import generate_faces  # noqa: E402


def test_every_registered_method_is_in_one_group():
    grouped = [name for names in generate_faces.GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(cls.__name__ for cls in registry.METHODS.values())
    assert len(grouped) == len(set(grouped))


@pytest.mark.parametrize("target", generate_faces.TARGETS, ids=lambda t: t.path)
def test_the_committed_face_module_is_what_the_generator_writes(target):
    written = (REPO / target.path).read_text()
    assert written == generate_faces.module_source(target), (
        f"{target.path} is out of date: run python tools/generate_faces.py")
    assert len(written.splitlines()) <= 250


def test_no_module_makes_public_names_at_run_time():
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "hvd_sparse").rglob("*.py")
                 if re.search(r"globals\(\)\.update|\btype\(\s*\w+\.__name__\s*,", path.read_text())]
    assert not offenders
