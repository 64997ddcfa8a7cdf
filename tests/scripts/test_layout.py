"""scripts/ shows what it holds: drivers at the top, workers/, models/ and investigations/ apart,
and scripts/README.md lists every one of them in its role."""

from __future__ import annotations

import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ROLES = {"workers": "## Workers", "models": "## Models", "investigations": "## Investigations",
         ".": "## Drivers"}


def sections() -> dict[str, str]:
    text = (SCRIPTS / "README.md").read_text(encoding="utf-8")
    parts = re.split(r"(?m)^(## .+)$", text)
    return {parts[i].split(" (")[0]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_script_is_listed_under_its_role():
    listed = sections()
    missing = []
    for folder, heading in ROLES.items():
        for path in sorted((SCRIPTS / folder).glob("*.py")):
            if path.name != "__init__.py" and f"`{path.name}`" not in listed[heading]:
                missing.append(f"{folder}/{path.name}")
    assert missing == []


def test_nothing_but_these_folders_holds_scripts():
    folders = {p.name for p in SCRIPTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == {"workers", "models", "investigations"}
