"""Real text data (jaxpar.train.text) and the interface it shares with the generated Corpus:
prepare's files, the splits, encode/decode, batches as a function of (seed, step), rows=,
validation batches from the validation split only, and every refused input."""

import json
import math
import os
import re

import numpy as np
import pydoc_data.topics
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxpar.errors import ConfigError
from jaxpar.train import text
from jaxpar.train.data import Corpus
from jaxpar.train.text import TokenData

# about 100 KB of English from the standard library: the help texts of pydoc's topics
TEXT = "\n\n".join(list(pydoc_data.topics.topics.values())[:40])
SECOND = "A second document, after the first one's end-of-text token.\n" * 20
VOCAB_SIZE = 400


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(directory, meta, the two source texts): prepare run once for the module."""
    root = tmp_path_factory.mktemp("text")
    files = [root / "topics.txt", root / "second.txt"]
    files[0].write_text(TEXT, encoding="utf-8")
    files[1].write_text(SECOND, encoding="utf-8")
    meta = text.prepare(files, root / "data", vocab_size=VOCAB_SIZE, validation=0.05, seed=3)
    return root / "data", meta, [TEXT, SECOND]


@pytest.fixture(scope="module")
def data(prepared):
    return TokenData(prepared[0])


def test_prepare_writes_tokens_tokenizer_and_meta(prepared):
    directory, meta, _ = prepared
    assert sorted(os.listdir(directory)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert json.loads((directory / "meta.json").read_text()) == meta
    assert meta["dtype"] == "uint16" and meta["seed"] == 3 and meta["validation_fraction"] == 0.05
    assert 257 <= meta["vocab_size"] <= VOCAB_SIZE and meta["end_of_text"] == 0
    assert meta["files"] == [str(directory.parent / "topics.txt"), str(directory.parent / "second.txt")]
    total = meta["train_tokens"] + meta["validation_tokens"]
    assert meta["validation_tokens"] == math.ceil(0.05 * total)
    assert (directory / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert (directory / "val.bin").stat().st_size == 2 * meta["validation_tokens"]
    assert len(TEXT.encode()) / total > 1.5    # BPE merges: fewer tokens than bytes


def test_the_splits_are_the_documents_with_end_of_text_cut_at_the_tail(prepared, data):
    _, meta, texts = prepared
    stream = np.concatenate([data.train, data.validation])
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint16
    assert stream.max() < data.vocab and data.vocab == meta["vocab_size"]
    assert data.decode(stream) == "".join(t + "<|endoftext|>" for t in texts)
    assert data.decode(data.validation) == data.decode(stream)[-len(data.decode(data.validation)):]
    assert data.decode(data.validation).endswith(SECOND + "<|endoftext|>")


@pytest.mark.parametrize("sample", ["Hello, world!", "  indented\n\ttabs\r\nand CRLF", "ünïcödé ✓ 🙂 日本語",
                                    "def f(x):\n    return x ** 2\n", "", "text <|endoftext|> more"])
def test_encode_then_decode_gives_the_text_back(data, sample):
    ids = data.encode(sample)
    assert ids.dtype == np.int32 and ids.ndim == 1 and (ids < data.vocab).all()
    assert data.decode(ids) == sample


def test_a_batch_is_a_function_of_seed_and_step(prepared, data):
    batch = data.batch(5, batch_size=4, seq_len=16)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch, TokenData.open(prepared[0]).batch(5, batch_size=4, seq_len=16))
    assert not np.array_equal(batch, data.batch(6, batch_size=4, seq_len=16))
    assert not np.array_equal(batch, TokenData(prepared[0], seed=4).batch(5, batch_size=4, seq_len=16))


def _windows(tokens, length):
    return np.lib.stride_tricks.sliding_window_view(np.asarray(tokens, np.int32), length)


def _is_window_of(row, tokens) -> bool:
    return bool((_windows(tokens, len(row)) == row).all(axis=1).any())


def test_training_rows_are_windows_of_the_train_split(data):
    batch = data.batch(0, batch_size=8, seq_len=16)
    assert all(_is_window_of(row, data.train) for row in batch)


def test_validation_batches_are_windows_of_the_validation_split_only(data):
    batch = data.validation_batch(0, batch_size=8, seq_len=16)
    assert batch.shape == (8, 17) and batch.dtype == np.int32
    assert all(_is_window_of(row, data.validation) for row in batch)
    np.testing.assert_array_equal(batch, data.validation_batch(0, batch_size=8, seq_len=16))
    assert not np.array_equal(batch, data.validation_batch(1, batch_size=8, seq_len=16))


ROWS = [slice(0, 1), slice(2, 5), slice(5, None), slice(None, None, 2), slice(6, 1, -2), slice(-3, None), slice(3, 3)]


def _sources(data):
    return {"tokens": data, "corpus": Corpus(vocab=32, seed=2)}


@pytest.mark.parametrize("source", ["tokens", "corpus"])
@pytest.mark.parametrize("rows", ROWS, ids=str)
def test_rows_are_the_whole_batchs_rows(data, source, rows):
    source = _sources(data)[source]
    for draw in (source.batch, source.validation_batch):
        whole = draw(7, batch_size=8, seq_len=12)
        part = draw(7, batch_size=8, seq_len=12, rows=rows)
        assert part.dtype == np.int32
        np.testing.assert_array_equal(part, whole[rows])


def _markov_batch_before_rows(corpus, step, batch_size, seq_len):
    """Corpus.batch as it was before rows= (the oracle: resumed runs depend on its bits)."""
    succ, w = corpus.table
    rng = np.random.default_rng((corpus.seed, step))
    out = np.empty((batch_size, seq_len + 1), np.int64)
    out[:, 0] = rng.integers(0, corpus.vocab, batch_size)
    cum = np.cumsum(w, axis=1)
    u = rng.random((batch_size, seq_len))
    for t in range(seq_len):
        prev = out[:, t]
        pick = np.minimum((u[:, t, None] > cum[prev]).sum(axis=1), corpus.branching - 1)
        out[:, t + 1] = succ[prev, pick]
    return out.astype(np.int32)


@pytest.mark.parametrize("vocab, seed, step, batch_size, seq_len", [(64, 0, 0, 8, 32), (32, 1, 5, 4, 8),
                                                                    (300, 7, 2**40, 5, 17)])
def test_the_corpus_batches_are_the_same_bits_as_before_rows(vocab, seed, step, batch_size, seq_len):
    corpus = Corpus(vocab=vocab, seed=seed)
    np.testing.assert_array_equal(corpus.batch(step, batch_size=batch_size, seq_len=seq_len),
                                  _markov_batch_before_rows(corpus, step, batch_size, seq_len))


def test_the_corpus_whole_batch_is_its_row_blocks_joined():
    corpus = Corpus(vocab=64, seed=0)
    whole = corpus.batch(3, batch_size=8, seq_len=32)
    blocks = [corpus.batch(3, batch_size=8, seq_len=32, rows=slice(r, r + 2)) for r in range(0, 8, 2)]
    np.testing.assert_array_equal(whole, np.concatenate(blocks))


def test_the_default_corpus_takes_any_vocabulary_a_model_has():
    """Three successors per token, or every token of a vocabulary of two: fit's default data
    for a vocab=2 model (it refused "branching=3 is more than 2")."""
    assert Corpus(vocab=64).branching == 3 and Corpus(vocab=2).branching == 2
    tokens = Corpus(vocab=2).batch(0, batch_size=4, seq_len=8)
    assert tokens.shape == (4, 9) and set(np.unique(tokens)) <= {0, 1}


def test_corpus_validation_batches_are_held_out_and_follow_the_chain():
    corpus = Corpus(vocab=32, seed=1)
    held_out = corpus.validation_batch(5, batch_size=16, seq_len=8)
    np.testing.assert_array_equal(held_out, Corpus(vocab=32, seed=1).validation_batch(5, batch_size=16, seq_len=8))
    assert not np.array_equal(held_out, corpus.batch(5, batch_size=16, seq_len=8))
    assert not np.array_equal(held_out, corpus.validation_batch(6, batch_size=16, seq_len=8))
    successors = corpus.table[0]
    assert all(held_out[r, t + 1] in successors[held_out[r, t]] for r in range(16) for t in range(8))


def test_a_saved_tokenizer_gives_the_same_tokens(prepared, data, tmp_path):
    directory, meta, texts = prepared
    (tmp_path / "second.txt").write_text(SECOND)
    again = text.prepare([tmp_path / "second.txt"], tmp_path / "out", tokenizer=directory / "tokenizer.json",
                         validation=0)
    assert again["vocab_size"] == meta["vocab_size"] and again["validation_tokens"] == 0
    reloaded = TokenData(tmp_path / "out")
    np.testing.assert_array_equal(reloaded.train, np.append(data.encode(SECOND), 0))


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    words = {"[UNK]": 0} | {f"w{i}": i + 1 for i in range(70_000)}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w1 w69999 w3 w70001 " * 10)
    meta = text.prepare([tmp_path / "a.txt"], tmp_path / "out", tokenizer=tmp_path / "big.json", validation=0.5)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001 and meta["end_of_text"] is None
    data = TokenData(tmp_path / "out")
    assert data.train.dtype == np.uint32 and data.train[:4].tolist() == [2, 70_000, 4, 0]
    assert data.batch(0, batch_size=2, seq_len=4).max() == 70_000


def test_check_vocab_refuses_a_model_vocabulary_smaller_than_the_datas(data):
    text.check_vocab(data, data.vocab)
    with pytest.raises(ConfigError, match=rf"the data's vocabulary \(V={data.vocab}\) is larger than the model's "
                                          rf"vocab=64: use vocab={data.vocab} or more"):
        text.check_vocab(data, 64)


def _bad_prepare(tmp_path, **overrides):
    good = tmp_path / "good.txt"
    good.write_text("some text\n" * 50)
    kwargs = {"files": [good], "out": tmp_path / "out"} | overrides
    files, out = kwargs.pop("files"), kwargs.pop("out")
    return lambda: text.prepare(files, out, **kwargs)


def _write(tmp_path, name, content: bytes):
    (tmp_path / name).write_bytes(content)
    return tmp_path / name


BAD_PREPARES = {
    "no files": (lambda tmp: {"files": []}, r"files=\[\]: give the paths of one or more UTF-8 text files"),
    "missing file": (lambda tmp: {"files": [tmp / "nope.txt"]}, r"nope.txt' does not exist"),
    "a directory": (lambda tmp: {"files": [tmp]}, r"is not a regular file"),
    "not UTF-8": (lambda tmp: {"files": [_write(tmp, "latin.txt", "café".encode("latin-1"))]}, r"is not UTF-8"),
    "empty text": (lambda tmp: {"files": [_write(tmp, "empty.txt", b"")]}, r"hold no text"),
    "vocab too small": (lambda tmp: {"vocab_size": 256}, r"vocab_size=256: need at least 257"),
    "vocab too large": (lambda tmp: {"vocab_size": 1 << 21}, r"vocab_size=2097152 is more than 1,048,576"),
    "vocab not an int": (lambda tmp: {"vocab_size": 512.0}, r"vocab_size=512.0 is a float"),
    "missing tokenizer": (lambda tmp: {"tokenizer": tmp / "none.json"}, r"none.json' is not a file"),
    "not a tokenizer": (lambda tmp: {"tokenizer": _write(tmp, "bad.json", b"{}")},
                        r"is not a `tokenizers` JSON file"),
    "validation 1": (lambda tmp: {"validation": 1.0}, r"validation=1.0: .* 0 <= validation < 1"),
    "validation < 0": (lambda tmp: {"validation": -0.1}, r"validation=-0.1"),
    "all validation": (lambda tmp: {"files": [_write(tmp, "tiny.txt", b"a")], "validation": 0.9},
                       r"validation=0.9: the text is only 2 tokens"),
    "negative seed": (lambda tmp: {"seed": -1}, r"seed=-1: need at least 0"),
    "out in a missing folder": (lambda tmp: {"out": tmp / "no" / "such"}, r"out="),
}


@pytest.mark.parametrize("case", BAD_PREPARES)
def test_bad_prepares_are_refused_before_writing(tmp_path, case):
    overrides, match = BAD_PREPARES[case]
    with pytest.raises(ConfigError, match=match):
        _bad_prepare(tmp_path, **overrides(tmp_path))()
    assert not (tmp_path / "out").exists()


def _damaged(directory, tmp):
    for name in os.listdir(directory):
        (tmp / name).write_bytes((directory / name).read_bytes())
    (tmp / "train.bin").write_bytes((directory / "train.bin").read_bytes()[:-2])
    return tmp


def _meta(directory, tmp, **changes):
    """A copy of the data directory with meta.json's fields changed."""
    for name in os.listdir(directory):
        (tmp / name).write_bytes((directory / name).read_bytes())
    meta = json.loads((directory / "meta.json").read_text())
    (tmp / "meta.json").write_text(json.dumps({**meta, **changes}))
    return tmp


