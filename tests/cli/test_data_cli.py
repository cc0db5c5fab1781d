"""`jaxpar data prepare`: one summary line (or meta.json's contents), one-line errors."""

import json

import pydoc_data.topics
import pytest

from jaxpar.cli.main import main as cli_main
from jaxpar.train.text import TokenData

TEXT = "\n\n".join(list(pydoc_data.topics.topics.values())[:10])


def run(capsys, *argv):
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "topics.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_prepare_prints_one_summary_and_writes_the_directory(capsys, tmp_path, text_file):
    out_dir = tmp_path / "data"
    code, out, err = run(capsys, "data", "prepare", str(text_file), "--out", str(out_dir), "--vocab-size", "300")
    assert code == 0, err
    data = TokenData(out_dir)
    assert out == (f"prepared {out_dir}: {len(data.train):,} train and {len(data.validation):,} validation tokens "
                   f"(uint16), vocab {data.vocab}, from 1 file(s)\n")
    code, out, err = run(capsys, "data", "prepare", str(text_file), "--out", str(tmp_path / "again"), "--tokenizer",
                         str(out_dir / "tokenizer.json"), "--validation", "0.1", "--seed", "7", "--json")
    assert code == 0, err
    meta = json.loads(out)
    assert meta["vocab_size"] == data.vocab and meta["seed"] == 7 and meta["validation_fraction"] == 0.1
    assert meta["tokenizer"] == str(out_dir / "tokenizer.json")


@pytest.mark.parametrize("argv, words", [
    (["MISSING", "--out", "OUT"], ["text file '", "missing.txt' does not exist"]),
    (["TEXT", "--out", "OUT", "--vocab-size", "100"], ["--vocab-size 100: need at least 257"]),
    (["TEXT", "--out", "OUT", "--validation", "1"], ["--validation 1.0:"]),
    (["TEXT", "--out", "OUT", "--tokenizer", "MISSING"], ["--tokenizer '", "missing.txt' is not a file"]),
    (["TEXT", "--out", "NOFOLDER"], ["--out "]),
])
def test_bad_prepares_are_one_line_with_exit_2(capsys, tmp_path, text_file, argv, words):
    paths = {"MISSING": str(tmp_path / "missing.txt"), "TEXT": str(text_file), "OUT": str(tmp_path / "out"),
             "NOFOLDER": str(tmp_path / "no" / "out")}
    code, out, err = run(capsys, "data", "prepare", *[paths.get(a, a) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar data: error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    assert not (tmp_path / "out").exists()
