"""Checkpoints: SIGKILL mid-save and resume, restore on other meshes, a run extended with
more steps, refusals naming what differs and the steps that can be resumed instead,
the last step saved, a directory listed without writing, paths refused before anything
runs."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.train import checkpoint, verify
from jaxpar.train.checkpoint import CheckpointError, Checkpoints
from jaxpar.train.data import Corpus
from jaxpar.train.loop import fit
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

WORKER = Path(__file__).with_name("train_worker.py")
SPEC, CFG, BATCH = verify.MESHES["dp2 pp2 tp2"]


def _log(path) -> dict[int, float]:
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["loss"]       # a resumed run's entry replaces the killed run's
    return out


def _worker(directory, log, steps, every, hold=None):
    # the resumed run finds the killed run's compiled step in the persistent cache
    cache = Path(directory).parent / "jax-cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")]),
           "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    argv = [sys.executable, str(WORKER), str(directory), str(log), str(steps), str(every)]
    return subprocess.Popen(argv + ([str(hold)] if hold else []), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_sigkill_during_an_asynchronous_save_resumes_from_the_last_complete_step_exactly(tmp_path, trainer_cache):
    steps, every, d = 10, 3, tmp_path / "b"
    killed = _worker(d, tmp_path / "b.jsonl", steps, every, hold=6)    # step 6's save never renames
    trainer = trainer_cache(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    _, whole = fit(trainer, steps=steps, progress=False)           # meanwhile, the uninterrupted run here
    deadline = time.time() + 240
    while time.time() < deadline and not (tmp_path / "b.held").exists():
        assert killed.poll() is None, killed.stderr.read()
        time.sleep(0.1)
    assert (tmp_path / "b.held").exists(), "the worker never reached step 6's save"
    killed.send_signal(signal.SIGKILL)                             # while orbax's thread holds step 6
    killed.wait()
    done_before = len((tmp_path / "b.jsonl").read_text().splitlines())
    assert (d / "6.orbax-checkpoint-tmp" / "state").is_dir() and not (d / "6").exists()   # written, not renamed
    with Checkpoints(d, every=every) as ckpt:
        assert ckpt.steps() == [3] and ckpt.latest() == 3
        with pytest.raises(CheckpointError, match="no checkpoint of step 6"):
            ckpt.restore(trainer, step=6)
    resumed = _worker(d, tmp_path / "b.jsonl", steps, every)
    assert resumed.wait(timeout=240) == 0, resumed.stderr.read()
    rows = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert rows[done_before]["step"] == 3                          # the resumed run started from step 3
    b = _log(tmp_path / "b.jsonl")
    assert sorted(b) == list(range(steps))
    assert whole.losses == [b[i] for i in range(steps)]      # exactly
    assert Checkpoints(d).steps() == [6, 9, 10]              # the last step (10) is saved though every=3


@pytest.fixture(scope="module")
def saved(tmp_path_factory, trainer_cache):
    """8 steps on dp2 x pp2 x tp2, saved every 4, and the losses of the whole run."""
    directory = tmp_path_factory.mktemp("ckpt")
    trainer = trainer_cache(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    _, history = fit(trainer, steps=8, checkpoints=Checkpoints(directory, every=4), progress=False)
    return directory, history.losses


@pytest.mark.parametrize("spec", [ParallelSpec(pp=4, tp=2, microbatches=4), ParallelSpec()], ids=str)
def test_restore_on_another_mesh_continues_with_the_same_losses(saved, spec, trainer_cache):
    directory, losses = saved
    trainer = trainer_cache(CFG, spec, verify.OPTIM, batch_size=BATCH, seq_len=16, devices=jax.devices()[:spec.devices])
    state = Checkpoints(directory, every=4).restore(trainer, step=4)
    assert int(state.step) == 4
    _, history = fit(trainer, steps=8, state=state, progress=False)
    np.testing.assert_allclose(history.losses, losses[4:], rtol=1e-5)


def _damage(directory: Path, step: int, how: str) -> None:
    files = [f for f in (directory / str(step) / "state").rglob("*") if f.is_file() and f.stat().st_size > 256]
    target = max(files, key=lambda f: f.stat().st_size)
    if how == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()


ONE = ParallelSpec()


def _one_device(optim=verify.OPTIM, cfg=CFG) -> Trainer:
    return Trainer(cfg, ONE, optim, batch_size=BATCH, seq_len=16, devices=jax.devices()[:1])


@pytest.mark.parametrize("how", ["flip", "delete"])
def test_a_damaged_checkpoint_is_refused_naming_the_step_to_resume_instead(tmp_path, how):
    trainer = _one_device()
    fit(trainer, steps=4, checkpoints=Checkpoints(tmp_path, every=2), progress=False)
    _damage(tmp_path, 4, how)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {tmp_path}/4 is refused: .*; resume=2 resumes from the "
                                              r"latest step that can be \(\[2\]\)$"):
        Checkpoints(tmp_path, every=2).restore(trainer)
    with pytest.raises(CheckpointError, match="refused"):      # fit resumes from the latest: refused too
        fit(trainer, steps=6, checkpoints=Checkpoints(tmp_path, every=2), progress=False)
    assert Checkpoints(tmp_path).steps() == [2, 4]               # nothing deleted, nothing overwritten
    _, history = fit(trainer, steps=3, checkpoints=Checkpoints(tmp_path, every=2), resume=2, progress=False)
    assert history.resumed_from == 2 and history.steps == [2]


def test_a_damaged_checkpoint_with_no_step_to_resume_says_so(tmp_path):
    trainer = _one_device()
    fit(trainer, steps=4, checkpoints=Checkpoints(tmp_path, every=2), progress=False)
    for step in (2, 4):
        _damage(tmp_path, step, "flip")
    with pytest.raises(CheckpointError, match=r"is refused: .*; no other step can be resumed: use another "
                                              r"checkpoint directory$"):
        Checkpoints(tmp_path).restore(trainer)


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(saved):
    directory, _ = saved
    other = Trainer(dataclasses.replace(CFG, n_layers=2), SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    with pytest.raises(CheckpointError) as refusal:
        Checkpoints(directory).restore(other)
    assert str(refusal.value) == (f"checkpoint {directory}/8 was written with n_layers=4, this run has n_layers=2: "
                                  "use n_layers=4, or another checkpoint directory")
    moe = Trainer(verify.MOE, SPEC, dataclasses.replace(verify.OPTIM, lr=0.1), batch_size=BATCH, seq_len=16)
    with pytest.raises(CheckpointError, match=r"was written with n_experts=0, lr=0\.01, this run has n_experts=4, "
                                              r"lr=0\.1: use n_experts=0, lr=0\.01, or another"):
        Checkpoints(directory).restore(moe)


def test_a_checkpoint_of_other_data_is_refused(tmp_path):
    trainer = _one_device()
    fit(trainer, steps=2, corpus=Corpus(vocab=CFG.vocab, seed=0), checkpoints=Checkpoints(tmp_path, every=2),
        progress=False)
    with pytest.raises(CheckpointError, match=r"written with data\.seed=0, this run has data\.seed=1: use the data "
                                              "it was trained on, or another checkpoint directory"):
        fit(trainer, steps=4, corpus=Corpus(vocab=CFG.vocab, seed=1), checkpoints=Checkpoints(tmp_path),
            progress=False)


def test_a_longer_run_extends_the_checkpointed_one_on_its_own_schedule(tmp_path):
    """Resumed with more steps, a run goes on from the saved step with the schedule of its
    new total: the warm-up past, the cosine decay stretched to the new last step; the
    checkpoints it writes record that schedule."""
    short, longer = (dataclasses.replace(verify.OPTIM, steps=n, warmup=n // 2) for n in (4, 6))
    fit(_one_device(short), steps=4, checkpoints=Checkpoints(tmp_path, every=2), progress=False)
    ckpt = Checkpoints(tmp_path, every=2)
    _, history = fit(_one_device(longer), steps=6, checkpoints=ckpt, progress=False)
    assert history.resumed_from == 4 and history.steps == [4, 5]
    assert history.schedule_change == {"from": {"steps": 4, "warmup": 2}, "to": {"steps": 6, "warmup": 3}}
    rate = longer.schedule()
    np.testing.assert_allclose(history.lrs, [float(rate(4)), float(rate(5))], rtol=1e-6)
    assert float(short.schedule()(4)) < history.lrs[0]          # the short run's decay had ended at step 4
    assert ckpt.record(6)["config"]["optim"]["steps"] == 6 and ckpt.record(4)["config"]["optim"]["steps"] == 4


def test_listing_describes_every_step_without_writing(tmp_path):
    trainer = _one_device()
    _, history = fit(trainer, steps=4, checkpoints=Checkpoints(tmp_path / "c", every=2), progress=False)
    _damage(tmp_path / "c", 4, "flip")
    (tmp_path / "c" / "7").mkdir()                        # a step another tool left: no record
    before = sorted(str(p) for p in (tmp_path / "c").rglob("*"))
    steps = checkpoint.listing(tmp_path / "c")
    assert [s["step"] for s in steps] == [2, 4, 7]
    first = steps[0]
    assert first == {"step": 2, "model": "L4 D16 N4/2 V32 swiglu", "mesh": "1 device", "dtype": "float32",
                     "loss": history.losses[1], "schedule": {"steps": 20, "warmup": 3}, "intact": True,
                     "problem": None}
    assert not steps[1]["intact"] and "checksum" in steps[1]["problem"]
    assert not steps[2]["intact"] and steps[2]["model"] is None and "record" in steps[2]["problem"]
    assert sorted(str(p) for p in (tmp_path / "c").rglob("*")) == before
    assert checkpoint.listing(tmp_path) == []               # a directory of no steps
    with pytest.raises(ConfigError, match="is not there: give the path of an existing directory"):
        checkpoint.listing(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_the_last_step_is_saved_whatever_every_is_and_the_log_holds_the_history_rows(tmp_path):
    trainer = Trainer(CFG, ParallelSpec(), verify.OPTIM, batch_size=BATCH, seq_len=16, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        fit(trainer, steps=3, log=tmp_path, progress=False)
    with Checkpoints(tmp_path / "c", every=2) as ckpt:
        _, history = fit(trainer, steps=3, checkpoints=ckpt, log=tmp_path / "log.jsonl", progress=False)
        assert ckpt.steps() == [2, 3]
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert rows == history.rows() and [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "loss", "grad_norm", "lr", "seconds"} and rows[0]["seconds"] > 0


@pytest.mark.parametrize("where,match", [
    ("file", "is a file, not a directory"),
    ("file/ckpt", "lies under .*file', a file"),
    ("missing/ckpt", r"folder .*missing' does not exist; create it \(mkdir -p"),
])
def test_a_checkpoint_path_that_cannot_become_a_directory_is_refused(tmp_path, where, match):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match=f"directory='.*{where}'.*{match}"):
        Checkpoints(tmp_path / where)
    assert sorted(os.listdir(tmp_path)) == ["file"]             # nothing created


def test_a_checkpoint_directory_this_user_cannot_write_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    places = [locked / "ckpt"] if not os.access(locked, os.W_OK) else []    # root passes permission bits
    if os.path.isdir("/proc/1"):
        places.append(Path("/proc/1/ckpt"))       # procfs: no one, root included, creates a directory there
    if not places:
        pytest.skip("running as root without procfs: no place this process cannot write")
    for place in places:
        with pytest.raises(ConfigError, match="is not writable by this user"):
            Checkpoints(place)


def test_ctrl_c_during_a_save_is_delivered_once_orbax_has_the_save(python_ctrl_c):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with checkpoint._ctrl_c_deferred():
            signal.raise_signal(signal.SIGINT)
            reached.append("the rest of the save")
    assert reached and signal.getsignal(signal.SIGINT) is signal.default_int_handler
