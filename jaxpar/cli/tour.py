"""`jaxpar tour` and `jaxpar verify NAME`: the checks that exist, run and shown as one table.

CHECKS is the explicit registry: a name, and the verify function ("module:function") that
proves that technique, returning a `testing.Result` or a list of them. It lists only
what exists; a technique joins it when its verify.py does. The functions are imported
when they run, so `jaxpar --help` and `jaxpar schedule` never start JAX. A row that needs
more devices than the machine has reads "skip" in the ok column, its note saying how many.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from jaxpar.errors import ConfigError

if TYPE_CHECKING:
    from jaxpar.testing import Result

# name -> "module:function", in the lecture's order.
CHECKS: dict[str, str] = {
    "reference": "jaxpar.verify:check_reference",
    "comms": "jaxpar.verify:check_comms",
    "dp": "jaxpar.data.verify:check_dp",
    "schedule": "jaxpar.pipeline.verify:check_schedules",
    "pp": "jaxpar.pipeline.verify:check_runtime",
    "tp": "jaxpar.tensor.verify:check_tp",
    "sp": "jaxpar.tensor.verify:check_sp",
    "cp": "jaxpar.context.verify:check_cp",
    "ulysses": "jaxpar.context.verify:check_ulysses",
    "ep": "jaxpar.expert.verify:check_ep",
    "pp-tp": "jaxpar.train.verify:check_pp_tp",
    "memory": "jaxpar.memory.verify:check",
    "plan": "jaxpar.planner.verify:check_plan",
    "train": "jaxpar.train.verify:check_train",
}


def load(name: str) -> Callable[[], Result | list[Result]]:
    """The verify function registered under `name`."""
    module_name, func_name = CHECKS[name].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def run_checks(names: Iterable[str] | None = None) -> list[Result]:
    """Run the named checks (all by default) in order, each under the precision policy
    (float32 matmuls in float32 on every backend: `testing.precision_policy`); a check
    that raises becomes a failed Result, so one broken technique does not hide the others."""
    from jaxpar.testing import Result, precision_policy

    names = list(CHECKS) if names is None else list(names)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:  # refuse before running anything
        raise ConfigError(f"unknown check(s) {', '.join(map(repr, unknown))}; available: {', '.join(CHECKS)}")
    results: list[Result] = []
    for name in names:
        start = time.perf_counter()
        try:
            with precision_policy():
                out = load(name)()
        except Exception as e:  # noqa: BLE001 - reported as a failed row, with the error's first line
            out = Result(name=f"{name}: check raised", passed=False,
                         note=f"{type(e).__name__}: {e}".splitlines()[0][:200])
        out = [out] if isinstance(out, Result) else list(out)
        share = (time.perf_counter() - start) / max(1, sum(not r.skipped for r in out))
        # A check that does not time itself gets its share of the wall time of the whole call;
        # a skipped one ran nothing.
        results.extend(r if r.seconds > 0 or r.skipped else dataclasses.replace(r, seconds=share) for r in out)
    return results


def _programs(collectives) -> str:
    """'2 AR 64.0 KiB' for one program; 'fwd 2 AR 4.0 KiB | bwd 3 AR 13.2 KiB' for several."""
    if len(collectives) == 1:
        return next(iter(collectives.values())).format()
    return " | ".join(f"{name} {c.format()}" for name, c in collectives.items())


def collectives_cell(r: Result) -> str:
    """'2 AR 64.0 KiB = formula', '... != formula 3 AR ...', the measured alone, or '-'."""
    if r.measured is None:
        return "-" if r.expected is None else f"formula {_programs(r.expected)}"
    cell = _programs(r.measured)
    if r.expected is None:
        return cell
    return cell + (" = formula" if r.collectives_match else f" != formula {_programs(r.expected)}")


HEADERS = ("technique", "mesh", "max error", "collectives", "time", "ok", "note")


def verdict(r: Result) -> str:
    """The 'ok' cell: 'skip' (too few devices: the note says how many), 'yes' or 'NO'."""
    return "skip" if r.skipped else "yes" if r.passed else "NO"


def format_table(results: Sequence[Result]) -> str:
    """One aligned row per Result; 'max error' is the largest of its errors (each named in --json)."""
    body = [[r.name, r.mesh, f"{r.max_error:.1e}" if r.errors else "-", collectives_cell(r),
             "-" if r.skipped else f"{r.seconds:.1f}s", verdict(r), r.note] for r in results]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(HEADERS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(HEADERS), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_json(results: Sequence[Result]) -> str:
    return json.dumps([r.to_json() for r in results], indent=2)
