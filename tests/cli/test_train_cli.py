"""`jaxpar train`: a short run's summary, its JSON and log, and one-line errors before compiling."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

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


# one request, so the in-process runs below share one compiled step (Trainer's cache)
ZERO1 = ["train", "--mesh", "dp=4,tp=2", "--zero", "1", "--sp", "--steps", "3", *SMALL]


def test_json_history_log_last_step_saved_and_resumed_with_zero1(capsys, tmp_path):
    log = tmp_path / "steps.jsonl"
    args = [*ZERO1, "--checkpoint", str(tmp_path / "c"), "--every", "2", "--log", str(log), "--out", str(tmp_path),
            "--json"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    data = json.loads(out)
    assert data["collectives_match"] and data["steps"] == 3 and data["collectives"]["expected_zero"]["all-gather"] > 0
    assert [r["step"] for r in data["history"]] == [0, 1, 2] and data["resumed_from"] is None
    assert set(data["history"][0]) == {"step", "loss", "grad_norm", "lr", "seconds"}
    assert data["history"][-1]["loss"] == data["last_loss"] and data["history"][0]["lr"] < data["history"][1]["lr"]
    assert [json.loads(line) for line in log.read_text().splitlines()] == data["history"]   # the same rows
    assert sorted(os.listdir(tmp_path / "c")) == ["2", "3"]      # step 3 is saved though --every 2
    shutil.rmtree(tmp_path / "c" / "3")          # as if killed after step 2's save: resumes there
    code, out, err = run(capsys, *args)
    assert code == 0, err
    data = json.loads(out)
    assert data["steps"] == 1 and data["resumed_from"] == 2 and [r["step"] for r in data["history"]] == [2]
    assert json.loads(log.read_text().splitlines()[-1]) == data["history"][0]
    code, out, err = run(capsys, *[a for a in args if a != "--json"])     # at step 3 of 3: nothing to train
    assert code == 0 and out == "nothing to train: the checkpoint is at step 3 of --steps 3\n", err


def _jaxpar(*argv, timeout=120):
    """`python -m jaxpar` in its own process: (exit code, stderr). A process that does not
    exit (orbax's threads waiting out their 300 s coordination timeout) fails the test at
    `timeout`: a guard against a hang, not a bound on speed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "jaxpar", *argv], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stderr


def test_a_bad_checkpoint_directory_exits_at_once_in_one_line(tmp_path):
    """A regular file as --checkpoint is refused before JAX starts (it used to fail in
    orbax's first save, whose threads then kept the process alive); a step that cannot be
    restored fails once the checkpoints are open, and the process still exits."""
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "c" / "5").mkdir(parents=True)           # a step directory without a record
    base = ["train", "--mesh", "dp=2", "--steps", "8", *SMALL, "--devices", "2"]
    code, err = _jaxpar(*base, "--checkpoint", str(tmp_path / "file"))
    assert code == 2, (code, err)
    assert err == f"jaxpar train: error: --checkpoint '{tmp_path / 'file'}' is a file, not a directory: give the " \
                  "path of a directory\n"
    code, err = _jaxpar(*base, "--checkpoint", str(tmp_path / "c"))
    assert code == 2, (code, err)
    assert err.startswith(f"jaxpar train: error: checkpoint {tmp_path / 'c' / '5'} is refused: its record cannot "
                          "be read") and err.endswith("; no other step can be resumed: use another checkpoint "
                                                      "directory\n") and err.count("\n") == 1, err


def test_ctrl_c_mid_run_is_one_line_and_closes_the_checkpoints_after_their_save(capsys, tmp_path, monkeypatch, python_ctrl_c):
    from jaxpar.train.checkpoint import Checkpoints

    maybe_save = Checkpoints.maybe_save

    def then_ctrl_c(self, trainer, state, **record):
        started = maybe_save(self, trainer, state, **record)
        if started:
            signal.raise_signal(signal.SIGINT)     # a real SIGINT, while orbax may still write the step
        return started

    monkeypatch.setattr(Checkpoints, "maybe_save", then_ctrl_c)
    before = set(threading.enumerate())
    code, out, err = run(capsys, *ZERO1, "--checkpoint", str(tmp_path / "c"), "--every", "2", "--out", str(tmp_path))
    assert code == 130 and out == "" and err == "jaxpar train: interrupted\n", err
    assert os.listdir(tmp_path / "c") == ["2"]            # complete: no orbax-checkpoint-tmp left
    # orbax's threads end: none started by the run is left (each given up to 10 s to finish
    # winding down, e.g. an asyncio executor's workers after its loop closed)
    started = [t for t in threading.enumerate() if t not in before and not t.daemon]
    for t in started:
        t.join(timeout=10)
    assert not [t for t in started if t.is_alive()], started


