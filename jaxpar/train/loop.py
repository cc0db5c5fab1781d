"""The training loop: batches from the data, the step, a progress line, validation,
checkpoints, and resuming where a killed run left off.

    with Checkpoints("ckpt", every=20) as ckpt:        # its background threads end with the block
        state, history = fit(trainer, steps=200, checkpoints=ckpt, log="steps.jsonl",
                             validation=Validation(every=20, batches=4))

Batch i is `data.batch(i, ...)` whatever happened before, and a resumed run restores
the latest intact checkpoint (on whatever mesh `trainer` has), so its losses are the
uninterrupted run's. With `checkpoints`, the last step is saved too, a multiple of
`every` or not, and `fit` returns once every save is on disk. `log=` appends one JSON
line per step, `History.row`'s (flushed: a killed run's log is complete up to its last
step); its path is checked before anything compiles.

The data is any object with `batch(step, *, batch_size, seq_len, rows=None)` and, for
validation, `validation_batch(k, *, batch_size, seq_len, rows=None)`, each returning
int[batch_size, seq_len + 1] token ids (only the rows `rows` when given): the generated
`Corpus` (the default) or a tokenized text directory (`text.TokenData`). Each process
of a multi-process job reads only the rows its own devices hold (`global_batch`).

The progress line (tqdm, on stderr) shows step i/N, the loss, the last validation loss,
tokens/s, ms/step and MFU (`throughput.mfu`; "n/a" where the device's peak is unknown,
as on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.train import budget, throughput
from jaxpar.train.checkpoint import SCHEDULE, Checkpoints
from jaxpar.train.data import Corpus
from jaxpar.train.step import Trainer, TrainState


class NonFiniteLoss(FloatingPointError):
    """A step's loss was NaN or infinite: `fit` stops there (the weights after it are not
    finite either, so nothing later would train), before that step is logged or saved."""


@dataclasses.dataclass
class History:
    steps: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    norms: list = dataclasses.field(default_factory=list)
    lrs: list = dataclasses.field(default_factory=list)
    seconds: list = dataclasses.field(default_factory=list)     # wall time of each step (the first compiles)
    # per step: the mean validation loss of the weights after that step's update, None where not measured
    val_losses: list = dataclasses.field(default_factory=list)
    resumed_from: int | None = None
    # a resumed run whose schedule's length differs: {"from": {"steps", "warmup"} of the run
    # that wrote the checkpoint, "to": this run's}
    schedule_change: dict | None = None
    profile: dict | None = None       # {"directory", "steps", "file"} when steps were traced

    def row(self, k: int) -> dict:
        """Step k's record (k = -1: the last): the `--json` history's and the log's lines;
        "val_loss" only where it was measured."""
        out = {"step": self.steps[k], "loss": self.losses[k], "grad_norm": self.norms[k], "lr": self.lrs[k],
               "seconds": self.seconds[k]}
        if k < len(self.val_losses) and self.val_losses[k] is not None:
            out["val_loss"] = self.val_losses[k]
        return out

    def record(self, step: int, loss: float, metrics: dict, seconds: float, val_loss: float | None) -> None:
        """Step `step`'s figures (metrics: the step's norm and lr; val_loss None: not measured)."""
        self.steps.append(step)
        self.losses.append(loss)
        self.norms.append(float(metrics["norm"]))
        self.lrs.append(float(metrics["lr"]))
        self.seconds.append(seconds)
        self.val_losses.append(val_loss)

    def rows(self) -> list[dict]:
        return [self.row(k) for k in range(len(self.steps))]

    def validation(self) -> list[tuple[int, float]]:
        """[(step, validation loss)] where measured."""
        return [(s, v) for s, v in zip(self.steps, self.val_losses) if v is not None]

    def tokens_per_second(self, tokens_per_step: int) -> float:
        """Over the steps after the first (which compiles)."""
        timed = self.seconds[1:] or self.seconds
        return tokens_per_step * len(timed) / max(sum(timed), 1e-12)

    def step_seconds(self) -> float:
        timed = self.seconds[1:] or self.seconds
        return sum(timed) / max(len(timed), 1)


# ---- batches: each process reads only its own rows --------------------------------------------

def local_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of an array of `shape` [B, ...] that this process's devices hold under
    `sharding`: one slice from the first row any of them holds to the last (a process's
    devices are neighbours on the meshes `make_mesh` builds, so their rows are one span)."""
    batch = shape[0]
    spans = [index[0].indices(batch)[:2] for index in sharding.addressable_devices_indices_map(shape).values()]
    return slice(min(start for start, _ in spans), max(stop for _, stop in spans))


