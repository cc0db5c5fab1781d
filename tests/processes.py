"""Several processes of one job on this machine, started together (the multi-process tests).

    port = free_port()
    done = run_together([argv_0, argv_1], env=env, timeout_s=120)   # [CompletedProcess], in order

Each process gets its own pipes; if any has not finished after timeout_s (a collective
waiting for a partner that died, say), every one is killed and the test fails with the
end of each one's stderr. Nothing is left running, whatever happens.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess

import pytest


def child_env(**extra: str) -> dict:
    """os.environ for a child process that picks its own device count: XLA_FLAGS without
    --xla_force_host_platform_device_count, the fast-compile flags conftest.py set kept (a
    child without them compiles several times slower), JAX_PLATFORMS=cpu; plus `extra`."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
                                                                          **extra}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for the job's coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(argvs: list[list[str]], *, env: dict, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Start every argv at once, wait for all of them; their completed processes, in order."""
    procs = [subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for argv in argvs]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate() for p in procs]
        pytest.fail(f"the {len(procs)} processes did not finish in {timeout_s} s; stderr:\n" + "\n".join(
            f"--- process {i}\n{err[-3000:]}" for i, (_, err) in enumerate(logs)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
