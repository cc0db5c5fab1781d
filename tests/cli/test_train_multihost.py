"""`jaxpar train` as a job of 2 processes x 4 fake CPU devices (jax.distributed, gloo over
loopback), against 1 process x 8 devices: the same losses and validation losses; each
process reads half of every batch; the checkpoints both write restore in one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


from jaxpar.cli.main import main as cli_main
from tests.processes import child_env, free_port, run_together

ROOT = Path(__file__).parents[2]
TIMEOUT_S = 300       # two processes compiling at once on a loaded 2-core machine
RTOL = 1e-5
# a small dense model on dp=4 x tp=2: dp splits the rows over the processes (4 devices each)
ARGS = ["train", "--mesh", "dp=4,tp=2", "--layers", "2", "--d-model", "16", "--heads", "4", "--kv-heads", "2",
        "--ffn", "32", "--vocab", "32", "--seq", "8", "--steps", "4", "--eval-every", "2", "--eval-batches", "1",
        "--every", "2", "--json"]


def _summary(stdout: str) -> dict:
    """The --json summary in a process's stdout (gloo prints its own lines there first)."""
    start = stdout.find("{\n") if stdout.startswith("{") else stdout.find("\n{\n") + 1
    assert start >= 0 and stdout[start] == "{", stdout[-2000:]
    return json.loads(stdout[start:])


def _two_processes(tmp_path) -> list[subprocess.CompletedProcess]:
    env = child_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    argv = [sys.executable, "-m", "jaxpar", *ARGS, "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
            "--processes", "2", "--checkpoint", str(tmp_path / "ckpt"), "--log", str(tmp_path / "log.jsonl"),
            "--out", str(tmp_path / "out")]
    return run_together([argv + ["--process-id", str(i)] for i in range(2)], env=env, timeout_s=TIMEOUT_S)


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


def test_two_processes_of_four_devices_train_as_one_of_eight(capsys, tmp_path):
    first, second = _two_processes(tmp_path)
    for i, p in enumerate((first, second)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{p.stderr[-3000:]}"
    multi = _summary(first.stdout)
    assert "{" not in second.stdout           # process 1 prints nothing of its own
    assert multi["processes"] == 2 and multi["batch_rows"] == [0, 4]      # process 0 read rows 0:4 of 8
    assert multi["collectives_match"]
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert rows == multi["history"]            # one log, written by process 0 alone
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]             # written by both processes

    # 1 process x 8 devices (this one): the same run
    code = cli_main([*ARGS, "--devices", "8", "--out", str(tmp_path / "single")])
    out = capsys.readouterr()
    assert code == 0, out.err
    single = _summary(out.out)
    assert single["processes"] == 1 and single["batch_rows"] == [0, 8]
    losses = [[r["loss"] for r in s["history"]] for s in (multi, single)]
    assert _close(*losses), losses
    validation = [[(r["step"], r["val_loss"]) for r in s["history"] if "val_loss" in r] for s in (multi, single)]
    assert [s for s, _ in validation[0]] == [1, 3] == [s for s, _ in validation[1]]
    assert _close(*([v for _, v in one] for one in validation)), validation

    # the 2 processes' step 2, restored in 1 process: steps 2 and 3 as the job trained them
    shutil.rmtree(tmp_path / "ckpt" / "4")
    code = cli_main([*ARGS, "--devices", "8", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "r")])
    out = capsys.readouterr()
    assert code == 0, out.err
    resumed = _summary(out.out)
    assert resumed["resumed_from"] == 2 and _close([r["loss"] for r in resumed["history"]], losses[0][2:])
