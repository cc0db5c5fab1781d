"""Real text as training data: a byte-level BPE tokenizer and token files, memory-mapped.

    jaxpar data prepare book.txt notes.txt --out data --vocab-size 512     # or text.prepare(...)
    data = TokenData("data")
    data.batch(step, batch_size=8, seq_len=64)              # int32[8, 65], windows of the train split
    data.validation_batch(0, batch_size=8, seq_len=64)      # int32[8, 65], windows of the validation split
    data.decode(data.encode("Hello"))                       # "Hello"

A data directory holds
    train.bin        the train split's tokens, one flat array (uint16 for a vocabulary of
                     at most 65,536 tokens, else uint32), read back with np.memmap
    val.bin          the validation split's tokens, the same way
    tokenizer.json   the Hugging Face `tokenizers` tokenizer that made them
    meta.json        vocab_size, dtype, train_tokens, validation_tokens, files,
                     validation_fraction, seed, end_of_text (written last: a
                     directory without it holds no finished tokens)

The token stream is the files in the order given, each followed by the end-of-text token
`<|endoftext|>`. The validation split is the stream's tail: its last
ceil(validation x tokens) tokens (a document may be cut where the tail starts), the train
split everything before. Batch i is a function of (seed, i) only: its rows are windows of
seq_len + 1 tokens at starts drawn from `data.training_rng(seed, i)`, so a run resumed at
step i sees the batches the uninterrupted run saw. Validation batch k draws its starts
from `data.validation_rng(seed, k)` over the validation split. `rows=` computes only
those rows (a process of a multi-process job loads only its own), equal to the whole
batch's rows. The interface is `data.Corpus`'s, so the training loop takes either.
"""

from __future__ import annotations

import functools
import json
import math
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxpar import errors
from jaxpar.train.data import row_indices, training_rng, validation_rng

END_OF_TEXT = "<|endoftext|>"
MIN_VOCAB = 257          # the 256 byte tokens of a byte-level BPE and the end-of-text token
MAX_VOCAB = 1 << 20      # a million tokens: beyond every published LLM vocabulary
LINES_PER_ENCODE = 4096  # lines handed to the tokenizer at once: bounded memory on any file size
PREPARE = "run `jaxpar data prepare TEXT_FILES... --out DIR` (or jaxpar.train.text.prepare) to make one"


