"""The import graph of hvd_sparse, read from the source (no module is imported).

Every ``hvd_sparse/**.py`` (the kernels included, ``hvd_sparse/kernels``) is parsed;
each import statement becomes an edge from its module, marked ``module`` (runs when the module is
imported: top level, class bodies, ``if TYPE_CHECKING:`` blocks, ``try:``) or ``function`` (inside
a function: runs only when it is called). tests/unit/test_imports.py checks the graph against
docs/architecture.md#layers.

    python tools/import_graph.py            # circles, module-level and function-level apart
    python tools/import_graph.py --edges    # every edge inside the package, and every horovod import
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (("hvd_sparse", "hvd_sparse"),)
MODULE, FUNCTION = "module", "function"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (a module of the package, or any other top-level name)."""

    source: str
    target: str
    level: str      # MODULE or FUNCTION
    line: int


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for folder, package in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.AST, package: str, modules: dict) -> Iterator[tuple[str, str, int]]:
    """(target, level, line) of every import in ``tree``."""
    def visit(node: ast.AST, level: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, level, child.lineno
            elif isinstance(child, ast.ImportFrom):
                source = _absolute(child, package)
                for alias in child.names:   # ``from pkg import submodule`` imports the submodule
                    name = f"{source}.{alias.name}"
                    yield (name if name in modules else source), level, child.lineno
            inner = FUNCTION if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else level
            yield from visit(child, inner)
    yield from visit(tree, MODULE)


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import of every module of the package, in file and line order."""
    modules = package_modules(root)
    out = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        out += [Edge(name, target, level, line) for target, level, line in _imports(tree, package, modules)]
    return out


def graph(all_edges: list[Edge], levels: tuple[str, ...] = (MODULE,)) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at the given levels."""
    out: dict[str, set[str]] = {}
    for edge in all_edges:
        if edge.level in levels and edge.target.startswith("hvd_sparse") and edge.target != edge.source:
            out.setdefault(edge.source, set()).add(edge.target)
    return out


def circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted, in sorted order: every import circle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(imports.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(imports):
        if node not in index:
            connect(node)
    return sorted(found)


def main() -> None:
    """Print the circles (or, with ``--edges``, the edges) of the import graph."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge, not the circles")
    args = parser.parse_args()
    all_edges = edges()
    if args.edges:
        for edge in all_edges:
            if edge.target.startswith(("hvd_sparse", "horovod")):
                print(f"{edge.level:8} {edge.source} -> {edge.target} (line {edge.line})")
        return
    for title, levels in (("module-level imports", (MODULE,)),
                          ("module- and function-level imports", (MODULE, FUNCTION))):
        found = circles(graph(all_edges, levels))
        print(f"circles among {title}: {len(found)}")
        for component in found:
            print("  " + " <-> ".join(component))


if __name__ == "__main__":
    main()
