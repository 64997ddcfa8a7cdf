"""Write the face modules: one explicit class per registered method and face, so that IDEs, type
checkers and ``help()`` see ``hvd_sparse.torch.ExDyna`` with its real signature and docstring.

    python tools/generate_faces.py            # rewrite the three modules
    python tools/generate_faces.py --check    # exit 1 when one is out of date (tests run it)

Each class takes its method's arguments (hvd_sparse/algorithms) and then its face's keyword-only
options, and documents both. A new method or a new option needs a rerun, which the test
tests/unit/test_face_modules.py demands.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


LINE = 110   # ruff's line length (pyproject.toml)
# Four modules per face, each under the 250 lines of a face module (every class carries its
# whole docstring): the exclusive-partition seed methods, the layer-wise ones, the magnitude
# baselines and the two simplest rules.
GROUPS = {"methods": ("ExDyna", "MiCRO"),
          "layerwise": ("DEFT", "LAGS"),
          "baselines": ("TopK", "GaussianK", "DGC"),
          "simple_baselines": ("RandomK", "Threshold")}
WHAT = {"methods": "exclusive-partition seed methods", "layerwise": "layer-wise seed methods",
        "baselines": "magnitude baselines", "simple_baselines": "random-k and hard-threshold baselines"}


@dataclass(frozen=True)
class Target:
    path: str          # the module written, relative to the repository
    public: str        # the module users import the classes from
    base_module: str   # where the face's base class lives
    base: str          # the face's base class
    group: str         # a key of GROUPS


FACES = (("hvd_sparse/torch/{}.py", "hvd_sparse.torch", "hvd_sparse.torch.compressor", "SparseCompressor"),
         ("hvd_sparse/tensorflow/{}.py", "hvd_sparse.tensorflow", "hvd_sparse.tensorflow.compressor",
          "SparseCompressor"),
         ("hvd_sparse/torch/ddp_{}.py", "hvd_sparse.torch.ddp", "hvd_sparse.torch.ddp_state",
          "SparseHookState"))
TARGETS = tuple(Target(path.format(group), public, module, base, group)
                for path, public, module, base in FACES for group in GROUPS)
# Names the signatures' annotations may use, and the import that brings each in.
IMPORTS = {"Any": "from typing import Any", "Iterable": "from collections.abc import Iterable",
           "timedelta": "from datetime import timedelta",
           "AdamPath": "from ..algorithms.corrections import AdamPath"}


def options_doc(base: type) -> str:
    """The "Args:" entries of the nearest docstring in ``base``'s MRO that has them, without
    ``algorithm`` (which the face class builds from the method's own arguments)."""
    doc = next(inspect.cleandoc(c.__doc__) for c in base.__mro__ if c.__doc__ and "Args:" in c.__doc__)
    entries, keep = [], False
    for line in doc.partition("Args:\n")[2].splitlines():
        if line.strip() and not line.startswith(" "):          # the section is over
            break
        if line.strip() and not line.startswith("    " * 2):   # an entry starts: "    name: ..."
            keep = not line.lstrip().startswith("algorithm:")
        if keep:
            entries.append(line)
    return "\n".join(entries).rstrip()


def annotation(value: object) -> str:
    """An annotation as source text: a string as it is (postponed annotations), an object by its
    name (the module imports it, IMPORTS)."""
    if isinstance(value, str):
        return value
    text = inspect.formatannotation(value)
    for module in ("collections.abc.", "typing.", "datetime."):
        text = text.replace(module, "")
    return text


def parameter(p: inspect.Parameter) -> str:
    text = p.name if p.annotation is p.empty else f"{p.name}: {annotation(p.annotation)}"
    return text if p.default is p.empty else f"{text} = {p.default!r}"


def signature_lines(method: type, base: type) -> list[str]:
    """``def __init__(...)``: the method's parameters, then the face's keyword-only options,
    wrapped at the project's line length."""
    own = list(inspect.signature(method.__init__).parameters.values())[1:]
    options = [p for p in inspect.signature(base.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    pieces, starred = ["self"], False
    for p in [*own, *options]:
        if p.kind is p.KEYWORD_ONLY and not starred:
            pieces.append("*")
            starred = True
        pieces.append(parameter(p))
    return wrapped("    def __init__(", pieces, ") -> None:")


def wrapped(opening: str, pieces: list[str], closing: str) -> list[str]:
    """``opening`` + the pieces separated by commas + ``closing``, broken at the line length with
    continuation lines aligned under the first piece."""
    lines, line = [], opening
    for i, piece in enumerate(pieces):
        text = piece + (", " if i < len(pieces) - 1 else closing)
        if len(line) + len(text.rstrip()) > LINE and line != opening:
            lines.append(line.rstrip())
            line = " " * len(opening)
        line += text
    return [*lines, line]


def class_source(method: type, base: type, target: Target) -> list[str]:
    doc = (f"{inspect.cleandoc(method.__doc__)}\n\nOptions of the {target.public} face ({base.__name__}):\n"
           f"{options_doc(base)}")
    renamed = getattr(method.__init__, "renamed", {})
    decorator = (wrapped("    @renamed_options(", [f'{old}="{new}"' for old, new in renamed.items()], ")")
                 if renamed else [])
    return ["", "", f"class {method.__name__}({base.__name__}):",
            textwrap.indent(f'"""{doc}\n"""', "    "), "",
            f'    __module__ = "{target.public}"', "",
            *decorator, *signature_lines(method, base),
            f"        build_face(self, {base.__name__}, algorithms.{method.__name__}, locals())"]


def module_source(target: Target) -> str:
    """The whole module for one face."""
    from hvd_sparse import registry

    base = getattr(importlib.import_module(target.base_module), target.base)
    by_name = {cls.__name__: cls for cls in registry.METHODS.values()}
    methods = [by_name[name] for name in GROUPS[target.group]]
    body = [line for method in methods for line in class_source(method, base, target)]
    text = "\n".join(body)
    imports = sorted({IMPORTS[name] for name in IMPORTS if f": {name}" in text or f"{name} |" in text
                      or f"| {name}" in text})
    relative = "." + target.base_module.rpartition(".")[2]
    names = [m.__name__ for m in methods]
    what = WHAT[target.group]
    head = [f'"""The {target.public} face of the {what}, one class each: written by',
            "tools/generate_faces.py from hvd_sparse/algorithms and the face's options; do not edit",
            '(tests/unit/test_face_modules.py checks that it is current)."""', "",
            "from __future__ import annotations", "",
            *[i for i in imports if not i.startswith("from ..")], "",
            "from .. import algorithms",
            *[i for i in imports if i.startswith("from ..")],
            *(["from ..errors import renamed_options"] if "@renamed_options" in text else []),
            "from ..faces import build_face",
            f"from {relative} import {base.__name__}"]
    tail = ["", "", f"FACES: dict[str, type[{base.__name__}]] = {{",
            *[f'    "{name}": {name},' for name in names], "}"]
    return "\n".join([*head, *body, *tail]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for target in TARGETS:
        path, text = REPO / target.path, module_source(target)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(target.path)
        else:
            path.write_text(text)
            print(f"wrote {target.path}")
    if stale:
        sys.exit(f"out of date: {', '.join(stale)}; run python tools/generate_faces.py")


if __name__ == "__main__":
    main()
