"""One process of the 2 x 4 CPU-device job of tests/test_multiprocess.py (not a test itself).

    python tests/multiprocess_worker.py PROCESS_ID PORT

Joins the job on 127.0.0.1:PORT with 4 fake CPU devices, builds a dp=8 mesh over the 8
global devices, feeds its own 4 rows of the global input, runs one psum in shard_map and
prints, as one JSON line, what it sees of the replicated result.
"""

import json
import sys

import numpy as np

from jaxpar import mesh


def global_input() -> np.ndarray:
    """f32[8, 3]: row r is device r's block. The test process builds the same array."""
    return (np.arange(24, dtype=np.float32).reshape(8, 3) - 5.0) ** 2


def main(process_id: int, port: int) -> None:
    mesh.init_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, local_device_count=4)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    m = mesh.make_mesh(dp=8)
    x_all = global_input()
    local_rows = [i for i, d in enumerate(m.devices.flat) if d.process_index == process_id]
    x = jax.make_array_from_process_local_data(NamedSharding(m, P("dp")), x_all[local_rows], x_all.shape)
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(b, "dp"), mesh=m, in_specs=P("dp"), out_specs=P()))
    y = psum(x)
    print(json.dumps({
        "process_id": process_id,
        "process_count": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "local_rows": local_rows,
        "result": [np.asarray(s.data).tolist() for s in y.addressable_shards],
    }), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
