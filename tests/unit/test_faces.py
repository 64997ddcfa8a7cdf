"""The face classes (hvd_sparse/faces.py): one per registered method in each framework, each showing
the method's arguments and the face's options in its signature and in ``help()``; the options'
defaults and checks, the API before the first step, and the refusal of reductions other than
Average."""

from __future__ import annotations

import inspect
import pydoc
import re
from types import SimpleNamespace

import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError, registry
from hvd_sparse.faces import refuse_reduction_op

FACES = {"torch": ("named_parameters", "process_set", "prefix", "nonfinite"),
         "tensorflow": ("process_set", "prefix", "nonfinite")}


@pytest.fixture(scope="module", params=sorted(FACES))
def face(request):
    module = pytest.importorskip(f"hvd_sparse.{request.param}")
    return request.param, module


def test_every_registered_method_has_a_face_class_and_nothing_else(face):
    _, module = face
    names = {cls.__name__ for cls in registry.METHODS.values()}
    assert set(module.FACES) == names
    assert set(module.__all__) >= names | {"SparseCompressor"}
    for name in names:
        face_cls = getattr(module, name)
        assert face_cls is module.FACES[name]
        assert issubclass(face_cls, module.SparseCompressor)
        assert face_cls.__module__ == module.__name__


def test_signature_is_the_methods_arguments_then_the_face_options(face):
    framework, module = face
    for algorithm_cls in registry.METHODS.values():
        face_cls = getattr(module, algorithm_cls.__name__)
        algorithm_params = list(inspect.signature(algorithm_cls).parameters.values())
        face_params = list(inspect.signature(face_cls).parameters.values())
        assert face_params[:len(algorithm_params)] == algorithm_params, algorithm_cls.__name__
        options = face_params[len(algorithm_params):]
        assert [p.name for p in options] == list(FACES[framework])
        assert all(p.kind is p.KEYWORD_ONLY for p in options)


def documented_names(help_text: str) -> set[str]:
    """Names documented as "name: ..." or "name, other: ..." entries in the class docstring part
    of a rendered ``help()`` (before the method listing)."""
    names = set()
    class_doc = help_text.partition("Method resolution order")[0]
    for entry in re.findall(r"^ \|\s{4,}([\w, ]+):", class_doc, flags=re.MULTILINE):
        names.update(part.strip() for part in entry.split(","))
    return names


def test_help_shows_every_argument_with_its_description(face):
    framework, module = face
    for algorithm_cls in registry.METHODS.values():
        face_cls = getattr(module, algorithm_cls.__name__)
        text = pydoc.render_doc(face_cls, renderer=pydoc.plaintext)
        params = [p for p in inspect.signature(face_cls).parameters if p != "self"]
        missing = set(params) - documented_names(text)
        assert not missing, f"{framework} {algorithm_cls.__name__}: undocumented {sorted(missing)}"
        assert f"Options of the hvd_sparse.{framework} face" in text


def test_create_builds_the_face_class(face):
    framework, module = face
    compressor = hvd_sparse.create("exdyna", framework=framework, density=0.01,
                                   threshold_scaling="tracking", prefix="t")
    assert type(compressor) is module.ExDyna
    assert compressor.algorithm.threshold_scaling == "tracking" and compressor.prefix == "t"


def test_face_options_have_defaults_and_are_checked(face):
    _, module = face
    compressor = module.TopK(0.05)
    assert compressor.algorithm.density == 0.05     # positional arguments go to the method
    assert (compressor.prefix, compressor.nonfinite, compressor.process_set) == ("hvd_sparse", "skip", None)
    with pytest.raises(ConfigurationError, match="nonfinite must be one of"):
        module.TopK(0.05, nonfinite="drop")
    with pytest.raises(TypeError, match="unexpected keyword"):
        module.TopK(0.05, named_parameter=[])


def test_stats_and_repr_before_the_first_step(face):
    framework, module = face
    compressor = module.MiCRO(0.02)
    stats = compressor.stats()
    assert stats["step"] == 0 and stats["density_target"] == 0.02 and stats["buckets"] == 0
    assert repr(compressor) == f"hvd_sparse.{framework}.{compressor.algorithm!r}"


def test_only_the_average_reduction_is_accepted():
    hvd = SimpleNamespace(**{op: object() for op in ("Average", "Sum", "Min", "Max", "Product", "Adasum")})
    refuse_reduction_op(None, hvd)
    refuse_reduction_op(hvd.Average, hvd)
    with pytest.raises(ConfigurationError, match=r"op=hvd\.Adasum cannot be combined .* Use op=hvd\.Average"):
        refuse_reduction_op(hvd.Adasum, hvd)
    for op in ("Sum", "Min", "Max", "Product"):
        message = rf"op=hvd\.{op} cannot be combined .* pass op=hvd\.Average"
        with pytest.raises(ConfigurationError, match=message):
            refuse_reduction_op(getattr(hvd, op), hvd)