@pytest.mark.parametrize("argv,piece", [
    (["--mesh", "dp=3,tp=2"], "batch"),
    (["--mesh", "pp=3"], "--layers 4"),
    (["--mesh", "tp=3"], "problems"),
    (["--mesh", "xp=2"], "--mesh"),
    (["--mesh", "dp=2", "--schedule", "nope"], "schedule"),
    (["--mesh", "dp=2", "--zero", "4"], "zero"),
    (["--mesh", "ep=2"], "dense"),
    (["--mesh", "dp=2", "--dtype", "float16"], "--dtype 'float16' is not one of float32, bfloat16"),
    (["--mesh", "dp=2", "--checkpoint", "/dev/null"], "--checkpoint '/dev/null' is a file, not a directory"),
    (["--mesh", "dp=2", "--checkpoint", "/dev/null/ckpt"], "lies under '/dev/null', a file"),
    (["--mesh", "dp=2", "--log", "/"], "--log '/' is a directory, not a file"),
    (["--mesh", "dp=2", "--log", "/no-such-jaxpar-dir/steps.jsonl"], "'/no-such-jaxpar-dir' does not exist"),
    (["--mesh", "dp=2", "--attention-kernel", "flash"], "--attention-kernel 'flash': use one of 'auto', 'xla', 'cudnn'"),
    # cuDNN where it cannot run: on this CPU run, the platform; on a GPU, float32 layers
    (["--mesh", "dp=2", "--attention-kernel", "cudnn"], "--attention-kernel 'cudnn' cannot run here"),
    # the Pallas kernel's tiles: head_dim 16/4 = 4 is under its 16, on every platform
    (["--mesh", "dp=2", "--attention-kernel", "pallas"],
     "--attention-kernel 'pallas' cannot run here: head_dim (--d-model / --heads) 4"),
])
def test_bad_input_is_one_line(capsys, argv, piece):
    code, out, err = run(capsys, "train", "--steps", "2", *argv, *SMALL[:-1], "--layers", "4", "--batch", "4")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error:") and piece in err, err


