"""Framework-free helper that turns an algorithm class into a framework face class.

``hvd_sparse.torch.TopK(density=0.01, named_parameters=...)`` is the PyTorch face's compressor
base class wrapped around ``hvd_sparse.algorithms.TopK``; the TensorFlow face does the same with
its own base. The generated class accepts the algorithm's hyper-parameters and the face's
keyword-only options together, and shows both in ``help()``.
"""

from __future__ import annotations

import inspect


def face_class(base: type, algorithm_cls: type, module: str) -> type:
    """A subclass of ``base`` (whose ``__init__(algorithm, *, ...)`` takes face options)."""
    face_params = [p for p in inspect.signature(base.__init__).parameters.values()
                   if p.kind is p.KEYWORD_ONLY]
    face_names = {p.name for p in face_params}

    def __init__(self, *args, **kwargs):
        face_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in face_names}
        base.__init__(self, algorithm_cls(*args, **kwargs), **face_kwargs)

    algo_params = list(inspect.signature(algorithm_cls.__init__).parameters.values())
    __init__.__signature__ = inspect.Signature(algo_params + face_params)  # type: ignore[attr-defined]
    return type(algorithm_cls.__name__, (base,), {
        "__init__": __init__,
        "__doc__": f"{algorithm_cls.__doc__}\n    Options of the {module} face: see {base.__name__}.",
        "__module__": module,
    })
