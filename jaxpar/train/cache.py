"""Trainers kept for reuse, by whoever wants the reuse: the library keeps none.

    trainers = TrainerCache()
    trainer = trainers(cfg, spec, optim, batch_size=8, seq_len=16)   # Trainer's arguments
    again = trainers(cfg, spec, optim, batch_size=8, seq_len=16)     # the same object: its step
                                                                     # traced and compiled once

Each `Trainer` traces and compiles its own step (seconds on CPU). A process that asks for
the same one many times (the test suite: `tests/conftest.py`'s `trainer_cache` fixture,
passed to `train.verify.parity(trainers=)`) holds one of these. JAX's persistent compilation cache
(`jax_compilation_cache_dir`) saves the compile of an equal program in a later process or a
fresh Trainer, not the tracing; the test session turns it on too.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from jaxpar.train.step import Trainer


class TrainerCache:
    """The last `size` Trainers built through it, by their arguments (the oldest dropped
    first). Arguments that do not hash or name no dtype build a Trainer that is not kept
    (its own ConfigError, if any, says why)."""

    def __init__(self, size: int = 16):
        self.size = size
        self._kept: dict = {}

    def __call__(self, *args, **kwargs) -> Trainer:
        key = _request(*args, **kwargs)
        if key is not None and key in self._kept:
            return self._kept[key]
        trainer = Trainer(*args, **kwargs)
        if key is not None:
            self._kept[key] = trainer
            while len(self._kept) > self.size:
                self._kept.pop(next(iter(self._kept)))
        return trainer

    def __len__(self) -> int:
        return len(self._kept)


def _request(*args, **kwargs):
    """Trainer's arguments as a hashable key (devices resolved, dtypes by name, and whether
    jax_enable_x64 is on: it decides what a float64 array is), or None."""
    try:
        bound = inspect.signature(Trainer).bind(*args, **kwargs)
        bound.apply_defaults()
        request = dict(bound.arguments)
        request["devices"] = tuple(jax.devices() if request["devices"] is None else request["devices"])
        for name in ("dtype", "compute_dtype"):
            request[name] = None if request[name] is None else jnp.dtype(request[name]).name
        key = (*request.items(), ("x64", bool(jax.config.jax_enable_x64)))
        hash(key)
    except (TypeError, ValueError):
        return None
    return key
