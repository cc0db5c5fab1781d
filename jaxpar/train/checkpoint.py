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

A step is restored by a trainer of the same model, dtype and optimizer, on the same data
(`fit` records the data's `fingerprint()` and the step's loss with each save); the
schedule's length may differ (SCHEDULE: steps and warm-up, so that a run is extended by
asking for more steps, its learning rate then following the new total). A refusal is
one line naming only the settings that differ, and the steps that can be resumed
instead, if any. `listing(directory)` describes each step of a directory without
writing to it: `jaxpar checkpoint ls`.
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


# the optimizer settings a resumed run may change: the schedule's length (`fit` extends a run)
SCHEDULE = ("steps", "warmup")


def _config(trainer) -> dict:
    return {"model": dataclasses.asdict(trainer.cfg), "optim": dataclasses.asdict(trainer.optim),
            "dtype": str(np.dtype(trainer.dtype))}


def _record(manager, directory: str, step: int) -> dict:
    """`step`'s record, or a CheckpointError: unreadable, or not a jaxpar checkpoint's."""
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; each is a damaged step
        raise CheckpointError(f"checkpoint {directory}/{step} is refused: its record cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(meta, dict) or "sha256" not in meta or "config" not in meta:
        raise CheckpointError(f"checkpoint {directory}/{step} is refused: its record is not a jaxpar "
                              "checkpoint's (written by another tool?)")
    return meta


def differences(meta: dict, trainer, data: dict | None = None) -> list[tuple[str, object, object]]:
    """(name, the step's value, this run's) of every setting a step must share with the run
    that resumes it: the model's fields, the optimizer's but the schedule's length, the
    dtype, and the data's fingerprint where both were recorded ("data.<field>")."""
    saved, now = meta.get("config") or {}, _config(trainer)
    out = []
    for part in ("model", "optim"):
        a, b = saved.get(part) or {}, now[part]
        out += [(k, a.get(k), b[k]) for k in b if a.get(k) != b[k] and not (part == "optim" and k in SCHEDULE)]
    if saved.get("dtype") != now["dtype"]:
        out.append(("dtype", saved.get("dtype"), now["dtype"]))
    recorded = meta.get("data")
    if recorded is not None and data is not None:
        keys = ["kind"] if recorded.get("kind") != data.get("kind") else sorted(set(recorded) | set(data))
        out += [(f"data.{k}", recorded.get(k), data.get(k)) for k in keys if recorded.get(k) != data.get(k)]
    return out


def _differing(where: str, found: list[tuple[str, object, object]]) -> str:
    """'checkpoint ck/60 was written with n_layers=2, this run has n_layers=4: use
    n_layers=2, or another checkpoint directory' (the data's fields: use its data)."""
    saved = ", ".join(f"{k}={a!r}" for k, a, _ in found)
    now = ", ".join(f"{k}={b!r}" for k, _, b in found)
    fixes = [f"{k}={a!r}" for k, a, _ in found if not k.startswith("data.")]
    if any(k.startswith("data.") for k, _, _ in found):
        fixes.append("the data it was trained on")
    return f"checkpoint {where} was written with {saved}, this run has {now}: use {', '.join(fixes)}, " \
           "or another checkpoint directory"


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

    def save(self, trainer, state, *, loss: float | None = None, data: dict | None = None) -> bool:
        """Save `state` (asynchronously) at its step, with its record: the configs, the mesh
        it was written on, `loss` (the step's) and `data` (the data's fingerprint, which a
        resumed run must match); True when a save started."""
        params, opt, step = trainer.canonical(state)
        step = int(_host(step))
        if step in self.manager.all_steps():
            return False
        tree = {"params": params, "opt": {str(i): a for i, a in enumerate(jax.tree.leaves(opt))}}
        meta = {"step": step, "config": _config(trainer), "spec": trainer.spec.describe(), "loss": loss,
                "data": data, "sha256": _digest([_host(a) for a in jax.tree.leaves(tree)])}
        with _ctrl_c_deferred():
            return self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                                   meta=ocp.args.JsonSave(meta)), force=True)

    def maybe_save(self, trainer, state, *, loss: float | None = None, data: dict | None = None) -> bool:
        step = int(_host(state.step))
        return step % self.every == 0 and self.save(trainer, state, loss=loss, data=data)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's background threads."""
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record(self, step: int) -> dict:
        """What was written with `step`: its configs, spec, loss, data and checksum."""
        return _record(self.manager, self.directory, step)

    def restore(self, trainer, step: int | None = None, *, data: dict | None = None):
        """The state saved at `step` (default: the latest), laid out for `trainer`; `data`:
        the fingerprint of the data the run reads (refused if the step's differs)."""
        self.wait()
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}: train first, or point at another directory")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {self.directory}: it has steps {steps}")
        tree, why = self._load(step, trainer, data)
        if why is not None:
            others = [s for s in steps if s != step and self._load(s, trainer, data)[1] is None]
            differing = " is refused: " not in why      # `_differing`'s line names its own way out
            instead = (f"; resume={others[-1]} resumes from the latest step that can be ({others})" if others
                       else "" if differing else "; no other step can be resumed: use another checkpoint directory")
            raise CheckpointError(why + instead)
        _, opt_abs, _ = trainer.canonical_abstract()
        opt = jax.tree.unflatten(jax.tree.structure(opt_abs), [tree["opt"][str(i)] for i in range(len(tree["opt"]))])
        return trainer.from_canonical(tree["params"], opt, step)

    def _load(self, step: int, trainer, data: dict | None) -> tuple[dict | None, str | None]:
        """(the arrays of `step`, None), or (None, why `trainer` cannot restore it on `data`:
        its record or arrays unreadable, its arrays not matching the checksum written with
        them, or the settings it differs in, `_differing`'s line)."""
        where = f"{self.directory}/{step}"
        refused = lambda why: (None, f"checkpoint {where} is refused: {why}")
        try:
            meta = self.record(step)
        except CheckpointError as e:
            return None, str(e)
        found = differences(meta, trainer, data)
        if found:
            return None, _differing(where, found)
        params_abs, opt_abs, _ = trainer.canonical_abstract()
        tree_abs = {"params": params_abs, "opt": {str(i): a for i, a in enumerate(jax.tree.leaves(opt_abs))}}
        try:
            tree = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), tree_abs))))["state"]
        except Exception as e:  # noqa: BLE001
            return refused(f"its arrays cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        if _digest([np.asarray(a) for a in jax.tree.leaves(tree)]) != meta.get("sha256"):
            return refused("its arrays do not match the checksum written with them (damaged files)")
        return tree, None


def listing(directory) -> list[dict]:
    """Each step of a checkpoint directory, oldest first, read without writing anything:
    {"step", "model" (n_layers, widths, vocab, MLP, experts in short), "mesh" (the spec it
    was written on), "dtype", "loss", "schedule" ({"steps", "warmup"} of the run that wrote
    it), "intact" (its record read, its arrays read and equal to their checksum),
    "problem" (why not, or None)}. A path that is not an existing directory is a
    ConfigError; a directory of no steps gives []."""
    path = errors.existing_directory("directory", directory)
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(path, options=options, item_handlers=handlers)
    try:
        return [_described(manager, path, step) for step in sorted(manager.all_steps())]
    finally:
        manager.close()


def _described(manager, path: str, step: int) -> dict:
    out = {"step": step, "model": None, "mesh": None, "dtype": None, "loss": None, "schedule": None,
           "intact": False, "problem": None}
    try:
        meta = _record(manager, path, step)
    except CheckpointError as e:
        return {**out, "problem": str(e).split(" is refused: ", 1)[-1]}
    optim = meta["config"].get("optim") or {}
    out.update(model=model_name(meta["config"].get("model") or {}), mesh=meta.get("spec"),
               dtype=meta["config"].get("dtype"), loss=meta.get("loss"),
               schedule={k: optim.get(k) for k in SCHEDULE})
    try:       # into host arrays of the saved shapes, whatever devices wrote them
        shapes = manager.item_metadata(step)["state"]
        target = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        tree = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        intact = _digest([np.asarray(a) for a in jax.tree.leaves(tree)]) == meta["sha256"]
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; each is a damaged step
        return {**out, "problem": f"its arrays cannot be read ({type(e).__name__})"}
    return {**out, "intact": intact, "problem": None if intact else "its arrays do not match their checksum"}


def model_name(model: dict) -> str:
    """'L2 D32 N8/4 V512 swiglu' (layers, d_model, query/KV heads, vocab, MLP), with ' E8
    top2' for an MoE."""
    name = (f"L{model.get('n_layers')} D{model.get('d_model')} N{model.get('n_heads')}/{model.get('n_kv_heads')} "
            f"V{model.get('vocab')} {model.get('mlp')}")
    return name + (f" E{model['n_experts']} top{model.get('top_k')}" if model.get("n_experts") else "")