def _check_tokens(tokens, rows: slice, trainer: Trainer) -> np.ndarray:
    """The rows `rows` of a batch as int32, refused unless int[len(rows), T+1] in [0, vocab)."""
    tokens = np.asarray(tokens)
    want = (rows.stop - rows.start, trainer.seq_len + 1)
    if tokens.shape != want or tokens.dtype.kind not in "iu":
        raise ConfigError(f"the data gave tokens {tokens.shape} {tokens.dtype} for rows {rows.start}:{rows.stop} "
                          f"of a batch: this trainer takes int[batch_size={trainer.batch_size}, "
                          f"seq_len+1={trainer.seq_len + 1}]")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= trainer.cfg.vocab):
        raise ConfigError(f"token ids in [{tokens.min()}, {tokens.max()}]: they must lie in [0, vocab="
                          f"{trainer.cfg.vocab}); give the model a vocab of at least {tokens.max() + 1}")
    return tokens.astype(np.int32)


def global_batch(trainer: Trainer, read) -> jax.Array:
    """The global batch int[B, T+1] on `trainer`'s mesh, of which this process reads only
    the rows its devices hold: read(rows=...) -> those rows (rows=None: the whole batch,
    when this process holds every row). Split by rows as `Trainer.step` takes it
    (`trainer.token_sharding`): each device holds only its rows, nothing is gathered, and
    no process reads the whole batch from its data."""
    sharding = trainer.token_sharding
    shape = (trainer.batch_size, trainer.seq_len + 1)
    rows = local_rows(sharding, shape)
    local = _check_tokens(read(rows=None if rows == slice(0, shape[0]) else rows), rows, trainer)

    def block(index):
        start, stop = index[0].indices(shape[0])[:2]
        return local[start - rows.start:stop - rows.start]
    return jax.make_array_from_callback(shape, sharding, block)


# ---- validation --------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=(2, 3))
def _reference_loss(params, tokens, cfg, mesh):
    # the tokens come split by rows: gathered first, so the loss is one replicated program
    # that sums as the unsharded model does
    tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P()))
    return reference.loss(params, tokens, cfg)


def eval_loss(trainer: Trainer, state: TrainState, tokens) -> float:
    """The loss of `state`'s weights on tokens int[B, T+1] (a global array from
    `global_batch`, split by rows, or host data), forward only: `reference.loss` (the
    trained loss: cross-entropy, plus the balance term when cfg.aux_loss > 0) on the
    canonical weights, one jitted program, replicated on every device (it gathers the
    batch's rows first). Simple and exact; a program sharded as the step is would be
    faster on a large model."""
    params, _, _ = trainer.canonical(state)
    return float(_reference_loss(params, tokens, trainer.cfg, trainer.mesh))


def validation_loss(trainer: Trainer, state: TrainState, data, batches: int) -> float:
    """The mean of `eval_loss` over validation batches 0 .. batches-1 of `data`."""
    params, _, _ = trainer.canonical(state)        # once for every batch
    total = 0.0
    for k in range(batches):
        read = functools.partial(data.validation_batch, k, batch_size=trainer.batch_size, seq_len=trainer.seq_len)
        total += float(_reference_loss(params, global_batch(trainer, read), trainer.cfg, trainer.mesh))
    return total / batches


# ---- profiling ----------------------------------------------------------------------------------

class _Profile:
    """jax.profiler.trace over steps [first, first + count) of a run, written under
    `directory` (one sub-directory per process in a multi-process job)."""

    def __init__(self, directory: str | None, first: int, count: int):
        self.directory = directory
        if directory is not None and jax.process_count() > 1:
            self.directory = os.path.join(directory, f"process-{jax.process_index()}")
        self.first, self.count, self.traced, self.on = first, count, [], False

    def before(self, i: int) -> None:
        if self.directory is not None and i == self.first:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.on = True

    def after(self, i: int) -> None:
        if self.on:
            self.traced.append(i)
            if len(self.traced) == self.count:
                self.stop()

    def stop(self) -> None:
        if self.on:
            jax.profiler.stop_trace()
            self.on = False

    def record(self) -> dict | None:
        if self.directory is None or not self.traced:
            return None
        found = sorted(glob.glob(os.path.join(self.directory, "**", "*.xplane.pb"), recursive=True),
                       key=os.path.getmtime)
        return {"directory": self.directory, "steps": self.traced, "file": found[-1] if found else None}


