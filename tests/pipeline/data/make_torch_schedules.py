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
"""

import csv
import pathlib

import torch
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

OUT = pathlib.Path(__file__).parent / "torch"


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


if __name__ == "__main__":
    main()
