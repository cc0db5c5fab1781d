"""Planner speed: a full sweep for 16384 GPUs (bound: under 1 s, so that `jaxpar plan` answers
at the prompt while one tries sizes), and the planner's start-up without JAX.

    python -m benchmarks.planner
    python -m benchmarks.run planner
"""

from __future__ import annotations

import subprocess
import sys
import time

from jaxpar.planner import catalog
from jaxpar.planner import search as S


def run() -> list[dict]:
    rows = []
    for name, gpus, tokens, cps in (("llama3-405b", 16384, 16 * 2**20, (1,)), ("llama3-405b", 16384, 16 * 2**20,
                                                                           (1, 2, 4, 8, 16)),
                                    ("deepseek-v3", 2048, 15360 * 4096, (1,))):
        model = catalog.model(name)
        cluster = S.Cluster(gpu=catalog.accelerator("h100"), gpus=gpus)
        seq_len = 8192 if name != "deepseek-v3" else 4096
        start = time.perf_counter()
        found = S.search(model, cluster, tokens=tokens, seq_len=seq_len, cps=cps)
        rows.append({"figure": "sweep", "model": name, "gpus": gpus, "cp sizes": len(cps),
                     "configurations": len(found), "feasible": sum(e.feasible for e in found),
                     "seconds": time.perf_counter() - start})
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxpar", "plan", "--top", "1"], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-c", "import sys, jaxpar.cli.plan, jaxpar.planner.search; "
                          "print(any(m.split('.')[0] == 'jax' for m in sys.modules))"], capture_output=True, text=True)
    rows.append({"figure": "start-up", "model": "jaxpar plan --top 1", "seconds": time.perf_counter() - start,
                 "imports jax": out.stdout.strip()})
    return rows


if __name__ == "__main__":
    from benchmarks.run import format_rows
    print(format_rows(run()))
