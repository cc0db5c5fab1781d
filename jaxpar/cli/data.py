"""`jaxpar data prepare`: text files tokenized into a data directory for `jaxpar train`.

    jaxpar data prepare book.txt notes.txt --out data --vocab-size 512
    jaxpar data prepare more.txt --out data2 --tokenizer data/tokenizer.json --validation 0.1 --json

Trains a byte-level BPE on the files (or loads `--tokenizer`), tokenizes them and writes
train.bin, val.bin, tokenizer.json and meta.json into `--out` (`jaxpar.train.text`);
prints one summary line, or meta.json's contents with `--json`. Never starts JAX.
"""

from __future__ import annotations

import argparse
import json

FLAGS = {"files": "TEXT_FILES", "out": "--out", "vocab_size": "--vocab-size", "tokenizer": "--tokenizer",
         "validation": "--validation", "seed": "--seed"}
HELP = "prepare real text for training: a byte-level BPE tokenizer and token files (`prepare`)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    prepare = actions.add_parser("prepare", help="tokenize text files into a data directory",
                                 description="tokenize text files into a data directory (train.bin, val.bin, "
                                             "tokenizer.json, meta.json)")
    prepare.add_argument("files", nargs="+", metavar="TEXT_FILES", help="UTF-8 text files, one document each")
    prepare.add_argument("--out", required=True, help="the data directory to write (its folder must exist)")
    prepare.add_argument("--vocab-size", type=int, default=512, help="tokens of the BPE to train (default 512)")
    prepare.add_argument("--tokenizer", default=None,
                         help="a saved tokenizers JSON file to use instead of training one")
    prepare.add_argument("--validation", type=float, default=0.05,
                         help="the stream's tail fraction held out for validation (default 0.05)")
    prepare.add_argument("--seed", type=int, default=0, help="the batches' seed, kept in meta.json (default 0)")
    prepare.add_argument("--json", action="store_true", help="print meta.json's contents")


def main(args) -> int:
    from jaxpar.train import text

    meta = text.prepare(args.files, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
                        validation=args.validation, seed=args.seed)
    if args.json:
        print(json.dumps(meta | {"out": args.out}, indent=1))
    else:
        print(f"prepared {args.out}: {meta['train_tokens']:,} train and {meta['validation_tokens']:,} validation "
              f"tokens ({meta['dtype']}), vocab {meta['vocab_size']}, from {len(meta['files'])} file(s)")
    return 0
