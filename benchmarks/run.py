"""Run the benchmarks and print each one's rows as a table.

    python -m benchmarks.run [NAME ...] [--json] [--devices N] [--platform cpu|default]

NAME is a module of this folder (`benchmarks/<NAME>.py` defining `run() -> list[dict]`);
with no NAME every benchmark found runs, in alphabetical order, except those in
ONLY_WHEN_NAMED (maxtext: MaxText against jaxpar; gpu and torch_peer: one GPU). On CPU the run gets `--devices`
fake devices (default 8; XLA_FLAGS=--xla_force_host_platform_device_count wins); on a
GPU/TPU machine the accelerators are used as they are.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
from pathlib import Path

_NOT_BENCHMARKS = {"run"}
# run only when named: maxtext starts MaxText and jaxpar in fresh processes, mesh by mesh
# (tens of minutes on a CPU), and needs MaxText installed in its own venv
# gpu and torch_peer measure one GPU (and PyTorch beside jaxpar on it): on CPU they skip
ONLY_WHEN_NAMED = {"maxtext", "gpu", "torch_peer"}


def available() -> list[str]:
    """Names of the benchmark modules in this folder."""
    here = str(Path(__file__).parent)
    return sorted(m.name for m in pkgutil.iter_modules([here])
                  if not m.name.startswith("_") and m.name not in _NOT_BENCHMARKS)


def _cell(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def format_rows(rows: list[dict]) -> str:
    """A plain-text table: columns are the dict keys, in order of first appearance."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    body = [[_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max([len(c), *(len(b[i]) for b in body)]) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                                   for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(b) for b in body)])


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run(names: list[str]) -> dict[str, dict]:
    """{name: {"title", "rows", "seconds"}} for each named benchmark."""
    results = {}
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        start = time.perf_counter()
        rows = list(module.run())
        title = (module.__doc__ or name).strip().splitlines()[0]
        results[name] = {"title": title, "rows": rows, "seconds": time.perf_counter() - start}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run (found: {', '.join(available())})")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices when running on CPU (default 8)")
    parser.add_argument("--platform", choices=["cpu", "default"], default="default",
                        help="'cpu' forces the CPU backend even where an accelerator exists")
    args = parser.parse_args(argv)

    found = available()
    unknown = [n for n in args.names if n not in found]
    if unknown:  # before JAX starts: a typo costs nothing
        print(f"benchmarks: error: unknown benchmark(s) {', '.join(unknown)}; found: {', '.join(found)}",
              file=sys.stderr)
        return 2

    import jax

    from jaxpar import mesh

    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    mesh.use_cpu_devices(args.devices)
    results = run(args.names or [name for name in found if name not in ONLY_WHEN_NAMED])
    if args.json:
        print(json.dumps(results, indent=2, default=str))
        return 0
    devices = jax.devices()
    print(f"benchmarks on {len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})")
    for name, result in results.items():
        print(f"\n== {name}: {result['title']}  ({result['seconds']:.1f}s)")
        print(format_rows(result["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
