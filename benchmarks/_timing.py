"""Side-by-side timing shared by the benchmarks (a `_` module: the runner does not list it)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import jax


def alternated(fns: Mapping[str, Callable], args: tuple, repeats: int) -> dict[str, list[float]]:
    """{name: seconds of each run}: every fn(*args) once to warm up (and compile), then
    `repeats` rounds running each in turn, so the load of a shared machine hits all alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times
