"""Small real training tasks for the N-rank simulator: data that ships with installed packages.

* ``digits``: a small CNN on scikit-learn's ``load_digits`` (8x8 images, 10 classes).
* ``digits-mlp``: a three-layer MLP on the same data, whose gradient mass is concentrated.
* ``lstm``: a character-level LSTM language model on real English prose shipped with Python itself
  (``pydoc_data.topics``: the text of the Python documentation's help topics), with a held-out
  split and a perplexity evaluation.
* ``word-lstm``: a word-level LSTM language model (6.2 M parameters, 83% of them in the embedding
  and the decoder) on the source of Python's standard library (``words.py``): the
  communication-bound task, whose dense allreduce at 1 Gbit/s takes longer than its gradient.
* ``gpt``: a small GPT-style transformer (``gpt.py``: 2 blocks, 128 wide, 0.93 M parameters, the
  decoder tied to the embedding) on the same corpus with a 4096-token vocabulary: the task that
  AdamW trains (``simulate(..., optimizer="adamw")``).

Every rank draws its own minibatches from a generator seeded by (seed, rank, step), so two runs
with the same seed see the same data in the same order whatever the method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import gpt, words


class DigitsCNN(torch.nn.Module):
    """38k parameters: two 3x3 convolutions, one pooling, two dense layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        """Class scores of a batch of 8x8 images."""
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@dataclass
class Task:
    """A model, its loss on a batch, per-rank batches and an evaluation metric."""

    name: str
    model: torch.nn.Module
    loss: Callable[[torch.nn.Module, tuple], torch.Tensor]
    batch: Callable[[int, int], tuple]          # (rank, step) -> batch
    evaluate: Callable[[torch.nn.Module], dict]


class DigitsMLP(torch.nn.Module):
    """A wide first layer (sparse, small gradients per entry) before a narrow classifier: the
    gradient mass is far from uniform along the flat vector, as in real models."""

    def __init__(self, hidden: int = 256):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        """Class scores of a batch of 8x8 images."""
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def digits_task(batch_size: int = 16, seed: int = 0, model: str = "cnn") -> Task:
    """scikit-learn's digits with a CNN (or ``model="mlp"``), per-rank batches seeded by rank and step."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32)[:, None]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    module = DigitsCNN() if model == "cnn" else DigitsMLP()

    def batch(rank: int, step: int) -> tuple:
        rng = np.random.default_rng([seed, rank, step])
        pick = torch.from_numpy(rng.choice(len(x_train), batch_size, replace=False))
        return x_train[pick], y_train[pick]

    def loss(module: torch.nn.Module, data: tuple) -> torch.Tensor:
        return F.cross_entropy(module(data[0]), data[1])

    def evaluate(module: torch.nn.Module) -> dict:
        with torch.no_grad():
            accuracy = (module(x_test).argmax(1) == y_test).float().mean().item()
        return {"accuracy": accuracy}

    return Task(f"digits-{'cnn' if isinstance(module, DigitsCNN) else 'mlp'}", module, loss, batch, evaluate)


def digits_mlp_task(batch_size: int = 16, seed: int = 0) -> Task:
    """The digits task with the MLP."""
    return digits_task(batch_size, seed, model="mlp")


# --- character-level language model -------------------------------------------------------------
# Printable ASCII, newline, and one symbol for every other character (curly quotes, dashes, ...).
CHARSET = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(CHARSET)
VOCAB = len(CHARSET) + 1
HELD_OUT_CHUNK = 1000   # the text is cut into chunks of this many characters ...
HELD_OUT_EVERY = 10     # ... and every 10th chunk is held out (interleaved: no topic bias)


def english_text() -> str:
    """The help topics of the running Python's documentation, in sorted key order (about 465k
    characters on Python 3.11)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def encode(text: str) -> np.ndarray:
    """Characters as indices into ``CHARSET`` (``UNKNOWN`` for the rest)."""
    table = np.full(0x110000, UNKNOWN, dtype=np.uint8)
    table[[ord(c) for c in CHARSET]] = np.arange(len(CHARSET), dtype=np.uint8)
    return table[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]


