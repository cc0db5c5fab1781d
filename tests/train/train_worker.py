"""A training run in its own process, for the checkpoint tests (killed with SIGKILL).

    python tests/train/train_worker.py DIR LOG STEPS EVERY [HOLD]

HOLD: a step whose save stops just before orbax's last act, the rename of
`HOLD.orbax-checkpoint-tmp` (every file of the step already written) to `HOLD`, and
waits there until the process is killed; `DIR.held` appears when it does. The window a
crash must hit is otherwise milliseconds wide for this small model.
"""

import asyncio
import sys
from pathlib import Path

from jaxpar import mesh

mesh.use_cpu_devices(8)

from orbax.checkpoint._src.path import atomicity  # noqa: E402

from jaxpar.train import verify  # noqa: E402  (after the device count is set)
from jaxpar.train.checkpoint import Checkpoints  # noqa: E402
from jaxpar.train.loop import fit  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402

SPEC, CFG, BATCH = verify.MESHES["dp2 pp2 tp2"]


def hold_before_rename(step: int, marker: Path) -> None:
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def held(self, *args, **kwargs):
        if self._final_path.name == str(step):       # the step directory (its items are finalized first)
            marker.touch()
            await asyncio.sleep(3600)                 # in orbax's background thread; SIGKILL ends it
        return await finalize(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = held


if __name__ == "__main__":
    directory, log, steps, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if len(sys.argv) > 5:
        hold_before_rename(int(sys.argv[5]), Path(directory + ".held"))
    trainer = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    with Checkpoints(directory, every=every) as ckpt:
        fit(trainer, steps=steps, checkpoints=ckpt, log=log, progress=False)
