"""A word-level corpus that ships with Python, for the word-level language-model task (NumPy only).

The corpus is the source code of the running interpreter's standard library: every top-level
module ``<stdlib>/*.py`` (``sysconfig.get_paths()["stdlib"]``), in sorted file-name order, read
whole until ``MAX_CHARS`` characters. Why this text:

* it is on every machine that runs the project, identical on every rank, and never downloaded;
* it is real and large enough for a word model: on CPython 3.11.7 its 168 files hold 4.7 M
  characters, 1.0 M tokens and 27 k distinct tokens (the help topics of ``pydoc_data``, the
  char-LSTM's text, hold 3.8 k distinct words: too few);
* it mixes code and English (docstrings, comments), with a long-tailed vocabulary like WikiText's;
* top-level modules only: the tests (``test/``), ``site-packages`` and third-party code are
  directories, so none of them enter, and nothing that ``pip`` installs changes the text.

The transformer task reads the wider ``"tree"`` corpus (``word_corpus(..., scope="tree")``): every
``*.py`` under the standard library, in sorted relative-path order, except the directories named in
``TREE_EXCLUDED`` (tests, installed packages, codec tables): 612 files, 10.7 M characters and 2.5 M
tokens on CPython 3.11.7, so that a 2000-step run at 4 ranks reads its training split about once
instead of learning it by heart.

The text depends on the Python release (patch releases edit the standard library), so
``WordCorpus.sha256`` (of the text read) and ``python`` are recorded with every result; the
tested stack is CPython 3.11.

Tokens (``tokenize``): identifiers and words (``[A-Za-z_][A-Za-z0-9_]*``), runs of digits, and
every other non-blank character alone; each line with a token ends with ``<eos>`` (indentation and
blank lines are dropped). The stream is cut into chunks of ``CHUNK`` tokens; of every
``SPLIT_EVERY`` chunks, the last but one is validation and the last is test, the rest training:
contiguous ranges spread over the whole corpus (no module's topic only in one split), no token in
two splits. The vocabulary is the ``vocab_size - 2`` most frequent training tokens (ties broken by
the token's text) after ``<unk>`` (0) and ``<eos>`` (1); every other token reads as ``<unk>``.

Batches (``word_batch``) are ``batch_size`` windows at offsets drawn from a generator seeded by
(seed, rank, step): distinct per rank and step, identical on every call, whatever the world size.
"""

from __future__ import annotations

import hashlib
import platform
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from itertools import compress
from pathlib import Path

import numpy as np

UNK, EOS = "<unk>", "<eos>"
VOCAB_SIZE = 10_000        # rows of the embedding and of the decoder, <unk> and <eos> included
MAX_CHARS = 6_000_000      # the size cap: whole files in sorted order up to this many characters
TREE_MAX_CHARS = 16_000_000   # ... for the "tree" corpus
CHUNK = 2_000              # tokens per chunk of the split ...
SPLIT_EVERY = 20           # ... and of every 20 chunks, one validation and one test (5% each)
EVAL_TOKENS = 16_384       # the evaluation's default: the first 16 k validation tokens
INIT_RANGE = 0.1           # both frameworks' models start with weights uniform in ±0.1
# Dense training that learns, at 2 ranks (measured on CPython 3.11.7; docs/usage.md): SGD with
# momentum on the averaged gradient, its norm clipped, a constant rate. Held-out perplexity 105
# after 50 steps, 55 after 100, 36 after 250, 29 after 500, 22.4 after 1000 (unigram: 174); lr 16
# does not learn, lr 0.5 learns at half the pace.
RECIPE = {"lr": 4.0, "momentum": 0.9, "clip_norm": 1.0, "schedule": "constant", "batch_size": 16,
          "seq_len": 32, "steps": 1000}
# What the "tree" corpus leaves out: tests, installed packages and generated codec tables.
TREE_EXCLUDED = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"})
SCOPES = ("top", "tree")
TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[^\sA-Za-z0-9_]|\n")


