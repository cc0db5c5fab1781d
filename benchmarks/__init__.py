"""Speed and memory measurements, one module per topic (not part of the test run).

    python -m benchmarks.run            every benchmark, one table each
    python -m benchmarks.run comms      some of them; --json for machine-readable output

A benchmark is a module `benchmarks/<name>.py` with a function `run() -> list[dict]`:
one dict per row, the same keys in every row (the table's columns). Its docstring's
first line is the table's title. Nothing else to register: the runner finds it.
"""