def prepare(files, out, *, vocab_size: int = 512, tokenizer=None, validation: float = 0.05, seed: int = 0) -> dict:
    """Tokenize the UTF-8 text `files` into the data directory `out` (module docstring).

    The tokenizer is a byte-level BPE trained on the files with `vocab_size` tokens at
    most (fewer when the text has fewer distinct merges), or, with `tokenizer=` the path
    of a saved `tokenizers` JSON file, that one (`vocab_size` unused). The validation
    split is the stream's last `validation` fraction of tokens (0 <= validation < 1);
    `seed` is the batches' seed, kept in meta.json. The folder above `out` must exist.
    Every argument and every file is checked before any is read. Returns meta.json's dict."""
    paths = _text_files(files)
    out = errors.writable_path("out", out, directory=True)
    validation = _fraction(validation)
    seed = errors.whole("seed", seed, minimum=0, maximum=(1 << 63) - 1)
    if tokenizer is None:
        errors.whole("vocab_size", vocab_size, minimum=MIN_VOCAB, maximum=MAX_VOCAB,
                     fix=f"use vocab_size={MIN_VOCAB} to {MAX_VOCAB:,} (256 byte tokens and end-of-text at least)")
    else:
        tokenizer = os.path.abspath(_tokenizer_path(tokenizer))
    tok = _load_tokenizer(tokenizer) if tokenizer is not None else None
    texts = [_read_text(path) for path in paths]
    if not any(texts):
        raise errors.ConfigError(f"files={paths!r} hold no text (every file is empty): give files with text")
    if tok is None:
        tok = _train_tokenizer(texts, vocab_size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > MAX_VOCAB:
        raise errors.ConfigError(f"tokenizer={tokenizer!r} has {vocab:,} tokens, more than {MAX_VOCAB:,}: "
                                 "give a tokenizer with a smaller vocabulary")
    end_of_text = tok.token_to_id(END_OF_TEXT)
    stream = np.concatenate([_encode_document(tok, text, end_of_text) for text in texts])
    n_validation = math.ceil(validation * len(stream))
    if n_validation >= len(stream):
        raise errors.ConfigError(f"validation={validation}: the text is only {len(stream)} tokens, all of them "
                                 "would be validation: give more text or a smaller validation fraction")
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    meta = {"vocab_size": vocab, "dtype": dtype.name, "train_tokens": len(stream) - n_validation,
            "validation_tokens": n_validation, "files": paths, "validation_fraction": validation, "seed": seed,
            "end_of_text": end_of_text,
            "tokenizer": tokenizer or f"byte-level BPE trained on the files, vocab_size={vocab_size}"}
    _write(out, stream.astype(dtype), n_validation, tok, meta)
    return meta


class TokenData:
    """A prepared data directory (`prepare`), memory-mapped: opening it reads meta.json
    only. `vocab`: the tokenizer's size (every token id is below it); `train` and
    `validation`: the splits' tokens, uint16[n] or uint32[n] memmaps; `seed`: the
    batches' seed (meta.json's unless given)."""

    def __init__(self, path, *, seed: int | None = None):
        self.path = _data_directory(path)
        self.meta = _read_meta(self.path)
        self.vocab = int(self.meta["vocab_size"])
        self.seed = self.meta["seed"] if seed is None else errors.whole("seed", seed, minimum=0,
                                                                         maximum=(1 << 63) - 1)
        dtype = np.dtype(self.meta["dtype"])
        self.train = _memmap(self.path, "train.bin", dtype, self.meta["train_tokens"])
        self.validation = _memmap(self.path, "val.bin", dtype, self.meta["validation_tokens"])

    @classmethod
    def open(cls, path, *, seed: int | None = None) -> TokenData:
        return cls(path, seed=seed)

    def __repr__(self) -> str:
        return (f"TokenData({self.path!r}: vocab {self.vocab}, {len(self.train):,} train and "
                f"{len(self.validation):,} validation tokens, seed {self.seed})")

    def fingerprint(self) -> dict:
        """What a checkpoint records of the data, which a resumed run must match (not its
        path: a directory may move)."""
        return {"kind": "tokens", "vocab": self.vocab, "train_tokens": len(self.train),
                "validation_tokens": len(self.validation), "seed": self.seed}

    def batch(self, step: int, *, batch_size: int, seq_len: int, rows: slice | None = None) -> np.ndarray:
        """int32[batch_size, seq_len + 1] (or only `rows` of it): windows of the train
        split at starts drawn from (seed, step), the same for the same (seed, step)."""
        errors.whole("step", step, minimum=0, maximum=1 << 62)
        return self._windows(self.train, "train", training_rng(self.seed, step), batch_size, seq_len, rows)

    def validation_batch(self, k: int, *, batch_size: int, seq_len: int, rows: slice | None = None) -> np.ndarray:
        """int32[batch_size, seq_len + 1] (or only `rows` of it): the k-th set of windows
        of the validation split, at starts drawn from (seed, k) on the validation stream."""
        errors.whole("k", k, minimum=0, maximum=1 << 62)
        return self._windows(self.validation, "validation", validation_rng(self.seed, k), batch_size, seq_len,
                             rows)

    def _windows(self, tokens: np.ndarray, split: str, rng: np.random.Generator, batch_size: int, seq_len: int,
                 rows: slice | None) -> np.ndarray:
        """The `rows` of a batch of `batch_size` windows of `tokens`: all starts drawn,
        only the picked rows' windows read."""
        errors.whole("batch_size", batch_size, maximum=1 << 24)
        errors.whole("seq_len", seq_len, maximum=1 << 24)
        picked = row_indices(rows, batch_size)
        if len(tokens) < seq_len + 1:
            more = "prepare more text" + (" or a larger validation fraction" if split == "validation" else "")
            raise errors.ConfigError(
                f"seq_len={seq_len}: the {split} split of {self.path} has {len(tokens):,} tokens, fewer than "
                f"seq_len + 1 = {seq_len + 1}: " + (f"use seq_len={len(tokens) - 1} or less, or {more}"
                                                   if len(tokens) >= 2 else more))
        starts = rng.integers(0, len(tokens) - seq_len, batch_size)[picked]
        return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int32)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(os.path.join(self.path, "tokenizer.json"))

    def encode(self, text: str) -> np.ndarray:
        """int32[n]: the token ids of `text` (no end-of-text token added)."""
        if not isinstance(text, str):
            raise errors.ConfigError(f"text is a {type(text).__name__}, not a str: give the text to encode")
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        """The text of token ids (any int array or sequence, flattened); end-of-text kept."""
        ids = np.asarray(ids).ravel()
        if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.vocab):
            raise errors.ConfigError(f"ids hold values outside 0..{self.vocab - 1} (dtype {ids.dtype}): give "
                                     "token ids of this data's tokenizer")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def check_vocab(data, vocab: int) -> None:
    """Refuse a model vocabulary smaller than the data's (`data.vocab`): a token id >= the
    model's vocab has no embedding row."""
    if data.vocab > vocab:
        raise errors.ConfigError(f"the data's vocabulary (V={data.vocab}) is larger than the model's vocab={vocab}: "
                                 f"use vocab={data.vocab} or more")


