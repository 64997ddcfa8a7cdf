"""The import graph matches docs/architecture.md#layers (read from the source by
tools/import_graph.py; nothing is imported).

* No import circle among module-level imports (top level, class bodies, ``TYPE_CHECKING`` and
  ``try`` blocks). Circles closed only by imports inside functions are reported as warnings.
* Each module imports, at any level, only its own unit and the layers below it, as the table of
  docs/architecture.md#layers (read here) sets them out.
* Only the Horovod faces import horovod; the Horovod drivers of comm/ import it inside functions
  only, and nothing the DDP face imports at module level imports it at all.
"""

from __future__ import annotations

import re
import warnings

import pytest

from tools.import_graph import FUNCTION, MODULE, ROOT, circles, edges, graph

EDGES = edges()
MODULES = {edge.source for edge in EDGES}

ROW = re.compile(r"^\| (\d+) \| (.+?) \| ")


def documented_layers() -> dict[str, int]:
    """Unit (a package or a module) -> its layer in docs/architecture.md#layers (1: the top)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        row = ROW.match(line)
        for path in re.findall(r"`([^`]+)`", row.group(2)) if row else ():
            name = path.removesuffix("/").removesuffix(".py").removesuffix("/__init__")
            layers[name.replace("/", ".")] = int(row.group(1))
    return layers


LAYERS = documented_layers()
# Imports against the layering, each with its reason (none today).
EXCEPTIONS: dict[tuple[str, str], str] = {}

HOROVOD_FACES = re.compile(r"hvd_sparse\.tensorflow(\..*)?$"
                           r"|hvd_sparse\.torch\.(compressor|elastic|horovod_internals)$")
HOROVOD_DRIVERS = {"hvd_sparse.comm.horovod_torch", "hvd_sparse.comm.horovod_tf"}


def unit(module: str) -> str:
    """The unit of a module: the longest prefix that docs/architecture.md#layers names (the unit
    ``hvd_sparse`` is the package's ``__init__.py`` alone)."""
    if module == "hvd_sparse":
        return module
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in LAYERS:
            return ".".join(parts[:end])
    raise AssertionError(f"{module} is in no unit of docs/architecture.md#layers: add it there")


def is_horovod(target: str) -> bool:
    return target == "horovod" or target.startswith("horovod.")


def test_the_graph_is_read():
    assert {"hvd_sparse", "hvd_sparse.engine.core", "hvd_sparse.kernels.cpu.topk"} <= MODULES
    assert any(e.level == FUNCTION for e in EDGES) and any(e.level == MODULE for e in EDGES)


def test_every_module_has_a_layer():
    for module in sorted(MODULES):
        unit(module)


def test_no_circle_among_module_level_imports():
    found = circles(graph(EDGES, (MODULE,)))
    assert not found, "import circles among module-level imports: " + "; ".join(
        " <-> ".join(component) for component in found)


def test_circles_through_function_level_imports_are_reported():
    module_level = circles(graph(EDGES, (MODULE,)))
    for component in circles(graph(EDGES, (MODULE, FUNCTION))):
        if component not in module_level:
            warnings.warn("import circle closed by function-level imports: " + " <-> ".join(component),
                          stacklevel=1)


def test_each_layer_imports_only_itself_and_the_layers_below():
    wrong = []
    for edge in EDGES:
        if not edge.target.startswith("hvd_sparse"):
            continue
        source, target = unit(edge.source), unit(edge.target)
        allowed = source == target or LAYERS[target] > LAYERS[source]
        if not allowed and (source, edge.target) not in EXCEPTIONS:
            wrong.append(f"{edge.source} ({edge.level}, line {edge.line}) imports {edge.target}: "
                         f"{source} may not import {target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("source", "target"), sorted(EXCEPTIONS))
def test_every_exception_to_the_layering_is_still_needed(source, target):
    assert any(unit(e.source) == source and e.target == target for e in EDGES), \
        f"no {source} module imports {target} any more: remove it from EXCEPTIONS"


def test_only_the_horovod_faces_import_horovod():
    wrong = [f"{e.source} (line {e.line}) imports {e.target}" for e in EDGES if is_horovod(e.target)
             and not HOROVOD_FACES.match(e.source)
             and not (e.source in HOROVOD_DRIVERS and e.level == FUNCTION)]
    assert not wrong, "\n".join(wrong)
    assert any(is_horovod(e.target) for e in EDGES if e.source in HOROVOD_DRIVERS)


def test_the_ddp_face_imports_no_horovod():
    module_level = graph(EDGES, (MODULE,))
    seen, todo = set(), ["hvd_sparse.torch.ddp"]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += module_level.get(module, ())
    horovod = [f"{e.source} (line {e.line})" for e in EDGES
               if e.source in seen and e.level == MODULE and is_horovod(e.target)]
    assert not horovod, "the DDP face would need Horovod: " + ", ".join(horovod)
    assert "hvd_sparse.comm.torch_distributed" in seen


def test_the_documented_layers_are_read():
    assert LAYERS["hvd_sparse"] < LAYERS["hvd_sparse.torch"] == LAYERS["hvd_sparse.tensorflow"]
    assert LAYERS["hvd_sparse.engine"] < LAYERS["hvd_sparse.algorithms"] < LAYERS["hvd_sparse.kernels"]
    assert max(LAYERS.values()) == LAYERS["hvd_sparse.errors"]
