"""The training loop: batches from the corpus, the step, a progress bar, checkpoints,
and resuming where a killed run left off.

    with Checkpoints("ckpt", every=20) as ckpt:        # its background threads end with the block
        state, history = fit(trainer, steps=200, checkpoints=ckpt, log="steps.jsonl")

Batch i is `corpus.batch(i, ...)` whatever happened before, and a resumed run restores
the latest intact checkpoint (on whatever mesh `trainer` has), so its losses are the
uninterrupted run's. With `checkpoints`, the last step is saved too, a multiple of
`every` or not, and `fit` returns once every save is on disk. `log=` appends one JSON
line per step, `History.row`'s (flushed: a killed run's log is complete up to its last
step); its path is checked before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jax

from jaxpar import errors
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.train.data import Corpus
from jaxpar.train.step import Trainer, TrainState


@dataclasses.dataclass
class History:
    steps: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    norms: list = dataclasses.field(default_factory=list)
    lrs: list = dataclasses.field(default_factory=list)
    seconds: list = dataclasses.field(default_factory=list)     # wall time of each step (the first compiles)
    resumed_from: int | None = None

    def row(self, k: int) -> dict:
        """Step k's record (k = -1: the last): the `--json` history's and the log's lines."""
        return {"step": self.steps[k], "loss": self.losses[k], "grad_norm": self.norms[k], "lr": self.lrs[k],
                "seconds": self.seconds[k]}

    def rows(self) -> list[dict]:
        return [self.row(k) for k in range(len(self.steps))]

    def tokens_per_second(self, tokens_per_step: int) -> float:
        """Over the steps after the first (which compiles)."""
        timed = self.seconds[1:] or self.seconds
        return tokens_per_step * len(timed) / max(sum(timed), 1e-12)

    def step_seconds(self) -> float:
        timed = self.seconds[1:] or self.seconds
        return sum(timed) / max(len(timed), 1)


def _bar(i: int, total: int, loss: float, tok_s: float, ms: float) -> str:
    width = 24
    done = int(width * i / max(total, 1))
    return (f"\r[{'#' * done}{'.' * (width - done)}] step {i}/{total}  loss {loss:.4f}  "
            f"{tok_s:,.0f} tok/s  {ms:.0f} ms/step")


def fit(trainer: Trainer, *, steps: int, corpus: Corpus | None = None, state: TrainState | None = None,
        checkpoints: Checkpoints | None = None, log: str | None = None, progress: bool = True,
        key=None, on_step=None) -> tuple[TrainState, History]:
    """Train to `steps` steps in all; resume from `checkpoints`' latest step when it has
    one (and no `state` is given), save every `checkpoints.every` steps and the last.
    on_step(i, metrics) runs after each step. The caller owns `checkpoints` (close it,
    or use `with`: its background threads end there)."""
    log = errors.writable_path("log", log) if log is not None else None
    corpus = Corpus(vocab=trainer.cfg.vocab) if corpus is None else corpus
    history = History()
    if state is None and checkpoints is not None and checkpoints.latest() is not None:
        state = checkpoints.restore(trainer)
        history.resumed_from = int(jax.device_get(state.step))
    if state is None:
        state = trainer.init(key)
    start = int(jax.device_get(state.step))
    tokens = trainer.batch_size * trainer.seq_len
    out = open(log, "a") if log else None
    try:
        for i in range(start, steps):
            batch = trainer.put(corpus.batch(i, batch_size=trainer.batch_size, seq_len=trainer.seq_len))
            t0 = time.perf_counter()
            state, metrics = trainer.step(state, batch)
            loss = float(metrics["loss"])
            dt = time.perf_counter() - t0
            history.steps.append(i)
            history.losses.append(loss)
            history.norms.append(float(metrics["norm"]))
            history.lrs.append(float(metrics["lr"]))
            history.seconds.append(dt)
            if out:
                out.write(json.dumps(history.row(-1)) + "\n")
                out.flush()
            if checkpoints is not None:
                checkpoints.maybe_save(trainer, state)
            if on_step is not None:
                on_step(i, metrics)
            if progress:
                sys.stderr.write(_bar(i + 1, steps, loss, history.tokens_per_second(tokens),
                                      1e3 * history.step_seconds()))
                sys.stderr.flush()
        if progress and steps > start:
            sys.stderr.write("\n")
        if checkpoints is not None:
            if steps > start:
                checkpoints.save(trainer, state)        # the last step, whatever `every` is
            checkpoints.wait()
    finally:
        if out:
            out.close()
    return state, history
