"""Side-by-side timing shared by the benchmarks (a `_` module: the runner does not list it)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping

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


def compiled_seconds(step: Callable, args: tuple, reps: int):
    """(seconds per call, the compiled program) of jax.jit(step) on args: compiled first
    (not timed), min(2, reps) warm-up calls, then `reps` calls back to back, blocked once."""
    compiled = jax.jit(step).lower(*args).compile()
    for _ in range(min(2, reps)):
        jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps, compiled


def timed_row(step: Callable, args: tuple, reps: int, flops: float, **identity) -> dict:
    """`identity` with step's ms per call (compiled_seconds), TFLOP/s by `flops` per call and
    the compiled program's temporaries in MiB: one row of a GPU kernel benchmark."""
    s, compiled = compiled_seconds(step, args, reps)
    return {**identity, "ms": round(1e3 * s, 3), "tflops": round(flops / s / 1e12, 1),
            "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)}


def rows_to(path: str, measures: Iterable[tuple[dict, Callable[[], dict]]]) -> list[dict]:
    """The row of each (identity, measure) (`guarded`), printed as it comes, the JSON at
    `path` (device, jax version, rows) rewritten after each: a run cut short keeps what
    it measured."""
    rows = []
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for identity, measure in measures:
        rows.append(guarded(measure, **identity))
        print(json.dumps(rows[-1]), flush=True)
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return rows