@pytest.mark.parametrize("argv,piece", [
    # refused, not rewritten: top_k was clamped to the experts, warmup to the steps, and each
    # head max(2, d_model // heads) wide whatever d_model was
    (["--experts", "4", "--top-k", "9"], "--top-k 9 with --experts 4: each token picks top_k distinct experts. "
                                         "Fix: --top-k 2, or --experts 9 or more"),
    (["--warmup", "1000"], "--warmup 1000 is longer than --steps 2"),
    (["--d-model", "65"], "--d-model 65 over --heads 4: each head takes an equal share"),
    (["--d-model", "24", "--heads", "8"], "Fix: a multiple of 2 x 8, e.g. --d-model 32"),
    (["--d-model", "4", "--heads", "8"], "--d-model 4 over --heads 8"),
    (["--heads", "0"], "--heads 0: need at least 1"),
    (["--d-model", "0"], "--d-model 0: need at least 1"),
    # values past float32's range would train to NaN
    (["--lr", "1e300"], "--lr 1e+300 is not finite in float32"),
    (["--experts", "4", "--aux-loss", "1e300"], "--aux-loss 1e+300 is not finite in float32"),
    (["--experts", "4", "--router", "sigmoid", "--bias-rate", "1e39"], "--bias-rate 1e+39 is not finite in float32"),
    # --out is checked before training, as --checkpoint and --log are (no missing tree made)
    (["--out", "/no-such-jaxpar-dir/a/b"], "--out '/no-such-jaxpar-dir/a/b': its folder '/no-such-jaxpar-dir/a' does "
                                           "not exist"),
    (["--out", "/dev/null"], "--out '/dev/null' is a file, not a directory"),
    (["--out", ""], "--out '': give the path of a directory"),
    # a stage split's example as the flag takes it
    (["--mesh", "pp=2", "--layers-per-stage", "1,2,3"], "e.g. --layers-per-stage 3,3 "),
    (["--mesh", "ep=2"], "Fix: --mesh ep 1, or --experts 2 or more"),
])
def test_model_flags_are_refused_as_given_in_one_line(capsys, argv, piece):
    code, out, err = run(capsys, "train", "--mesh", "dp=2", "--steps", "2", *SMALL, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error:") and piece in err, err
    assert not os.path.exists("/no-such-jaxpar-dir")


def test_a_run_whose_loss_is_not_finite_stops_there_in_one_line(capsys, tmp_path):
    """A learning rate float32 holds but training cannot (1e30): the weights go to NaN, and
    the run stops at the first non-finite loss with exit 1, naming the step and --lr."""
    code, out, err = run(capsys, "train", "--mesh", "dp=2", "--steps", "6", "--lr", "1e30", "--out", str(tmp_path),
                         *SMALL)
    assert code == 1 and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error: step ") and "the loss is nan" in err, err
    assert err.rstrip().endswith("give a lower learning rate, e.g. --lr 0.003 (now --lr 1e+30)"), err
    assert not (tmp_path / "loss.png").exists()


@pytest.mark.parametrize("argv,piece", [
    (["--processes", "2"], "--processes without --coordinator"),
    (["--process-id", "0"], "--process-id without --coordinator"),
    (["--coordinator", "localhost", "--processes", "2", "--process-id", "0"],
     "--coordinator 'localhost' is not HOST:PORT"),
    (["--coordinator", "h:99999", "--processes", "2", "--process-id", "0"], "is not HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--processes", "2", "--process-id", "2"], "ids run from 0 to 1"),
    (["--coordinator", "127.0.0.1:1234", "--processes", "2"], "needs --processes N and --process-id I"),
    (["--distributed", "auto", "--processes", "2"], "without --coordinator, --processes and --process-id"),
    (["--eval-every", "-1"], "--eval-every -1"),
    (["--data", "/no-such-jaxpar-data"], "does not exist"),
])
def test_bad_multiprocess_data_and_eval_flags_are_one_line(capsys, argv, piece):
    code, out, err = run(capsys, "train", "--mesh", "dp=2", "--steps", "2", *argv, *SMALL)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error:") and piece in err, err


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
    """A tokenized text directory (`jaxpar data prepare`): a 300-token BPE of some prose."""
    from jaxpar.train import text

    root = tmp_path_factory.mktemp("text")
    (root / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400 + "Pack my box with five "
                                "dozen liquor jugs. " * 200, encoding="utf-8")
    text.prepare([root / "a.txt"], root / "data", vocab_size=300, validation=0.1)
    return root / "data"


def test_data_refused_before_compiling(capsys, tmp_path, text_data):
    (tmp_path / "empty").mkdir()
    code, out, err = run(capsys, "train", "--mesh", "dp=2", "--steps", "2", "--data", str(tmp_path / "empty"), *SMALL)
    assert code == 2 and err.count("\n") == 1 and "without tokens" in err, err
    code, out, err = run(capsys, "train", "--mesh", "dp=2", "--steps", "2", "--data", str(text_data), *SMALL)
    assert code == 2 and err.count("\n") == 1 and "is larger than the model's --vocab 32" in err, err


def test_training_on_text_with_validation_and_a_profile(capsys, tmp_path, text_data):
    """--data: the model's vocabulary is the data's rounded up to a multiple of tp;
    validation every steps/10 steps by default (here every step) in the JSON rows and
    the log; --profile measures the share of op time in collectives."""
    from jaxpar.train.text import TokenData

    log = tmp_path / "steps.jsonl"
    small = [a for a in SMALL if a != "--quiet"]
    small = small[:small.index("--vocab")] + small[small.index("--vocab") + 2:]
    code, out, err = run(capsys, "train", "--mesh", "dp=2,pp=2,tp=2", "--steps", "4", "--data", str(text_data),
                         "--eval-batches", "1", "--log", str(log), "--profile", str(tmp_path / "trace"),
                         "--out", str(tmp_path), "--json", *small)
    assert code == 0, err
    data = json.loads(out)
    vocab = TokenData(text_data).vocab
    assert data["vocab"] == vocab + vocab % 2 and data["mfu"] is None and data["processes"] == 1
    assert [("val_loss" in r) for r in data["history"]] == [True] * 4 and data["val_loss"] == data["history"][-1][
        "val_loss"]
    assert [json.loads(line) for line in log.read_text().splitlines()] == data["history"]
    c = data["communication"]
    assert c["source"].startswith("jax.profiler trace of steps 1-3") and 0 < c["fraction"] < 1 and c["bytes_per_step"]
    assert data["batch_rows"] == [0, 8]       # one process reads every row of the batch (dp x 4 microbatches)


