"""Functions fit on a screen: none in the package, its kernels or the scripts is much over 50
lines (ruff's C90 holds complexity at 12; this holds length, which ruff does not measure); and no
module of the package is over 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 60   # "about 50": a docstring or a long signature may take a few more
MODULE_LINES = 500


def long_functions(*folders: str) -> list[str]:
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > LONGEST:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_of_the_package_or_its_kernels_is_over_about_50_lines():
    assert long_functions("hvd_sparse", "kernels") == []


def test_every_script_main_is_split_into_named_parts():
    assert [f for f in long_functions("scripts") if " main (" in f] == []


def test_no_module_of_the_package_is_over_500_lines():
    long = [f"{path.relative_to(ROOT)} ({n} lines)" for path in sorted((ROOT / "hvd_sparse").rglob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES]
    assert long == []