def split_text(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(training codes, held-out codes): every ``HELD_OUT_EVERY``-th chunk is held out."""
    chunk = np.arange(codes.size) // HELD_OUT_CHUNK
    held = chunk % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
    return codes[~held], codes[held]


class CharLSTM(torch.nn.Module):
    """About 99k parameters: a 32-wide embedding, one LSTM layer of 128 units, a linear decoder."""

    def __init__(self, embedding: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, embedding)
        self.lstm = torch.nn.LSTM(embedding, hidden, batch_first=True)
        self.decode = torch.nn.Linear(hidden, VOCAB)

    def forward(self, x):
        """Next-character scores at every position of a batch of index sequences."""
        out, _ = self.lstm(self.embed(x))
        return self.decode(out)


def lstm_task(batch_size: int = 16, seed: int = 0, seq_len: int = 64, eval_len: int = 128,
              eval_chars: int | None = None, embedding: int = 32, hidden: int = 128) -> Task:
    """Next-character prediction; each rank's batch is ``batch_size`` windows of ``seq_len + 1``
    characters at random offsets of the training text (truncated back-propagation, zero initial
    state). ``evaluate`` returns the held-out perplexity exp(mean cross-entropy) and bits per
    character over consecutive windows of ``eval_len`` characters of the held-out text (its first
    ``eval_chars`` characters, or all of it). ``embedding``/``hidden`` size the model (the
    defaults give 99k parameters)."""
    torch.manual_seed(seed)
    train, held_out = split_text(encode(english_text()))
    train_codes = torch.from_numpy(train.astype(np.int64))
    held = held_out[: eval_chars] if eval_chars else held_out
    windows = held.size // (eval_len + 1)
    eval_batch = torch.from_numpy(
        held[: windows * (eval_len + 1)].astype(np.int64).reshape(windows, eval_len + 1))
    model = CharLSTM(embedding, hidden)

    def batch(rank: int, step: int) -> tuple:
        rng = np.random.default_rng([seed, rank, step])
        starts = torch.from_numpy(rng.integers(0, train_codes.numel() - seq_len - 1, batch_size))
        rows = train_codes[starts[:, None] + torch.arange(seq_len + 1)]
        return rows[:, :-1], rows[:, 1:]

    def loss(module: torch.nn.Module, data: tuple) -> torch.Tensor:
        return F.cross_entropy(module(data[0]).reshape(-1, VOCAB), data[1].reshape(-1))

    def evaluate(module: torch.nn.Module) -> dict:
        with torch.no_grad():
            nats = loss(module, (eval_batch[:, :-1], eval_batch[:, 1:])).item()
        return {"perplexity": float(np.exp(nats)), "bits_per_char": nats / float(np.log(2.0))}

    return Task("lstm", model, loss, batch, evaluate)


# --- word-level language model -------------------------------------------------------------------
class WordLSTM(torch.nn.Module):
    """Embedding, ``layers`` stacked LSTM layers without biases, linear decoder (untied): 6.18 M
    parameters at the defaults, 83% of them in the embedding and the decoder. Every weight starts
    uniform in ±``words.INIT_RANGE``, the decoder's bias at 0, as ``words_tf.keras_word_lstm``'s (the
    same tensors, the same parameter count)."""

    def __init__(self, vocab_size: int = words.VOCAB_SIZE, embedding: int = 256, hidden: int = 256,
                 layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, embedding)
        self.lstm = torch.nn.LSTM(embedding, hidden, layers, bias=False, batch_first=True)
        self.decode = torch.nn.Linear(hidden, vocab_size)
        for name, weight in self.named_parameters():
            if name == "decode.bias":
                torch.nn.init.zeros_(weight)
            else:
                torch.nn.init.uniform_(weight, -words.INIT_RANGE, words.INIT_RANGE)

    def forward(self, x):
        """Next-token scores at every position of a batch of id sequences (zero initial state)."""
        out, _ = self.lstm(self.embed(x))
        return self.decode(out)


def word_lstm_model(seed: int = 0, vocab_size: int = words.VOCAB_SIZE, embedding: int = 256,
                    hidden: int = 256, layers: int = 2) -> WordLSTM:
    """The word model, initialised from ``seed`` (the same weights for the same seed)."""
    torch.manual_seed(seed)
    return WordLSTM(vocab_size, embedding, hidden, layers)


def word_lstm_task(batch_size: int = 16, seed: int = 0, seq_len: int = 32, eval_len: int = 64,
                   eval_tokens: int | None = words.EVAL_TOKENS, vocab_size: int = words.VOCAB_SIZE,
                   embedding: int = 256, hidden: int = 256, split: str = "valid") -> Task:
    """Next-token prediction with the word LSTM on the standard-library corpus
    (``words.word_corpus``); batches and evaluation: ``language_model_task``."""
    corpus = words.word_corpus(vocab_size)
    model = word_lstm_model(seed, vocab_size, embedding, hidden)
    return language_model_task("word-lstm", model, corpus, batch_size, seed, seq_len, eval_len,
                               eval_tokens, split)


def language_model_task(name: str, model: torch.nn.Module, corpus: words.WordCorpus, batch_size: int,
                        seed: int, seq_len: int, eval_len: int, eval_tokens: int | None,
                        split: str) -> Task:
    """A next-token task on ``corpus`` (the word and transformer tasks): each rank's batch is
    ``words.word_batch`` (``batch_size`` windows of ``seq_len + 1`` tokens seeded by seed, rank and
    step); ``evaluate`` returns the perplexity over consecutive windows of ``eval_len`` tokens of
    the first ``eval_tokens`` tokens (None: all) of ``split``."""
    vocab_size = len(corpus.vocab)
    eval_x, eval_y = (torch.from_numpy(a) for a in
                      words.eval_windows(getattr(corpus, split), eval_len, eval_tokens))

    def batch(rank: int, step: int) -> tuple:
        x, y = words.word_batch(corpus.train, rank, step, batch_size, seq_len, seed)
        return torch.from_numpy(x), torch.from_numpy(y)

    def loss(module: torch.nn.Module, data: tuple) -> torch.Tensor:
        return F.cross_entropy(module(data[0]).reshape(-1, vocab_size), data[1].reshape(-1))

    def evaluate(module: torch.nn.Module) -> dict:
        with torch.no_grad():   # in pieces of 64 windows: the logits of all of them are large
            nats = sum(loss(module, (x, y)).item() * y.numel()
                       for x, y in zip(eval_x.split(64), eval_y.split(64), strict=True))
        return {"perplexity": float(np.exp(nats / eval_y.numel()))}

    return Task(name, model, loss, batch, evaluate)


def gpt_task(batch_size: int = 8, seed: int = 0, seq_len: int = 32, eval_len: int = 64,
             eval_tokens: int | None = words.EVAL_TOKENS, vocab_size: int = gpt.VOCAB_SIZE,
             width: int = gpt.WIDTH, layers: int = gpt.LAYERS, split: str = "valid") -> Task:
    """Next-token prediction with the small GPT (``gpt.gpt_model``) on the standard library's
    whole tree (``words.word_corpus(scope="tree")``) at a ``vocab_size`` vocabulary; batches and
    evaluation: ``language_model_task``. At 4 ranks and the default batch (8 windows of 32 tokens
    a rank), 2000 steps read 2.0 M tokens, about one pass over the 2.3 M training tokens."""
    corpus = words.word_corpus(vocab_size, scope=gpt.CORPUS_SCOPE)
    model = gpt.gpt_model(seed, vocab_size, width, layers, context=max(seq_len, eval_len))
    return language_model_task("gpt", model, corpus, batch_size, seed, seq_len, eval_len,
                               eval_tokens, split)


def task_info(name: str, **options) -> dict:
    """What a run of task ``name`` should record about its data besides the configuration: the
    language models' corpus (Python version, hash of the text, sizes); nothing for the others."""
    if name == "word-lstm":
        return words.word_corpus(options.get("vocab_size", words.VOCAB_SIZE)).info()
    if name == "gpt":
        return words.word_corpus(options.get("vocab_size", gpt.VOCAB_SIZE), scope=gpt.CORPUS_SCOPE).info()
    return {}


TASKS = {"digits": digits_task, "digits-mlp": digits_mlp_task, "lstm": lstm_task,
         "word-lstm": word_lstm_task, "gpt": gpt_task}
