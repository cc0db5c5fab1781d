"""The `jaxpar` command (also `python -m jaxpar`).

    jaxpar tour                  every technique against the reference, one table
    jaxpar verify tp             one technique's check (names: see `jaxpar verify --help`)
    jaxpar schedule 1f1b -p 4 -m 8   pipeline schedules as data (timelines, bubbles, memory)

Subcommands other than tour/verify live with their technique: a module named in
COMMANDS exposes `HELP`, `add_arguments(parser)` and `main(args) -> int`, and joins the
command line once it exists. Any ValueError (bad mesh, bad schedule, ...) is printed as
one line, without a traceback, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

# subcommand -> module exposing HELP, add_arguments(parser), main(args).
COMMANDS: dict[str, str] = {
    "schedule": "jaxpar.pipeline.schedule_cli",
    "memory": "jaxpar.memory_cli",
    "plan": "jaxpar.planner_cli",
    "train": "jaxpar.train_cli",
}


def _command_modules():
    for name, module_name in COMMANDS.items():
        try:
            yield name, importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not (e.name and module_name.startswith(e.name)):
                raise


def _add_device_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8,
                   help="fake CPU devices to start when running on CPU (default 8; "
                        "XLA_FLAGS=--xla_force_host_platform_device_count wins)")
    p.add_argument("--platform", choices=["cpu", "default"], default="default",
                   help="'cpu' forces the CPU backend even where an accelerator exists")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _start_devices(args) -> None:
    import jax

    from jaxpar import mesh

    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    mesh.use_cpu_devices(args.devices)


def _print_rows(rows, as_json: bool) -> int:
    import dataclasses

    from jaxpar import tour

    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    else:
        print(tour.format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


def _tour(args) -> int:
    import jax

    from jaxpar import tour

    _start_devices(args)
    if not args.json:
        devs = jax.devices()
        print(f"jaxpar tour on {len(devs)} {devs[0].platform} device(s)\n")
    return _print_rows(tour.run_checks(args.only or None), args.json)


def _verify(args) -> int:
    from jaxpar import tour

    _start_devices(args)
    return _print_rows(tour.run_checks([args.technique]), args.json)


def build_parser() -> argparse.ArgumentParser:
    from jaxpar import tour

    parser = argparse.ArgumentParser(
        prog="jaxpar",
        description="LLM-training parallelism in JAX (CS336 lecture 8), checked against a reference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("tour", help="run every technique against the reference and print one table")
    p.add_argument("--only", nargs="*", metavar="NAME", help=f"restrict to these checks ({', '.join(tour.CHECKS)})")
    _add_device_options(p)
    p.set_defaults(func=_tour)

    p = sub.add_parser("verify", help="check one technique against the reference")
    p.add_argument("technique", choices=list(tour.CHECKS), metavar="TECHNIQUE",
                   help=f"one of: {', '.join(tour.CHECKS)}")
    _add_device_options(p)
    p.set_defaults(func=_verify)

    for name, module in _command_modules():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"jaxpar {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jaxpar schedule ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
