"""Write torch.pipelining's own schedules as CSV files, for tests/pipeline/test_interchange.py.

torch is not a dependency of jaxpar: this script was run once, in a separate virtual
environment with PyTorch for CPU, and its output files are committed next to it. Run it
again (from the repository root) to refresh them:

    python3 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/torchvenv/bin/python tests/pipeline/data/make_torch_schedules.py

Each schedule class computes its `pipeline_order` (one list of actions per rank, None where
the rank idles) in its constructor, for every rank; no process group is needed when the
stages are stand-ins that carry only their sizes (as torch's own schedule tests do). The
files are written the way torch writes them: `_dump_csv(..., format="compute_only")` for a
multi-stage schedule, the same csv.writer rows for GPipe and 1F1B (single-stage classes,
which have no `_dump_csv`), and one `compute_comms` file with torch's send, receive and
gradient-reduction actions. `torch_version.txt` records the version that wrote them.

The other direction is checked here too, since only torch can: every named jaxpar schedule
(p=4, m=8), written by `jaxpar.schedules.interchange.to_csv`, loads in torch's runtime
(`_load_csv`: its validator, then its lowering with sends and receives) and runs to the end
in torch's dry-run simulator (`_simulate_comms_compute`, which flags a deadlock). jaxpar's
pure-Python modules need nothing beyond the standard library, so they import in torch's
environment; `jaxpar_exports.txt` lists what was checked.
"""

import csv
import pathlib
import sys
import tempfile

import torch
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

OUT = pathlib.Path(__file__).parent / "torch"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))   # the repository root: jaxpar
from jaxpar.schedules import interchange, orders, schedule  # noqa: E402  (pure Python: no JAX)


class SizesOnlyStage(_PipelineStageBase):
    """A pipeline stage that only knows its sizes: what a schedule's constructor reads."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int):
        self.submod = None
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.group = None
        self.p2p_per_edge = False

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, n_microbatches, *args, **kwargs):
        pass

    def _prepare_backward_infra(self, n_microbatches, *args, **kwargs):
        pass


def loss_fn(output, target):
    return output


# (file stem, schedule class, ranks, microbatches, stages per rank)
SINGLE = [("gpipe", schedules.ScheduleGPipe, 2, 4), ("gpipe", schedules.ScheduleGPipe, 4, 4),
          ("1f1b", schedules.Schedule1F1B, 2, 4), ("1f1b", schedules.Schedule1F1B, 4, 8)]
MULTI = [("interleaved_1f1b", schedules.ScheduleInterleaved1F1B, 2, 4, 2),
         ("interleaved_1f1b", schedules.ScheduleInterleaved1F1B, 4, 8, 2),
         ("looped_bfs", schedules.ScheduleLoopedBFS, 2, 4, 2),
         ("interleaved_zero_bubble", schedules.ScheduleInterleavedZeroBubble, 2, 4, 2),
         ("interleaved_zero_bubble", schedules.ScheduleInterleavedZeroBubble, 4, 8, 2),
         ("zbv_zero_bubble", schedules.ScheduleZBVZeroBubble, 2, 4, 2),
         ("zbv_zero_bubble", schedules.ScheduleZBVZeroBubble, 4, 8, 2),
         ("dualpipe_v", schedules.ScheduleDualPipeV, 2, 4, 2),
         ("dualpipe_v", schedules.ScheduleDualPipeV, 4, 8, 2)]


def single(cls, ranks: int, microbatches: int):
    """A single-stage schedule (one stage per rank); its pipeline_order covers every rank."""
    return cls(SizesOnlyStage(0, ranks, ranks), microbatches, loss_fn=loss_fn)


def multi(cls, ranks: int, microbatches: int, per_rank: int):
    """A multi-stage schedule seen from rank 0 (pipeline_order holds every rank's list)."""
    stages = [SizesOnlyStage(k, ranks * per_rank, ranks) for k in range(per_rank)]
    return cls(stages, microbatches, loss_fn=loss_fn)


def write_rows(path: pathlib.Path, order: dict) -> None:
    """torch's _dump_csv, for the classes that have none."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in order:
            writer.writerow(order[rank])


def check_in_torch(s: schedule.Schedule) -> dict:
    """Load jaxpar's export of `s` in torch's runtime and dry-run it: torch's stage -> rank map."""
    stages = [SizesOnlyStage(k, s.virtual_stages, s.stages) for k in range(s.chunks)]
    runner = schedules._PipelineScheduleRuntime(stages, s.microbatches, loss_fn=loss_fn)
    with tempfile.NamedTemporaryFile("w", suffix=".csv", newline="", delete=False) as f:
        f.write(interchange.to_csv(s))
    runner._load_csv(f.name)       # torch's validator, then its lowering with sends and receives
    pathlib.Path(f.name).unlink()
    # the simulator knows no FSDP or gradient-reduction actions: the sends and receives only
    skipped = (schedules.UNSHARD, schedules.RESHARD, schedules.REDUCE_GRAD)
    comms = {rank: [a for a in actions if a.computation_type not in skipped]
             for rank, actions in runner.pipeline_order_with_comms.items()}
    schedules._simulate_comms_compute(comms, runner.stage_index_to_group_rank.__getitem__, s.virtual_stages)
    return dict(sorted(runner.stage_index_to_group_rank.items()))


def check_jaxpar_exports() -> None:
    lines = []
    for name in orders.REGISTRY:
        s = schedule.make(name, stages=4, microbatches=8)
        lines.append(f"{name} p=4 m=8: torch loads, lowers and simulates it; stage -> rank {check_in_torch(s)}")
    (OUT / "jaxpar_exports.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for stem, cls, ranks, microbatches in SINGLE:
        write_rows(OUT / f"{stem}_p{ranks}_m{microbatches}.csv", single(cls, ranks, microbatches).pipeline_order)
    for stem, cls, ranks, microbatches, per_rank in MULTI:
        sched = multi(cls, ranks, microbatches, per_rank)
        sched._dump_csv(str(OUT / f"{stem}_p{ranks}_m{microbatches}.csv"), format="compute_only")
    sched = multi(schedules.ScheduleInterleaved1F1B, 2, 4, 2)
    sched._dump_csv(str(OUT / "interleaved_1f1b_p2_m4_comms.csv"), format="compute_comms")
    (OUT / "torch_version.txt").write_text(f"{torch.__version__}\n")
    check_jaxpar_exports()


if __name__ == "__main__":
    main()