def test_the_text_summary_says_what_was_measured(capsys, tmp_path):
    code, out, err = run(capsys, *ZERO1, "--eval-every", "2", "--out", str(tmp_path))
    assert code == 0, err
    assert "validation loss" in out and "after step 2 (mean of --eval-batches 4 held-out batches)" in out
    assert "MFU n/a (" in out and "no peak FLOP/s known for 'cpu'" in out
    assert "communication: " in out and "counted in the compiled step); not timed" in out


def test_uneven_stages_from_the_command_line(capsys, tmp_path):
    """--layers-per-stage 1,3: --layers defaults to their sum, the summary shows the split
    and the collectives still equal the formulas (the layers' counted per real layer)."""
    code, out, err = run(capsys, "train", "--mesh", "pp=2,tp=2", "--layers-per-stage", "1,3", "--steps", "2",
                         "--out", str(tmp_path), *SMALL)
    assert code == 0, err
    assert "trained pp2 x tp2 1f1b layers 1/3 for 2 steps" in out
    assert "layers per stage: 1/3 (uneven: every stage laid out as 3 layers, the 2 padding layers skipped)" in out
    assert "collectives = the formulas" in out


@pytest.mark.parametrize("argv,piece", [
    (["--mesh", "pp=2", "--layers-per-stage", "1,x"], "--layers-per-stage '1,x': give whole layer counts"),
    (["--mesh", "pp=2", "--layers-per-stage", "1,2"], "--layers-per-stage 1,2 sums to 3, the model has 4 layers"),
    (["--mesh", "pp=2", "--layers-per-stage", "1,1,2"], "has 3 entries for 2 model stages"),
    (["--mesh", "dp=2", "--layers-per-stage", "1,3"], "with --mesh pp 1: one device runs every layer"),
])
def test_bad_layer_splits_are_one_line(capsys, argv, piece):
    code, out, err = run(capsys, "train", "--steps", "2", *argv, *SMALL[:-1], "--layers", "4", "--batch", "4")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxpar train: error:") and piece in err, err


def test_a_run_listed_refused_by_another_model_and_extended(capsys, tmp_path):
    """`jaxpar checkpoint ls`; a run of another model refused in one line naming the flag;
    the same run asked for more steps goes on from the saved one, on the schedule of its
    new total; and with nothing left to train its JSON has every key the others have."""
    d = str(tmp_path / "c")
    steps = lambda n: [a if a != "3" else str(n) for a in ZERO1] + ["--checkpoint", d, "--every", "2"]
    code, _, err = run(capsys, *steps(3))
    assert code == 0, err
    code, out, err = run(capsys, "checkpoint", "ls", d)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.endswith("3 steps, warm-up 1  intact") for line in lines), out
    assert lines[0].startswith("step      2  L2 D16 N4/2 V32 swiglu  dp4 x tp2 sp zero1  float32  loss ")
    code, out, _ = run(capsys, "checkpoint", "ls", d, "--json")
    assert [s["step"] for s in json.loads(out)] == [2, 3] and all(s["intact"] for s in json.loads(out))
    code, out, err = run(capsys, *steps(5), "--layers", "4")
    assert code == 2 and out == ""
    assert err == (f"jaxpar train: error: checkpoint {d}/3 was written with --layers 2, this run has --layers 4: "
                   "use --layers 2, or another checkpoint directory\n")
    code, out, err = run(capsys, *steps(5), "--json")
    assert code == 0, err
    extended = json.loads(out)
    assert extended["resumed_from"] == 3 and [r["step"] for r in extended["history"]] == [3, 4]
    assert extended["schedule_change"] == {"from": {"steps": 3, "warmup": 1}, "to": {"steps": 5, "warmup": 1}}
    code, out, err = run(capsys, *steps(5), "--json")
    assert code == 0, err
    done = json.loads(out)
    assert set(done) == set(extended) and done["steps"] == 0 and done["last_loss"] is None
    assert done["resumed_from"] == 5 and done["history"] == [] and done["vocab"] == 32


def test_checkpoint_ls_refuses_what_is_not_a_directory_in_one_line(capsys, tmp_path):
    code, out, err = run(capsys, "checkpoint", "ls", str(tmp_path / "missing"))
    assert code == 2 and out == ""
    assert err == f"jaxpar checkpoint: error: DIR '{tmp_path / 'missing'}' is not there: give the path of an " \
                  "existing directory\n"
    code, out, _ = run(capsys, "checkpoint", "ls", str(tmp_path))
    assert code == 0 and out == f"no checkpoint in {tmp_path}\n"
