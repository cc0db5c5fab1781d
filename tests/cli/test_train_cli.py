"""`jaxpar train`: a short run's summary, its JSON, and one-line errors before compiling."""

import json
import shutil

import pytest

from jaxpar.cli.main import main as cli_main

SMALL = ["--d-model", "16", "--heads", "4", "--kv-heads", "2", "--ffn", "32", "--vocab", "32", "--seq", "8",
         "--devices", "8", "--quiet"]


def run(capsys, *argv):
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_short_run_ends_with_its_summary(capsys, tmp_path):
    code, out, err = run(capsys, "train", "--mesh", "dp=2,pp=2,tp=2", "--steps", "4", "--out", str(tmp_path), *SMALL)
    assert code == 0, err
    assert "trained dp2 x pp2 x tp2 1f1b for 4 steps" in out and "tokens/s" in out
    assert "memory per device (compiled)" in out and "collectives = the formulas" in out
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_json_summary_with_zero1_and_a_resumed_checkpoint(capsys, tmp_path):
    args = ["train", "--mesh", "dp=4,tp=2", "--zero", "1", "--sp", "--steps", "4", "--checkpoint", str(tmp_path / "c"),
            "--every", "2", "--out", str(tmp_path), "--json", *SMALL]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    data = json.loads(out)
    assert data["collectives_match"] and data["steps"] == 4 and data["collectives"]["expected_zero"]["all-gather"] > 0
    shutil.rmtree(tmp_path / "c" / "4")          # as if killed after step 2's save: resumes there
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert json.loads(out)["steps"] == 2


@pytest.mark.parametrize("argv,piece", [
    (["--mesh", "dp=3,tp=2"], "batch"),
    (["--mesh", "pp=3"], "--layers 4"),
    (["--mesh", "tp=3"], "problems"),
    (["--mesh", "xp=2"], "--mesh"),
    (["--mesh", "dp=2", "--schedule", "nope"], "schedule"),
    (["--mesh", "dp=2", "--zero", "3"], "zero"),
    (["--mesh", "ep=2"], "dense"),
])
def test_bad_input_is_one_line(capsys, argv, piece):
    code, out, err = run(capsys, "train", "--steps", "2", *argv, *SMALL[:-1], "--layers", "4", "--batch", "4")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error:") and piece in err, err
