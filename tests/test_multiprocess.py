"""2 processes x 4 CPU devices on loopback (jax.distributed + gloo) agree with 1 process x 8.

The workers are tests/multiprocess_worker.py; this process (8 devices from conftest.py)
computes the single-process answer.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import mesh
from tests.processes import child_env, free_port, run_together

sys.path.insert(0, str(Path(__file__).parent))
from multiprocess_worker import global_input  # noqa: E402  (the input both sides use)

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 120


def _run_workers() -> list[dict]:
    env = child_env()
    port = free_port()
    done = run_together([[sys.executable, str(WORKER), str(i), str(port)] for i in range(2)], env=env,
                        timeout_s=TIMEOUT_S)
    for i, p in enumerate(done):
        assert p.returncode == 0, f"worker {i} exited {p.returncode}; stderr:\n{p.stderr[-3000:]}"
    return [json.loads(p.stdout.strip().splitlines()[-1]) for p in done]


def test_two_processes_of_four_devices_psum_like_one_process_of_eight():
    x_all = global_input()

    # 1 process x 8 devices: the same psum here, and by hand.
    assert jax.device_count() == 8
    m = mesh.make_mesh(dp=8)
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "dp"), mesh=m, in_specs=P("dp"), out_specs=P()))
    single = np.asarray(psum(x_all))
    np.testing.assert_array_equal(single, x_all.sum(axis=0, keepdims=True))

    results = sorted(_run_workers(), key=lambda r: r["process_id"])
    assert [r["process_id"] for r in results] == [0, 1]
    covered = []
    for r in results:
        assert (r["process_count"], r["devices"], r["local_devices"]) == (2, 8, 4)
        assert len(r["local_rows"]) == 4
        covered += r["local_rows"]
        assert len(r["result"]) == 4  # one replica per local device
        for block in r["result"]:
            np.testing.assert_array_equal(np.asarray(block, np.float32), single)
    assert sorted(covered) == list(range(8))  # each global device fed by exactly one process
