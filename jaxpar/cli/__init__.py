"""The `jaxpar` command line: main (the argparse root), devices, tour (the registry of
checks), and one module per subcommand (schedule, memory, plan, exercise, train, data,
checkpoint). The only layer that formats results
and speaks in flags."""

from jaxpar.cli.main import main

__all__ = ["main"]