BAD_DATA = {
    # meta.json naming another dtype of the same size read the uint16 tokens as float16 (all 0)
    **{f"meta {key} {value!r}": (lambda d, tmp, key=key, value=value: TokenData(_meta(d, tmp, **{key: value})),
                                 rf"meta.json': {key} {re.escape(repr(value))} is not .* the directory is damaged")
       for key, value in (("dtype", "float16"), ("dtype", "int64"), ("vocab_size", 0), ("vocab_size", 1),
                          ("vocab_size", 10**12), ("vocab_size", 70000), ("vocab_size", 2.5), ("seed", -1),
                          ("seed", 1.5), ("train_tokens", "9"))},
    "missing directory": (lambda d, tmp: TokenData(tmp / "nope"), r"does not exist or is not a directory: run "
                                                                  r"`jaxpar data prepare"),
    "directory without tokens": (lambda d, tmp: TokenData(tmp), r"a data directory without tokens \(no meta.json, "
                                                                r"train.bin, val.bin, tokenizer.json\): run `jaxpar "
                                                                r"data prepare TEXT_FILES"),
    "truncated train.bin": (lambda d, tmp: TokenData(_damaged(d, tmp)), r"train.bin' has .* the directory is "
                                                                        r"damaged"),
    "seq_len longer than the split": (lambda d, tmp: TokenData(d).validation_batch(0, batch_size=2, seq_len=10**6),
                                      r"seq_len=1000000: the validation split of .* fewer than seq_len \+ 1 = "
                                      r"1000001: use seq_len=\d+ or less"),
    "rows not a slice": (lambda d, tmp: TokenData(d).batch(0, batch_size=4, seq_len=8, rows=[0, 1]),
                         r"rows=\[0, 1\] is a list, not a slice"),
    "negative step": (lambda d, tmp: TokenData(d).batch(-1, batch_size=4, seq_len=8), r"step=-1: need at least 0"),
    "bad ids": (lambda d, tmp: TokenData(d).decode([1, 10**6]), r"ids hold values outside 0\.\."),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_data_requests_are_refused(prepared, tmp_path, case):
    request, match = BAD_DATA[case]
    with pytest.raises(ConfigError, match=match):
        request(prepared[0], tmp_path)


def test_no_validation_split_refuses_validation_batches(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    text.prepare([tmp_path / "a.txt"], tmp_path / "out", vocab_size=300, validation=0)
    data = TokenData(tmp_path / "out")
    assert data.batch(0, batch_size=2, seq_len=8).shape == (2, 9)
    with pytest.raises(ConfigError, match=r"the validation split of .* has 0 tokens, .*: prepare more text or a "
                                          r"larger validation fraction"):
        data.validation_batch(0, batch_size=2, seq_len=8)
