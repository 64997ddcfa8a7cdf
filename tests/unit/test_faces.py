"""The face classes (hvd_sparse/faces.py): one per registered method in each framework, each showing
the method's arguments and the face's options in its signature and in ``help()``; the options'
defaults and checks, the API before the first step, the refusal of reductions other than Average,
and the warning about a second momentum in the optimizer a face can see."""

from __future__ import annotations

import inspect
import pydoc
import re
import warnings
from types import SimpleNamespace

import pytest

import hvd_sparse
from hvd_sparse import ConfigurationError, registry
from hvd_sparse.faces import refuse_reduction_op

FACES = {"torch": ("named_parameters", "process_set", "prefix", "nonfinite", "optimizer"),
         "tensorflow": ("process_set", "prefix", "nonfinite", "optimizer")}


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


# --- a second momentum in the optimizer ----------------------------------------------------------------
def test_a_second_momentum_is_warned_about_once(face):
    """``_check_optimizer``, which a face calls with what it sees of the optimizer's momentum:
    one RuntimeWarning naming both fixes, only with the compressor's momentum on, only once."""
    _, module = face
    compressor = module.TopK(0.1, momentum=0.9)
    with pytest.warns(RuntimeWarning, match=r"momentum correction \(momentum=0\.9\).*SGD\(momentum=0\.9\).*"
                      r"momentum twice.*optimizer without momentum \(momentum=0.*drop the compressor's "
                      r"momentum"):
        compressor._check_optimizer("SGD(momentum=0.9)")
    for quiet in (module.TopK(0.1, momentum=0.9), module.TopK(0.1), module.DGC(0.1, momentum=0)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compressor._check_optimizer("SGD(momentum=0.9)")   # the same compressor: once
            quiet._check_optimizer(None if quiet.algorithm.corrections.momentum else "SGD(momentum=0.9)")
    with pytest.warns(RuntimeWarning, match=r"DGC applies the momentum correction"):
        module.DGC(0.1)._check_optimizer("Adam(betas=(0.9, 0.999))")   # DGC's momentum is on by default


def test_what_counts_as_a_torch_optimizers_momentum():
    torch = pytest.importorskip("torch")
    from hvd_sparse.torch.compressor import optimizer_momentum

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_momentum(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == "SGD(momentum=0.9)"
    assert optimizer_momentum(torch.optim.RMSprop(params, momentum=0.5)) == "RMSprop(momentum=0.5)"
    assert optimizer_momentum(torch.optim.Adam(params)) == "Adam(betas=(0.9, 0.999))"
    assert optimizer_momentum(torch.optim.AdamW(params, betas=(0.8, 0.99))) == "AdamW(betas=(0.8, 0.99))"
    for none in (torch.optim.SGD(params, lr=0.1), torch.optim.Adam(params, betas=(0.0, 0.999)),
                 torch.optim.RMSprop(params), torch.optim.Adagrad(params), object()):
        assert optimizer_momentum(none) is None, none


def test_the_torch_face_finds_the_optimizer_that_calls_compress():
    """horovod_internals.calling_optimizer, from a class shaped like Horovod's optimizer (the real
    one, in real jobs: tests/multiproc/workers/torch_corrections.py)."""
    torch = pytest.importorskip("torch")
    hvd = pytest.importorskip("horovod.torch")
    from hvd_sparse.torch.horovod_internals import calling_optimizer

    class Probe:
        def compress(self, tensor):
            self.seen = calling_optimizer(self)

    class Optimizer(torch.optim.SGD):   # what hvd.DistributedOptimizer builds: the wrapped class + these
        def __init__(self, params, compression):
            super().__init__(params, lr=0.1, momentum=0.9)
            self._compression, self.op = compression, hvd.Average

        def _allreduce_grad_async(self, p):
            return self._compression.compress(p)

    probe = Probe()
    optimizer = Optimizer([torch.nn.Parameter(torch.zeros(2))], probe)
    optimizer._allreduce_grad_async(torch.zeros(2))
    assert probe.seen == (optimizer, hvd.Average)
    probe.compress(torch.zeros(2))
    assert probe.seen == (None, None)


def test_what_counts_as_a_keras_optimizers_momentum():
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("horovod.tensorflow")
    from hvd_sparse.tensorflow.keras import keras_is_legacy, optimizer_momentum

    optimizers = tf.keras.optimizers
    assert optimizer_momentum(optimizers.SGD(0.1, momentum=0.9)) == "SGD(momentum=0.9)"
    assert optimizer_momentum(optimizers.Adam()) == "Adam(beta_1=0.9)"
    assert optimizer_momentum(optimizers.RMSprop(momentum=0.5)) == "RMSprop(momentum=0.5)"
    for none in (optimizers.SGD(0.1), optimizers.Adam(beta_1=0.0), optimizers.Adagrad(), object()):
        assert optimizer_momentum(none) is None, none
    if keras_is_legacy():   # Keras 2's legacy optimizers keep their hyper-parameters as variables
        assert optimizer_momentum(optimizers.legacy.SGD(0.1, momentum=0.9)) == "SGD(momentum=0.9)"


def test_the_keras_wrapper_warns_about_a_second_momentum_when_built():
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("horovod.tensorflow")
    import hvd_sparse.tensorflow as hs
    from hvd_sparse.tensorflow import keras

    if not keras.keras_is_legacy():
        pytest.skip("Horovod's Keras optimizer needs tf-keras (TF_USE_LEGACY_KERAS=1)")
    with pytest.warns(RuntimeWarning, match=r"Adam\(beta_1=0\.9\).*momentum twice"):
        keras.DistributedOptimizer(tf.keras.optimizers.Adam(), hs.TopK(0.1, momentum=0.9))
    with pytest.warns(RuntimeWarning, match="without the Adam path.*optimizer="):   # Adam, plain
        keras.DistributedOptimizer(tf.keras.optimizers.Adam(), hs.TopK(0.1))
    from hvd_sparse.tensorflow.optimizers import AdamW
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), hs.TopK(0.1, momentum=0.9))
        ours = AdamW(1e-3)
        keras.DistributedOptimizer(ours, hs.ExDyna(0.1, optimizer=ours))
