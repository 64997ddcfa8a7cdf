"""The documentation a contributor is pointed to lives in the repository, and every pointer lands.

* No file of the package, the tests, the scripts, the kernels or the user-facing docs cites a
  design or reference document from outside the repository: a clone must hold whatever the code
  points to (docs/algorithms.md, docs/architecture.md carry those facts in the project's words).
* Every ``docs/<page>.md#<anchor>`` written in code, and every link between the pages of docs/,
  names a page that exists and a heading (or explicit anchor) that the page has, so renaming a
  heading without updating its citations fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Where code and user documentation live; directories that do not exist (yet) are skipped.
CODE_DIRS = ("hvd_sparse", "tests", "scripts", "kernels", "tools", "examples")
TOP_FILES = ("README.md", "constraints.txt", "Makefile", "setup.py", "pyproject.toml")
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}

# Documents that lived beside the repository during development and must not be cited from it.
OUTSIDE_DOCUMENTS = ("ALGORITHMS", "HOROVOD", "DESIGN", "STACK")
OUTSIDE = re.compile(r"\b(?:" + "|".join(OUTSIDE_DOCUMENTS) + r")\.md\b|\.\./shared\b")

CODE_LINK = re.compile(r"\bdocs/([A-Za-z0-9_-]+\.md)#([A-Za-z0-9_-]+)")
DOC_LINK = re.compile(r"\]\(([A-Za-z0-9_-]+\.md)?#([A-Za-z0-9_-]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def text_files() -> list[Path]:
    """Every readable text file of the code directories, plus the top-level files and docs/."""
    found = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for top in (*CODE_DIRS, "docs"):
        base = ROOT / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            parts = set(path.relative_to(ROOT).parts)
            if path.is_file() and not parts & SKIPPED_DIRS and not any(p.startswith(".") for p in parts):
                found.append(path)
    return found


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:   # a compiled kernel, an image: not documentation
        return None


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a Markdown page: its headings (outside code blocks, repeated slugs numbered
    as GitHub does) and explicit ``<a id=...>`` / ``<a name=...>`` anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(EXPLICIT_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slug_follows_github():
    assert slug("The sweep") == "the-sweep"
    assert slug("Horovod's contract") == "horovods-contract"
    assert slug("`TopK` and RandomK") == "topk-and-randomk"


def test_nothing_cites_a_document_outside_the_repository():
    offenders = []
    for path in text_files():
        text = read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, ("cite docs/algorithms.md or docs/architecture.md instead of documents outside "
                           "the repository:\n" + "\n".join(offenders))


def code_links() -> list[tuple[str, str, str, str]]:
    """(where, page, anchor, line) for every docs/<page>.md#<anchor> outside docs/."""
    links = []
    for path in text_files():
        if path.parent == DOCS:
            continue
        text = read_text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for page, anchor in CODE_LINK.findall(line):
                links.append((f"{path.relative_to(ROOT)}:{number}", page, anchor, line.strip()))
    return links


def doc_links() -> list[tuple[str, str, str, str]]:
    """(where, page, anchor, line) for every [..](page.md#anchor) and [..](#anchor) in docs/."""
    links = []
    for page in sorted(DOCS.glob("*.md")):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for target, anchor in DOC_LINK.findall(line):
                links.append((f"docs/{page.name}:{number}", target or page.name, anchor, line.strip()))
    return links


@pytest.mark.parametrize("collect", [code_links, doc_links], ids=["from-code", "between-docs"])
def test_every_docs_anchor_exists(collect):
    links = collect()
    assert len(links) >= 10, f"found only {len(links)} links: is the link pattern still right?"
    known: dict[str, set[str]] = {}
    broken = []
    for where, page, anchor, line in links:
        path = DOCS / page
        if not path.is_file():
            broken.append(f"{where}: no docs/{page} ({line})")
            continue
        if page not in known:
            known[page] = anchors(path)
        if anchor not in known[page]:
            broken.append(f"{where}: docs/{page} has no heading for #{anchor} ({line})")
    assert not broken, "\n".join(broken)
