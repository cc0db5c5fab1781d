"""A training run in its own process, for the checkpoint tests (killed with SIGKILL).

    python tests/train/train_worker.py DIR LOG STEPS EVERY [SLEEP]
"""

import sys
import time

from jaxpar import mesh

mesh.use_cpu_devices(8)

from jaxpar.train import verify  # noqa: E402  (after the device count is set)
from jaxpar.train.checkpoint import Checkpoints  # noqa: E402
from jaxpar.train.loop import fit  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

SPEC, CFG, BATCH = verify.MESHES["dp2 pp2 tp2"]

if __name__ == "__main__":
    directory, log, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    trainer = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    fit(trainer, steps=steps, checkpoints=Checkpoints(directory, every=every), log=log, progress=False,
        on_step=lambda i, m: time.sleep(pause))
