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


def guarded(measure: Callable[[], dict], **identity) -> dict:
    """measure()'s row, or `identity` with the error that stopped it (out of memory, a
    kernel this machine lacks): one failing row does not stop the others."""
    try:
        return measure()
    except Exception as e:  # noqa: BLE001 - the failure is the row's content
        return {**identity, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}


def without_gpu(name: str, anyway: bool) -> bool:
    """True (after saying why) when there is no GPU and --cpu did not ask to run anyway:
    the GPU benchmarks then skip and exit 0."""
    if jax.default_backend() == "gpu" or anyway:
        return False
    print(f"benchmarks.{name}: skipped: no GPU (backend {jax.default_backend()}); run it on a GPU machine")
    return True
