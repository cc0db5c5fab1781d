"""Checkpoints with orbax, in the canonical layout: restore on any mesh.

    with Checkpoints(directory, every=10) as ckpt:  # closing joins orbax's background threads
        ckpt.maybe_save(trainer, state)              # asynchronous, every `every` steps
        ckpt.save(trainer, state)                    # now (`fit` saves its last step so)
        state = ckpt.restore(trainer)                # the latest, onto trainer's mesh (any spec)

What is saved is `Trainer.canonical(state)`: the parameters in reference.init_params's
structure, AdamW's state laid out the same way, and the step, whatever mesh and schedule
wrote them; restoring lays them out for the restoring trainer's spec (pp4 x tp2, one
device, ZeRO-1 or not). Alongside: a JSON record of the model and optimizer configs and
a SHA-256 of every array. orbax writes a step into a temporary directory and renames it
when complete, so a run killed mid-save leaves only `<step>.orbax-checkpoint-tmp`, which
is never listed nor restored (the previous step is the latest); a step whose files are
damaged fails its checksum (or orbax's read) and is refused with a `CheckpointError`
that names it and the intact steps, which are kept.

The directory is checked when a `Checkpoints` is made, before anything compiles: a
regular file, a path under a file, a directory this user cannot write, or a new
directory whose folder does not exist is a ConfigError (the directory itself is
created, its folder is not). A save that fails or is interrupted while orbax starts it
leaves orbax's background threads waiting for its coordination timeout (300 s), and the
process cannot exit before: so the path is refused before the first save, and Ctrl-C
during a save is delivered once orbax's threads have the save. Use `with` (or call
`close()`): pending saves finish and orbax's threads are joined on every way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import signal
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar import errors
from jaxpar.errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be restored (damaged, partial, or of another model)."""


def _host(a) -> np.ndarray:
    """A replicated global array's value on this host."""
    return np.asarray(a.addressable_data(0)) if isinstance(a, jax.Array) else np.asarray(a)


def _digest(leaves) -> str:
    h = hashlib.sha256()
    for a in leaves:
        a = np.ascontiguousarray(a)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _config(trainer) -> dict:
    return {"model": dataclasses.asdict(trainer.cfg), "optim": dataclasses.asdict(trainer.optim),
            "dtype": str(np.dtype(trainer.dtype))}


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Ctrl-C (SIGINT) held until orbax has handed a save to its threads, then delivered:
    a save interrupted half-started leaves threads waiting for signals that never come."""
    if threading.current_thread() is not threading.main_thread():
        yield                   # signals reach the main thread only
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)
        if held:
            signal.raise_signal(signal.SIGINT)


@dataclasses.dataclass(eq=False)
class Checkpoints:
    """directory: where steps go (one sub-directory each; created if missing, in an
    existing folder); every: save when the step count is a multiple of it; keep: how many
    to keep; asynchronous: save in the background (the step loop goes on while the files
    are written)."""

    directory: str
    every: int = 10
    keep: int = 3
    asynchronous: bool = True

    def __post_init__(self):
        for name in ("every", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: give a whole number >= 1")
        self.directory = errors.writable_path("directory", self.directory, directory=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, enable_async_checkpointing=self.asynchronous,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, trainer, state, *, force: bool = False) -> bool:
        """Save `state` (asynchronously) at its step; True when a save started."""
        params, opt, step = trainer.canonical(state)
        step = int(_host(step))
        if step in self.manager.all_steps():
            return False
        tree = {"params": params, "opt": {str(i): a for i, a in enumerate(jax.tree.leaves(opt))}}
        meta = {"step": step, "config": _config(trainer), "spec": trainer.spec.describe(),
                "sha256": _digest([_host(a) for a in jax.tree.leaves(tree)])}
        with _ctrl_c_deferred():
            return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                                   meta=ocp.args.JsonSave(meta)), force=True)

    def maybe_save(self, trainer, state) -> bool:
        step = int(_host(state.step))
        return step % self.every == 0 and self.save(trainer, state)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's background threads."""
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def restore(self, trainer, step: int | None = None):
        """The state saved at `step` (default: the latest), laid out for `trainer`."""
        self.wait()
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}: train first, or point at another directory")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}: it has steps {steps}")
        others = [s for s in steps if s != step]
        refuse = lambda why: CheckpointError(
            f"checkpoint step {step} in {self.directory} is refused: {why}. The other steps are kept: "
            + (f"{others}; restore(trainer, step={others[-1]})" if others else "none"))
        params_abs, opt_abs, _ = trainer.canonical_abstract()
        tree_abs = {"params": params_abs, "opt": {str(i): a for i, a in enumerate(jax.tree.leaves(opt_abs))}}
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds; each is a damaged step
            raise refuse(f"its record cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        if meta.get("config") != _config(trainer):
            raise refuse(f"it was written for another model or optimizer ({meta.get('config')}, this trainer: "
                         f"{_config(trainer)})")
        try:
            tree = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree_abs))))["state"]
        except Exception as e:  # noqa: BLE001
            raise refuse(f"its arrays cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        leaves = [np.asarray(a) for a in jax.tree.leaves(tree)]
        if _digest(leaves) != meta.get("sha256"):
            raise refuse("its arrays do not match the checksum written with them (damaged files)")
        opt = jax.tree.unflatten(jax.tree.structure(opt_abs), [tree["opt"][str(i)] for i in range(len(tree["opt"]))])
        return trainer.from_canonical(tree["params"], opt, step)
