"""`jaxpar tour`: every technique that exists, checked against the reference, in one table.

Each technique module owns its check: a function with no arguments that runs on the
devices JAX has (fake CPU devices by default) and returns one or more `Row`s. The
registry below names them as "module:function"; a module that does not exist yet is
left out of the tour (the README's status column says which ones those are), so a
technique joins the tour by defining its check, without editing this file.

`jaxpar verify NAME` runs the checks registered under NAME alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Iterable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the tour table.

    technique: what ran ("TP block", "1F1B schedule").
    mesh: the mesh it ran on, as "dp=2 tp=4" ("-" when no devices are involved).
    max_error: largest abs difference against the reference over outputs and all
      gradients (or against the lecture's figure, for schedules).
    collectives: measured collectives vs the analytic formula, e.g. "2 AR 64 KiB = formula".
    seconds: wall time of the check (compile included).
    ok: the check's own verdict (error within tolerance and collectives equal to formula).
    note: anything the reader should know (tolerance used, lecture figure, ...).
    """

    technique: str
    mesh: str
    max_error: float
    collectives: str
    seconds: float
    ok: bool
    note: str = ""


# name -> "module:function". Order is the lecture's order.
CHECKS: dict[str, str] = {
    "reference": "jaxpar.reference:tour_check",
    "comms": "jaxpar.comms:tour_check",
    "schedule": "jaxpar.pipeline.schedule_lecture:tour_check",
    "pp": "jaxpar.pipeline.runtime:tour_check",
    "tp": "jaxpar.tensor:tour_check_tp",
    "sp": "jaxpar.tensor:tour_check_sp",
    "cp": "jaxpar.context:tour_check_ring",
    "ulysses": "jaxpar.context:tour_check_ulysses",
    "ep": "jaxpar.expert:tour_check",
    "memory": "jaxpar.memory:tour_check",
    "plan": "jaxpar.planner:tour_check",
    "train": "jaxpar.train:tour_check",
}


def _load(target: str) -> Callable[[], Row | Iterable[Row]] | None:
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name or module_name.startswith(f"{e.name}."):  # not built yet
            return None
        raise  # the technique exists but one of its imports is missing: a real error
    if not hasattr(module, func_name):
        raise AttributeError(f"{module_name} exists but has no tour check {func_name}() (registered in tour.CHECKS)")
    return getattr(module, func_name)


def available() -> dict[str, Callable[[], Row | Iterable[Row]]]:
    """The registered checks whose technique exists in this checkout."""
    found = {}
    for name, target in CHECKS.items():
        fn = _load(target)
        if fn is not None:
            found[name] = fn
    return found


def run_checks(names: Iterable[str] | None = None) -> list[Row]:
    """Run the named checks (all available ones by default) and collect their rows."""
    checks = available()
    names = list(checks) if names is None else list(names)
    unknown = [n for n in names if n not in checks]
    if unknown:  # refuse before running anything
        raise ValueError(f"unknown or not yet built check(s) {', '.join(map(repr, unknown))}; "
                         f"available: {', '.join(checks) or 'none'}")
    rows: list[Row] = []
    for name in names:
        start = time.perf_counter()
        try:
            out = checks[name]()
        except Exception as e:  # noqa: BLE001 - one broken technique must not hide the others
            out = Row(technique=f"{name}: check raised", mesh="-", max_error=float("nan"), collectives="-",
                      seconds=0.0, ok=False, note=f"{type(e).__name__}: {e}".splitlines()[0][:200])
        out = [out] if isinstance(out, Row) else list(out)
        elapsed = time.perf_counter() - start
        # A check that does not time itself gets the wall time of the whole call.
        rows.extend(r if r.seconds > 0 else dataclasses.replace(r, seconds=elapsed / len(out)) for r in out)
    return rows


def format_table(rows: list[Row]) -> str:
    headers = ["technique", "mesh", "max error", "collectives", "time", "ok", "note"]
    body = [
        [r.technique, r.mesh, f"{r.max_error:.1e}", r.collectives, f"{r.seconds:.1f}s",
         "yes" if r.ok else "NO", r.note]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)
