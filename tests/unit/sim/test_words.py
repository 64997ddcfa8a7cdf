"""The word-level language-model task: the standard-library corpus (tokens, vocabulary, splits,
determinism), its per-rank batches, and the PyTorch model (hvd_sparse/sim/words.py, tasks.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_sparse.sim import simulate, words  # noqa: E402
from hvd_sparse.sim.tasks import TASKS, WordLSTM, task_info, word_lstm_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def corpus() -> words.WordCorpus:
    return words.word_corpus()


def test_tokens_are_words_numbers_and_punctuation_with_one_eos_per_line():
    text = "\n  \ndef f_2(x):  # twice\n\n    return x+10.5\r\n"
    assert words.tokenize(text) == ["def", "f_2", "(", "x", ")", ":", "#", "twice", "<eos>",
                                    "return", "x", "+", "10", ".", "5", "<eos>"]
    assert words.tokenize("") == [] and words.tokenize("no newline") == ["no", "newline", "<eos>"]


def test_the_vocabulary_ranks_by_count_then_by_text():
    tokens = ["b", "a", "<eos>", "c", "b", "a", "<eos>", "<eos>", "d"]
    assert words.build_vocabulary(tokens, 4) == ("<unk>", "<eos>", "a", "b")
    assert words.build_vocabulary(tokens, 10) == ("<unk>", "<eos>", "a", "b", "c", "d")


def test_known_words_round_trip_and_unknown_ones_read_unk(corpus):
    assert len(corpus.vocab) == words.VOCAB_SIZE and corpus.vocab[:2] == (words.UNK, words.EOS)
    assert len(set(corpus.vocab)) == len(corpus.vocab)
    tokens = words.tokenize("def __init__(self, name=None):\n    return self.name[0]\n")
    ids = corpus.encode(tokens)
    assert 0 not in ids and corpus.decode(ids) == tokens
    unknown = corpus.encode(["zq_not_a_python_word_qz", "self"])
    assert unknown[0] == 0 and corpus.decode(unknown) == ["<unk>", "self"]


def test_the_corpus_is_the_standard_library_and_identifies_itself(corpus):
    info = corpus.info()
    assert info["files"] > 100 and info["python"].count(".") == 2
    assert len(info["sha256"]) == 64 and int(info["sha256"], 16) >= 0
    assert "os.py" in corpus.files and not any("/" in name for name in corpus.files)
    assert list(corpus.files) == sorted(corpus.files)
    assert info["tokens"]["train"] > 500_000 and info["tokens"]["valid"] > 20_000
    assert task_info("word-lstm") == info and task_info("lstm") == {}
    assert words.word_corpus(words.VOCAB_SIZE) is corpus                # one build per process


def test_splits_are_disjoint_interleaved_chunks_that_cover_the_corpus(corpus):
    train, valid, test = words.split_positions(10 * words.CHUNK * words.SPLIT_EVERY + 7)
    assert (train.astype(int) + valid + test == 1).all()
    assert valid.mean() == pytest.approx(1 / words.SPLIT_EVERY, rel=0.01) and test.sum() == valid.sum()
    assert valid[(words.SPLIT_EVERY - 2) * words.CHUNK: (words.SPLIT_EVERY - 1) * words.CHUNK].all()
    text, files = words.corpus_text()
    assert files == corpus.files
    codes = corpus.encode(words.tokenize(text))       # the whole stream, split back by the masks
    masks = words.split_positions(codes.size)
    for mask, split in zip(masks, (corpus.train, corpus.valid, corpus.test), strict=True):
        np.testing.assert_array_equal(codes[mask], split)
    assert not corpus.train.flags.writeable


def test_two_builds_are_identical():
    build = words.build_corpus.__wrapped__           # bypass the cache: build twice from the files
    one, two = build(500, 300_000), build(500, 300_000)
    assert one.vocab == two.vocab and one.sha256 == two.sha256 and one.files == two.files
    for name in ("train", "valid", "test"):
        np.testing.assert_array_equal(getattr(one, name), getattr(two, name))
    assert len(one.vocab) == 500 and one.train.max() == 499


def test_the_size_cap_takes_whole_files_in_name_order(tmp_path):
    for name, text in [("b.py", "bb\n"), ("a.py", "a a"), ("c.py", "cccc\n")]:
        (tmp_path / name).write_text(text)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_a.py").write_text("skipped\n")
    assert words.corpus_text(root=tmp_path) == ("a a\nbb\ncccc\n", ("a.py", "b.py", "c.py"))
    assert words.corpus_text(7, root=tmp_path) == ("a a\nbb\n", ("a.py", "b.py"))


def test_batches_are_deterministic_per_rank_and_step(corpus):
    x, y = words.word_batch(corpus.train, 0, 0, batch_size=4, seq_len=16)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])                   # the next token
    again = words.word_batch(corpus.train, 0, 0, batch_size=4, seq_len=16)
    np.testing.assert_array_equal(again[0], x)
    np.testing.assert_array_equal(again[1], y)
    for rank, step, seed in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]:
        assert not np.array_equal(words.word_batch(corpus.train, rank, step, 4, 16, seed)[0], x)
    ex, ey = words.eval_windows(corpus.valid, eval_len=32, max_tokens=1000)
    assert ex.shape == ey.shape == (1000 // 33, 32)
    np.testing.assert_array_equal(ex[1, :5], corpus.valid[33:38])


def test_the_torch_model_has_millions_of_parameters_mostly_embedding_and_decoder():
    model = word_lstm_model(seed=0)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    total = sum(sizes.values())
    assert total == 2 * 10_000 * 256 + 10_000 + 4 * 4 * 256 * 256 == 6_178_576
    assert (sizes["embed.weight"] + sizes["decode.weight"]) / total > 0.8
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, words.VOCAB_SIZE)
    assert max(p.abs().max().item() for p in model.parameters()) <= np.float32(words.INIT_RANGE)
    again = word_lstm_model(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert not torch.equal(word_lstm_model(seed=1).embed.weight, model.embed.weight)
    assert isinstance(TASKS["word-lstm"](eval_tokens=200).model, WordLSTM)


def test_the_task_learns_and_evaluates_perplexity(corpus):
    options = {"seq_len": 16, "eval_tokens": 2000, "embedding": 32, "hidden": 32}
    job = TASKS["word-lstm"](batch_size=4, **options)
    x = job.batch(1, 3)[0]
    np.testing.assert_array_equal(x.numpy(), words.word_batch(corpus.train, 1, 3, 4, 16)[0])
    before = job.evaluate(job.model)["perplexity"]
    assert 0.9 * words.VOCAB_SIZE < before < 1.1 * words.VOCAB_SIZE         # untrained: uniform
    records = simulate("dense", 2, 30, task="word-lstm", lr=1.0, clip_norm=0.5, evaluate_every=30,
                       batch_size=4, task_options=options)
    assert records[-1]["perplexity"] < 0.2 * before
    assert 20 < words.unigram_perplexity(corpus) < 1000
