"""The `jaxpar` command (also `python -m jaxpar`).

    jaxpar tour                      every technique against the reference, one table
    jaxpar verify tp                 one technique's check (names: `jaxpar verify --help`)
    jaxpar schedule 1f1b -p 4 -m 8   pipeline schedules as data (timelines, bubbles, memory)
    jaxpar memory --tp 8 --sp        one layer's activations, term by term (lecture 4)
    jaxpar plan --model llama3-8b    the 3D/4D planner (lecture 7)
    jaxpar exercise 3                the lecture's exercises 1, 3, 7, 8
    jaxpar train --mesh dp=2,pp=2,tp=2 --steps 200   the composed model trained (lecture 7)
    jaxpar checkpoint ls run/ckpt    the steps a checkpoint directory holds

A subcommand module (COMMANDS) exposes HELP, FLAGS (the library's Python names and the
flags that set them), add_arguments(parser) and main(args) -> int. A ConfigError (input
the library refuses) prints as one line, in the command's flags, with exit status 2;
Ctrl-C prints one line with status 130 (the shell's 128 + SIGINT); any other exception
is a bug and keeps its traceback. Modules are imported late, so
`jaxpar schedule` and `jaxpar --help` never start JAX.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from jaxpar.cli.flags import translate
from jaxpar.errors import ConfigError

# subcommand -> module exposing HELP, FLAGS, add_arguments(parser), main(args).
COMMANDS: dict[str, str] = {
    "schedule": "jaxpar.cli.schedule",
    "memory": "jaxpar.cli.memory",
    "plan": "jaxpar.cli.plan",
    "exercise": "jaxpar.cli.exercise",
    "train": "jaxpar.cli.train",
    "data": "jaxpar.cli.data",
    "checkpoint": "jaxpar.cli.checkpoint",
}


def _tour(args) -> int:
    from jaxpar.cli import devices, tour

    devs = devices.start(args)
    if not args.json:
        print(f"jaxpar tour on {len(devs)} {devs[0].platform} device(s)\n")
    return _print(tour.run_checks(args.only or None), args.json)


def _verify(args) -> int:
    from jaxpar.cli import devices, tour

    devices.start(args)
    return _print(tour.run_checks([args.technique]), args.json)


def _print(results, as_json: bool) -> int:
    from jaxpar.cli import tour

    print(tour.format_json(results) if as_json else tour.format_table(results))
    return 0 if all(r.passed for r in results) else 1


class Parser(argparse.ArgumentParser):
    """argparse's parser whose refusals (a flag's type, an unknown choice, a missing
    argument) are one line and exit 2, as a ConfigError's: no usage block before them."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from jaxpar.cli import devices, tour

    parser = Parser(
        prog="jaxpar",
        description="LLM-training parallelism in JAX (CS336 lecture 8), checked against a reference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("tour", help="run every technique against the reference and print one table")
    p.add_argument("--only", nargs="*", metavar="NAME", help=f"restrict to these checks ({', '.join(tour.CHECKS)})")
    devices.add_options(p)
    p.set_defaults(func=_tour, flags={})

    p = sub.add_parser("verify", help="check one technique against the reference")
    p.add_argument("technique", choices=list(tour.CHECKS), metavar="TECHNIQUE",
                   help=f"one of: {', '.join(tour.CHECKS)}")
    devices.add_options(p)
    p.set_defaults(func=_verify, flags={})

    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.main, flags=module.FLAGS)
    return parser


def _quiet_closed_loops(unraisable) -> None:
    """sys.unraisablehook without orbax's leftovers: reading a damaged checkpoint leaves
    tensorstore callbacks that find orbax's event loop closed, one traceback each, after
    the refusal the command prints as its one line; anything else is printed as usual."""
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
        sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sys.unraisablehook = _quiet_closed_loops
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)    # the same reads' futures, never retrieved
    # orbax's notes and its errors on a damaged checkpoint (whose refusal is the one line)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        line = translate(str(e), args.flags).splitlines()[0]
        print(f"jaxpar {args.command}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # the command's `with` blocks have closed what they opened
        print(f"jaxpar {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jaxpar schedule ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