# ---- the loop -----------------------------------------------------------------------------------

class _ProgressLine(tqdm):
    """tqdm's line with a field {stats} of our own (tqdm's {postfix} starts with ", ")."""

    stats = ""

    @property
    def format_dict(self):
        return {**super().format_dict, "stats": self.stats}


def _progress_text(history: History, trainer: Trainer, tokens: int, device_kind: str, val: float | None) -> str:
    """'loss 3.2548  val 3.3914  1,628 tok/s  20 ms/step  MFU n/a' (val: the last validation loss)."""
    tok_s = history.tokens_per_second(tokens)
    mfu = throughput.mfu(tok_s, trainer.cfg, trainer.seq_len, trainer.mesh.size, device_kind,
                          trainer.compute_dtype or trainer.dtype)          # the dtype the math runs in
    parts = [f"loss {history.losses[-1]:.4f}"] + ([f"val {val:.4f}"] if val is not None else []) + [
        f"{tok_s:,.0f} tok/s", f"{1e3 * history.step_seconds():.0f} ms/step", f"MFU {throughput.format_mfu(mfu)}"]
    return "  ".join(parts)


@dataclasses.dataclass(frozen=True)
class Validation:
    """The mean loss over `batches` validation batches, after every `every`-th step and
    after the last (`fit(validation=...)`)."""

    every: int
    batches: int = 1

    def __post_init__(self):
        errors.whole("eval_every", self.every, fix="eval_every is the steps between validations, e.g. eval_every=20")
        errors.whole("eval_batches", self.batches, maximum=1 << 20,
                     fix="eval_batches is the validation batches averaged, e.g. eval_batches=4")

    def due(self, i: int, steps: int) -> bool:
        """Whether the loss is measured after step i of a run to `steps`."""
        return (i + 1) % self.every == 0 or i + 1 == steps

    def check_data(self, data) -> None:
        if not callable(getattr(data, "validation_batch", None)):
            raise ConfigError(f"eval_every={self.every}: the data ({type(data).__name__}) has no "
                              "validation_batch(k, *, batch_size, seq_len, rows=None); give data with "
                              "held-out batches, or no validation")


@dataclasses.dataclass(frozen=True)
class Profiling:
    """`jax.profiler.trace` of `steps` steps after the first (which compiles), written under
    `directory` (`fit(profiling=...)`)."""

    directory: str
    steps: int = 3

    def __post_init__(self):
        errors.whole("profile_steps", self.steps, maximum=1 << 10)


def fit(trainer: Trainer, *, steps: int, corpus=None, state: TrainState | None = None,
        checkpoints: Checkpoints | None = None, resume: int | None = None, log: str | None = None,
        progress: bool = True, validation: Validation | None = None,
        profiling: Profiling | None = None) -> tuple[TrainState, History]:
    """Train to `steps` steps in all; resume from `checkpoints`' latest step when it has
    one, or from step `resume` (and no `state` is given: else trainer.init()), save every
    `checkpoints.every` steps and the last. A step written by a run of another length
    (trainer.optim's steps and warm-up) is resumed with this run's schedule: the run is
    extended (said on the progress line's stream, and in `History.schedule_change`).

    corpus: the data (default: `Corpus(vocab=cfg.vocab)`). validation: when to measure
    the validation loss (None: never). profiling: a trace of a few steps (None: none).
    log: a JSON-lines file, one row a step. progress: the tqdm line on stderr. In a
    multi-process job only process 0 writes the log and draws the progress line. The
    caller owns `checkpoints` (close it, or use `with`: its background threads end there).
    A step whose loss is not finite raises NonFiniteLoss (nothing of it logged or saved)."""
    log = errors.writable_path("log", log) if log is not None else None
    corpus = Corpus(vocab=trainer.cfg.vocab) if corpus is None else corpus
    if validation is not None:
        validation.check_data(corpus)
    history = History()
    fingerprint = getattr(corpus, "fingerprint", None)
    data = fingerprint() if fingerprint is not None else None
    state = _resume_or_init(trainer, state, checkpoints, history, data=data, step=resume)
    if history.schedule_change and progress and jax.process_index() == 0:
        print(_schedule_line(history), file=sys.stderr, flush=True)
    start = int(jax.device_get(state.step))
    profiler = _Profile(profiling and profiling.directory, start + 1 if steps - start > 1 else start,
                        profiling.steps if profiling else 0)
    report = _Report(trainer, log, progress=progress and steps > start, start=start, steps=steps)
    try:
        for i in range(start, steps):
            read = functools.partial(corpus.batch, i, batch_size=trainer.batch_size, seq_len=trainer.seq_len)
            batch = global_batch(trainer, read)
            profiler.before(i)
            t0 = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t0
            _check_finite(i, loss, metrics, trainer.optim.lr)
            profiler.after(i)
            measured = validation is not None and validation.due(i, steps)
            history.record(i, loss, metrics, dt,
                           validation_loss(trainer, state, corpus, validation.batches) if measured else None)
            report.step(history)
            if checkpoints is not None:
                checkpoints.maybe_save(trainer, state, loss=loss, data=data)
        profiler.stop()
        history.profile = profiler.record()
        if checkpoints is not None:
            if steps > start:                           # the last step, whatever `every` is
                checkpoints.save(trainer, state, loss=history.losses[-1], data=data)
            checkpoints.wait()
    finally:
        profiler.stop()
        report.close()
    return state, history