def _text_files(files) -> list[str]:
    """The absolute paths of `files` (one path or a list) if each is a readable file."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not isinstance(files, (list, tuple)) or not files:
        raise errors.ConfigError(f"files={files!r}: give the paths of one or more UTF-8 text files")
    paths = []
    for file in files:
        if not isinstance(file, (str, os.PathLike)) or not os.fspath(file):
            raise errors.ConfigError(f"files holds {file!r}, not a path: give the paths of UTF-8 text files")
        path = os.path.abspath(os.fspath(file))
        if not os.path.exists(path):
            raise errors.ConfigError(f"text file {path!r} does not exist: give the path of a UTF-8 text file")
        if not os.path.isfile(path):
            raise errors.ConfigError(f"text file {path!r} is not a regular file: give the path of a UTF-8 text "
                                     "file (a directory's files one by one)")
        if not os.access(path, os.R_OK):
            raise errors.ConfigError(f"text file {path!r} is not readable by this user: fix its permissions")
        paths.append(path)
    return paths


def _fraction(validation) -> float:
    if isinstance(validation, bool) or not isinstance(validation, (int, float)) or not 0 <= validation < 1:
        raise errors.ConfigError(f"validation={validation!r}: the validation split is a fraction of the tokens, "
                                 "0 <= validation < 1; use e.g. validation=0.05 (0: no validation split)")
    return float(validation)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except UnicodeDecodeError as e:
        raise errors.ConfigError(f"text file {path!r} is not UTF-8 (byte {e.start}: {e.reason}): convert it, "
                                 f"e.g. iconv -t UTF-8") from None
    except OSError as e:
        raise errors.ConfigError(f"text file {path!r} cannot be read ({e.strerror}): fix the path or its "
                                 "permissions") from None


def _lines(texts: list[str]):
    for text in texts:
        yield from text.splitlines(keepends=True)


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's: every byte is a token, so any text encodes) trained on
    the texts' lines, with the end-of-text token (id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_lines(texts), trainer=trainer)
    return tok


def _tokenizer_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        shown = os.fspath(path) if isinstance(path, os.PathLike) else path
        raise errors.ConfigError(f"tokenizer={shown!r} is not a file: give the path of a saved `tokenizers` JSON "
                                 "file (a data directory's tokenizer.json), or none to train one")
    return os.fspath(path)


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as e:   # the Rust library's own error types: any failure means not a tokenizer file
        raise errors.ConfigError(f"tokenizer={path!r} is not a `tokenizers` JSON file ({e}): give the path of one "
                                 "(a data directory's tokenizer.json), or none to train one") from None


def _encode_document(tok: Tokenizer, text: str, end_of_text: int | None) -> np.ndarray:
    """int64[n]: `text`'s tokens, line by line, then end-of-text (when the tokenizer has it)."""
    lines = text.splitlines(keepends=True)
    pieces = [np.zeros(0, np.int64)]
    for first in range(0, len(lines), LINES_PER_ENCODE):
        encoded = tok.encode_batch(lines[first:first + LINES_PER_ENCODE], add_special_tokens=False)
        pieces.extend(np.asarray(e.ids, np.int64) for e in encoded)
    if end_of_text is not None:
        pieces.append(np.array([end_of_text], np.int64))
    return np.concatenate(pieces)


