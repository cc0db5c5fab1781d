"""Checkpoints: SIGKILL and resume, restore on other meshes, damaged steps refused."""

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

from jaxpar.train import verify
from jaxpar.train.checkpoint import CheckpointError, Checkpoints
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


def _worker(directory, log, steps, every, pause=0.0):
    # the resumed run finds the killed run's compiled step in the persistent cache
    cache = Path(directory).parent / "jax-cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parents[2]), os.environ.get("PYTHONPATH", "")]),
           "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    return subprocess.Popen([sys.executable, str(WORKER), str(directory), str(log), str(steps), str(every),
                             str(pause)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_losses_exactly(tmp_path):
    steps, every = 10, 3
    killed = _worker(tmp_path / "b", tmp_path / "b.jsonl", steps, every, pause=0.3)
    trainer = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    _, whole = fit(trainer, steps=steps, progress=False)           # meanwhile, the uninterrupted run here
    deadline = time.time() + 240
    while time.time() < deadline and not (tmp_path / "b" / "6").exists():
        assert killed.poll() is None, killed.stderr.read()
        time.sleep(0.1)
    time.sleep(0.4)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    done_before = max(_log(tmp_path / "b.jsonl"))
    assert done_before < steps - 1, "the run finished before it was killed"
    resumed = _worker(tmp_path / "b", tmp_path / "b.jsonl", steps, every)
    assert resumed.wait(timeout=240) == 0, resumed.stderr.read()
    b = _log(tmp_path / "b.jsonl")
    assert sorted(b) == list(range(steps))
    assert whole.losses == [b[i] for i in range(steps)]      # exactly


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """8 steps on dp2 x pp2 x tp2, saved every 4, and the losses of the whole run."""
    directory = tmp_path_factory.mktemp("ckpt")
    trainer = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    _, history = fit(trainer, steps=8, checkpoints=Checkpoints(directory, every=4), progress=False)
    return directory, history.losses


@pytest.mark.parametrize("spec", [ParallelSpec(pp=4, tp=2, microbatches=4), ParallelSpec()], ids=str)
def test_restore_on_another_mesh_continues_with_the_same_losses(saved, spec):
    directory, losses = saved
    trainer = Trainer(CFG, spec, verify.OPTIM, batch_size=BATCH, seq_len=16, devices=jax.devices()[:spec.devices])
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


@pytest.mark.parametrize("how", ["flip", "delete"])
def test_a_damaged_checkpoint_is_refused_and_the_previous_kept(tmp_path, how):
    spec = ParallelSpec()
    trainer = Trainer(CFG, spec, verify.OPTIM, batch_size=BATCH, seq_len=16, devices=jax.devices()[:1])
    ckpt = Checkpoints(tmp_path, every=2)
    fit(trainer, steps=4, checkpoints=ckpt, progress=False)
    _damage(tmp_path, 4, how)
    with pytest.raises(CheckpointError, match=r"step 4 .* refused.*\[2\]"):
        Checkpoints(tmp_path, every=2).restore(trainer)
    with pytest.raises(CheckpointError, match="refused"):      # fit resumes from the latest: refused too
        fit(trainer, steps=6, checkpoints=Checkpoints(tmp_path, every=2), progress=False)
    assert Checkpoints(tmp_path).steps() == [2, 4]
    assert int(Checkpoints(tmp_path).restore(trainer, step=2).step) == 2


def test_a_checkpoint_of_another_model_is_refused(saved):
    directory, _ = saved
    other = Trainer(verify.MOE, ParallelSpec(), verify.OPTIM, batch_size=BATCH, seq_len=16, devices=jax.devices()[:1])
    with pytest.raises(CheckpointError, match="another model"):
        Checkpoints(directory).restore(other)