def _check_finite(i: int, loss: float, metrics: dict, lr: float) -> None:
    if not np.isfinite(loss):
        raise NonFiniteLoss(f"step {i}: the loss is {loss} (gradient norm {float(metrics['norm'])}), the run stopped "
                            f"there; give a lower learning rate, e.g. lr={min(lr / 10, 3e-3):g} (now lr={lr:g})")


class _Report:
    """Where `fit` reports each step: one JSON line in `log` (flushed) and the progress line,
    both on process 0 only; the line shows the last validation loss measured."""

    def __init__(self, trainer: Trainer, log: str | None, *, progress: bool, start: int, steps: int):
        lead = jax.process_index() == 0
        self.out = open(log, "a") if log and lead else None
        self.bar = _ProgressLine(total=steps, initial=start, disable=not (progress and lead), dynamic_ncols=True,
                                 bar_format="step {n_fmt}/{total_fmt} |{bar:16}| {stats}")
        self.text = functools.partial(_progress_text, trainer=trainer, tokens=trainer.batch_size * trainer.seq_len,
                                      device_kind=trainer.mesh.devices.flat[0].device_kind)
        self.last_val = None

    def step(self, history: History) -> None:
        row = history.row(-1)
        if self.out:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()
        if row.get("val_loss") is not None:
            self.last_val = row["val_loss"]
        if not self.bar.disable:
            self.bar.stats = self.text(history, val=self.last_val)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.out:
            self.out.close()


def _resume_or_init(trainer: Trainer, state: TrainState | None, checkpoints: Checkpoints | None,
                    history: History, *, data: dict | None, step: int | None) -> TrainState:
    """`state` if given; else the checkpoints' step `step` (default: the latest; noted in
    history.resumed_from, with the schedule it was written under where this run's
    differs); else a fresh state."""
    if step is not None and (checkpoints is None or state is not None):
        raise ConfigError(f"resume={step}: resuming needs checkpoints and no state given")
    if state is None:
        budget.check(trainer)       # a step that cannot fit is refused before a weight is allocated
    if state is None and checkpoints is not None and (step is not None or checkpoints.latest() is not None):
        state = checkpoints.restore(trainer, step, data=data)
        history.resumed_from = int(jax.device_get(state.step))
        written = checkpoints.record(history.resumed_from)["config"]["optim"]
        now = dataclasses.asdict(trainer.optim)
        if any(written[k] != now[k] for k in SCHEDULE):
            history.schedule_change = {"from": {k: written[k] for k in SCHEDULE}, "to": {k: now[k] for k in SCHEDULE}}
    return trainer.init() if state is None else state


def _schedule_line(history: History) -> str:
    """'resumed from step 60 of a 60-step run (warm-up 6): the learning rate now follows
    80 steps (warm-up 8), cosine decay to step 80'."""
    a, b = history.schedule_change["from"], history.schedule_change["to"]
    return (f"resumed from step {history.resumed_from} of a {a['steps']}-step run (warm-up {a['warmup']}): the "
            f"learning rate now follows {b['steps']} steps (warm-up {b['warmup']}), cosine decay to step {b['steps']}")
