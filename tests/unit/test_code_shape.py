"""Functions fit on a screen: none in the package, its kernels or the scripts is much over 50
lines (ruff's C90 holds complexity at 12; this holds length, which ruff does not measure); and no
module of the package is over 500 lines; the faces, adapters of the step assembly
(engine/assembly.py), are at most 250 each (their generated class modules too:
tests/unit/test_face_modules.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGEST = 60   # "about 50": a docstring or a long signature may take a few more
MODULE_LINES = 500
FACE_LINES = 250
# The hand-written modules of the three faces: Horovod's PyTorch and TensorFlow compressors, DDP.
FACE_MODULES = ["torch/compressor.py", "torch/step_record.py", "torch/parameters.py", "torch/ddp_state.py",
                "torch/ddp_steps.py", "tensorflow/compressor.py", "tensorflow/step_graphs.py"]


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


def test_every_face_module_is_at_most_250_lines():
    lengths = {name: len((ROOT / "hvd_sparse" / name).read_text(encoding="utf-8").splitlines())
               for name in FACE_MODULES}
    assert {name: n for name, n in lengths.items() if n > FACE_LINES} == {}