def source_files(root: Path | None = None, scope: str = "top") -> list[Path]:
    """The corpus's files: the top-level ``*.py`` modules of the standard library (of ``root``),
    sorted by name; with ``scope="tree"`` every ``*.py`` below it outside ``TREE_EXCLUDED``
    directories, sorted by relative path."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    if scope == "top":
        return sorted(root.glob("*.py"), key=lambda path: path.name)
    inside = (path for path in root.rglob("*.py")
              if not set(path.relative_to(root).parts[:-1]) & TREE_EXCLUDED)
    return sorted(inside, key=lambda path: path.relative_to(root).as_posix())


def corpus_text(max_chars: int = MAX_CHARS, root: Path | None = None,
                scope: str = "top") -> tuple[str, tuple[str, ...]]:
    """(text, file names): the whole files of ``source_files`` in order, while they fit in
    ``max_chars`` characters (the first one always)."""
    parts: list[str] = []
    names: list[str] = []
    size = 0
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    for path in source_files(base, scope):
        text = path.read_text(encoding="utf-8", errors="replace")
        if parts and size + len(text) > max_chars:
            break
        parts.append(text if text.endswith("\n") else text + "\n")
        names.append(path.relative_to(base).as_posix())
        size += len(parts[-1])
    return "".join(parts), tuple(names)


def tokenize(text: str) -> list[str]:
    """Words and identifiers, digit runs and single punctuation characters, with ``<eos>`` after
    every line (``\\n``-separated) that has a token."""
    raw = TOKEN.findall(text + "\n")
    # a newline ends a line that had tokens when the token before it is not a newline
    before = ["\n", *raw[:-1]]
    return [EOS if token == "\n" else token for token, previous in zip(raw, before, strict=True)
            if token != "\n" or previous != "\n"]


def split_positions(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boolean masks (train, validation, test) over ``count`` token positions: chunk ``c`` of
    ``CHUNK`` tokens is validation when ``c % SPLIT_EVERY == SPLIT_EVERY - 2``, test when it is
    ``SPLIT_EVERY - 1``, training otherwise."""
    phase = (np.arange(count) // CHUNK) % SPLIT_EVERY
    valid, test = phase == SPLIT_EVERY - 2, phase == SPLIT_EVERY - 1
    return ~(valid | test), valid, test


def build_vocabulary(tokens: list[str], size: int) -> tuple[str, ...]:
    """``<unk>``, ``<eos>`` and the ``size - 2`` most frequent other tokens, by falling count and
    then by text (deterministic ties)."""
    counts = Counter(tokens)
    counts.pop(UNK, None)
    counts.pop(EOS, None)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return (UNK, EOS, *(token for token, _ in ranked[: max(size - 2, 0)]))


@dataclass(frozen=True, eq=False)
class WordCorpus:
    """The encoded splits (read-only int32 arrays), the vocabulary and what identifies the text."""

    vocab: tuple[str, ...]
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    sha256: str                # of the text read (UTF-8)
    files: tuple[str, ...]
    python: str                # the interpreter whose standard library was read
    scope: str = "top"         # which files: the top-level modules, or the tree (``SCOPES``)

    @property
    def index(self) -> dict[str, int]:
        """Token -> id."""
        return _index(self.vocab)

    def encode(self, tokens: list[str]) -> np.ndarray:
        """Ids of ``tokens`` (``<unk>``'s, 0, for tokens outside the vocabulary)."""
        index = self.index
        return np.fromiter((index.get(t, 0) for t in tokens), dtype=np.int32, count=len(tokens))

    def decode(self, ids) -> list[str]:
        """Tokens of ``ids``."""
        return [self.vocab[i] for i in np.asarray(ids).ravel().tolist()]

    def info(self) -> dict:
        """What a result should record about the corpus (JSON-ready)."""
        return {"corpus": "python-stdlib" if self.scope == "top" else "python-stdlib-tree",
                "scope": self.scope, "python": self.python, "sha256": self.sha256,
                "files": len(self.files), "vocab_size": len(self.vocab),
                "tokens": {"train": int(self.train.size), "valid": int(self.valid.size),
                           "test": int(self.test.size)}}


@lru_cache(maxsize=8)
def _index(vocab: tuple[str, ...]) -> dict[str, int]:
    return {token: i for i, token in enumerate(vocab)}


def word_corpus(vocab_size: int = VOCAB_SIZE, max_chars: int | None = None,
                scope: str = "top") -> WordCorpus:
    """The standard-library corpus, tokenized, split and encoded (built once per process and
    argument set: about a second; the "tree" corpus about three). ``max_chars`` default:
    ``MAX_CHARS`` for the top-level modules, ``TREE_MAX_CHARS`` for the tree."""
    if max_chars is None:
        max_chars = MAX_CHARS if scope == "top" else TREE_MAX_CHARS
    return build_corpus(int(vocab_size), int(max_chars), scope)


@lru_cache(maxsize=4)
def build_corpus(vocab_size: int, max_chars: int, scope: str = "top") -> WordCorpus:
    """``word_corpus``, built from the files (``build_corpus.__wrapped__``) or from the cache."""
    text, files = corpus_text(max_chars, scope=scope)
    tokens = tokenize(text)
    train, valid, test = split_positions(len(tokens))
    vocab = build_vocabulary(list(compress(tokens, train.tolist())), vocab_size)
    index = _index(vocab)
    codes = np.fromiter((index.get(t, 0) for t in tokens), dtype=np.int32, count=len(tokens))
    splits = [codes[mask] for mask in (train, valid, test)]
    for split in splits:
        split.flags.writeable = False
    train_codes, valid_codes, test_codes = splits
    return WordCorpus(vocab, train_codes, valid_codes, test_codes,
                      sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(), files=files,
                      python=platform.python_version(), scope=scope)


def word_batch(tokens: np.ndarray, rank: int, step: int, batch_size: int = 16, seq_len: int = 32,
               seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int64 arrays of shape (batch_size, seq_len): windows of ``seq_len + 1``
    tokens of ``tokens`` at offsets drawn from a generator seeded by (seed, rank, step); the
    targets are the inputs shifted by one token."""
    rng = np.random.default_rng([seed, rank, step])
    starts = rng.integers(0, tokens.size - seq_len - 1, batch_size)
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    return rows[:, :-1], rows[:, 1:]


def eval_windows(tokens: np.ndarray, eval_len: int = 64,
                 max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int64 arrays of shape (windows, eval_len): consecutive windows of
    ``eval_len + 1`` tokens over the first ``max_tokens`` tokens (or all) of ``tokens``."""
    held = tokens[:max_tokens] if max_tokens else tokens
    windows = held.size // (eval_len + 1)
    rows = held[: windows * (eval_len + 1)].astype(np.int64).reshape(windows, eval_len + 1)
    return rows[:, :-1], rows[:, 1:]


def unigram_perplexity(corpus: WordCorpus, split: str = "valid") -> float:
    """The perplexity on ``split`` of the training split's token frequencies (add-one smoothed):
    the level a model that ignores context reaches."""
    counts = np.bincount(corpus.train, minlength=len(corpus.vocab)) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(np.exp(-log_p[getattr(corpus, split)].mean()))