def _write(out: str, stream: np.ndarray, n_validation: int, tok: Tokenizer, meta: dict) -> None:
    """The four files, meta.json last: each written to a temporary name, then renamed."""
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)       # until the new one is written, the directory reads as unfinished
    split = len(stream) - n_validation
    stream[:split].tofile(os.path.join(out, "train.bin.tmp"))
    stream[split:].tofile(os.path.join(out, "val.bin.tmp"))
    tok.save(os.path.join(out, "tokenizer.json.tmp"))
    with open(meta_path + ".tmp", "w") as file:
        json.dump(meta, file, indent=1)
    for name in ("train.bin", "val.bin", "tokenizer.json", "meta.json"):
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def _data_directory(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise errors.ConfigError(f"path={path!r}: give the path of a data directory; {PREPARE}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise errors.ConfigError(f"data directory {path!r} does not exist or is not a directory: {PREPARE}")
    missing = [name for name in ("meta.json", "train.bin", "val.bin", "tokenizer.json")
               if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise errors.ConfigError(f"{path!r} is a data directory without tokens (no {', '.join(missing)}): {PREPARE}")
    return path


TOKEN_DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}     # the token files' types, and the ids each holds


def _read_meta(path: str) -> dict:
    """meta.json's dict, refused (naming the file) unless every field the reader uses is
    there and of its kind: dtype uint16 or uint32, vocab_size whole in 2 .. what the dtype
    holds (and MAX_VOCAB), token counts and seed whole and >= 0."""
    file = os.path.join(path, "meta.json")
    try:
        with open(file) as f:
            meta = json.load(f)
        missing = [key for key in ("dtype", "vocab_size", "train_tokens", "validation_tokens", "seed")
                   if key not in meta]
    except (OSError, ValueError, TypeError) as e:
        raise errors.ConfigError(f"{file!r} cannot be read ({type(e).__name__}: {e}): {PREPARE} again") from None
    if missing:
        raise errors.ConfigError(f"{file!r} has no {', '.join(missing)}: the directory is damaged; {PREPARE} again")
    wrong = [] if meta["dtype"] in TOKEN_DTYPES else [f"dtype {meta['dtype']!r} is not uint16 or uint32"]
    top = min(TOKEN_DTYPES.get(meta["dtype"], MAX_VOCAB), MAX_VOCAB)
    vocab = meta["vocab_size"]
    if not errors.is_whole(vocab) or not 2 <= vocab <= top:
        wrong.append(f"vocab_size {vocab!r} is not a whole number in 2 .. {top:,}")
    wrong += [f"{key} {meta[key]!r} is not a whole number >= 0" for key in ("train_tokens", "validation_tokens", "seed")
              if not errors.is_whole(meta[key]) or not 0 <= meta[key] < 1 << 63]
    if wrong:
        raise errors.ConfigError(f"{file!r}: {'; '.join(wrong)}: the directory is damaged; {PREPARE} again")
    return meta


def _memmap(path: str, name: str, dtype: np.dtype, count: int) -> np.ndarray:
    """The tokens of `name`, memory-mapped (nothing read until indexed), if the file holds
    exactly `count` of them."""
    file = os.path.join(path, name)
    size = os.path.getsize(file)
    if size != count * dtype.itemsize:
        raise errors.ConfigError(f"{file!r} has {size:,} bytes, but meta.json says {count:,} {dtype.name} tokens "
                                 f"({count * dtype.itemsize:,} bytes): the directory is damaged; {PREPARE} again")
    if count == 0:
        return np.zeros(0, dtype)     # mmap refuses an empty file
    return np.memmap(file, dtype=dtype, mode="r", shape=(count,))
