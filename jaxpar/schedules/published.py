"""The numbers Qi et al. publish for their pipeline schedules, as data, so that jaxpar's
timing can be held against them (tests/schedules/test_timing.py, `jaxpar schedule
--published`).

Source: Penghui Qi, Xinyi Wan, Guangxing Huang, Min Lin, "Zero Bubble Pipeline
Parallelism", ICLR 2024 (arXiv 2401.10241):

    MODELS    Table 3: the GPT-3-like models of the experiments
    PROFILED  Table 6 (appendix D): the profiled T_F, T_B, T_W and T_comm of each setting,
              in milliseconds, "used to calculate bubble rates for all the methods"
    BUBBLES   Table 5: the bubble rates of 1F1B, 1F1B-I (interleaved, one layer per chunk),
              ZB-H1, ZB-H2, ZB-1p and ZB-2p (searched under the memory limits p M_B and
              2p M_B) per setting. The paper's bubble rate is (cost - m(T_F + T_B + T_W)) /
              cost, with cost "the largest execution time of all stages" (section 5.3).

`timing.timed(schedule.make(name, p, m), profiled_costs(model, m))` gives the 1F1B, ZB-H1
and ZB-H2 columns to all four published decimals in every row (`reproduced`). ZB-1p and
ZB-2p are searched schedules: `searched` runs jaxpar's own search (`search.search`) under
the same memory limits, p M_B and 2p M_B, with M_W / M_B from Table 1 for each model.
The 1F1B-I column needs as many chunks as layers per stage, with uneven layer counts (the
first and last stage hold one layer fewer): the table keeps it as a reference figure only.

The arXiv version (2401.10241 v2 onward) adds ZB-V (section 6: two chunks a device in a
V, 1F1B's memory) and its bubble rates:

    ZB_V_BUBBLES  Table 8: 1F1B, 1F1B-I, ZB-H1, ZB-H2 and ZB-V per (model, p, m), p = 16,
                  24, 32 GPUs. The paper computes them from "the profiled values ...
                  obtained in the experiments for ZB-V" (microbatch size 6, 2, 2), which
                  it does not print (its Table 9 is Table 6 above, section 5's settings
                  only), and the columns jaxpar reproduces do not pin them down: three
                  rates, three unknown ratios B/F, W/F, comm/F, but fitting them to the
                  1F1B, ZB-H1 and ZB-H2 columns gives B/F anywhere from 0.003 to 0.99 row
                  to row. Comparisons with Table 8 therefore time the same model's Table 6
                  times (`ZB_V_PROXY`): only approximately the paper's setting.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from jaxpar.errors import ConfigError
from jaxpar.schedules import schedule as schedule_lib
from jaxpar.schedules import search as search_lib
from jaxpar.schedules.timing import Costs, timed

CITATION = 'Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241'


class Model(NamedTuple):
    """Table 3: a model of the experiments and its fixed settings."""

    layers: int
    heads: int
    hidden: int
    sequence: int
    stages: int            # pipeline stages = GPUs
    microbatch_size: int


class Profiled(NamedTuple):
    """Table 6: one setting's profiled times, in ms."""

    F: float
    B: float
    W: float
    comm: float


class Bubbles(NamedTuple):
    """Table 5: one setting's published bubble rates (column names as the paper's)."""

    one_f_one_b: float     # 1F1B
    interleaved: float     # 1F1B-I
    zb_h1: float           # ZB-H1
    zb_h2: float           # ZB-H2
    zb_1p: float           # ZB-1p: searched, memory limit p M_B
    zb_2p: float           # ZB-2p: searched, memory limit 2p M_B


MODELS: dict[str, Model] = {
    "1.5B": Model(layers=22, heads=24, hidden=2304, sequence=1024, stages=8, microbatch_size=6),
    "6.2B": Model(layers=30, heads=32, hidden=4096, sequence=1024, stages=8, microbatch_size=3),
    "14.6B": Model(layers=46, heads=40, hidden=5120, sequence=1024, stages=16, microbatch_size=1),
    "28.3B": Model(layers=62, heads=48, hidden=6144, sequence=1024, stages=32, microbatch_size=1),
}

# (model, microbatches) -> Table 6's profiled times.
PROFILED: dict[tuple[str, int], Profiled] = {
    ("1.5B", 24): Profiled(18.522, 18.086, 9.337, 0.601),
    ("1.5B", 32): Profiled(18.513, 18.086, 9.331, 0.626),
    ("1.5B", 64): Profiled(18.546, 18.097, 9.321, 0.762),
    ("6.2B", 24): Profiled(29.718, 29.444, 19.927, 0.527),
    ("6.2B", 32): Profiled(29.802, 29.428, 19.530, 0.577),
    ("6.2B", 64): Profiled(29.935, 29.621, 19.388, 0.535),
    ("14.6B", 48): Profiled(11.347, 11.248, 8.132, 0.377),
    ("14.6B", 64): Profiled(11.307, 11.254, 8.101, 0.379),
    ("14.6B", 128): Profiled(11.325, 11.308, 8.109, 0.378),
    ("28.3B", 96): Profiled(10.419, 10.207, 7.715, 0.408),
    ("28.3B", 128): Profiled(10.408, 10.204, 7.703, 0.408),
    ("28.3B", 256): Profiled(10.402, 10.248, 7.698, 0.460),
}

# (model, microbatches) -> Table 5's bubble rates; p is MODELS[model].stages.
BUBBLES: dict[tuple[str, int], Bubbles] = {
    ("1.5B", 24): Bubbles(0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 32): Bubbles(0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 64): Bubbles(0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 24): Bubbles(0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 32): Bubbles(0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 64): Bubbles(0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 48): Bubbles(0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 64): Bubbles(0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 128): Bubbles(0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 96): Bubbles(0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 128): Bubbles(0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 256): Bubbles(0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
}


class ZBVBubbles(NamedTuple):
    """Table 8 (arXiv version): one setting's published bubble rates."""

    one_f_one_b: float     # 1F1B
    interleaved: float     # 1F1B-I
    zb_h1: float           # ZB-H1
    zb_h2: float           # ZB-H2
    zb_v: float            # ZB-V: two chunks a device in a V, searched at 1F1B's memory


ZB_V_CITATION = 'Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 (v2 onward), section 6.2, Table 8'

# (model, stages, microbatches) -> Table 8's bubble rates (14.6B on 24 GPUs here, not Table 3's 16).
ZB_V_BUBBLES: dict[tuple[str, int, int], ZBVBubbles] = {
    ("6.2B", 16, 48): ZBVBubbles(0.2668, 0.1499, 0.1536, 0.0823, 0.0697),
    ("6.2B", 16, 64): ZBVBubbles(0.2206, 0.1169, 0.1198, 0.0630, 0.0533),
    ("6.2B", 16, 128): ZBVBubbles(0.1390, 0.0621, 0.0637, 0.0325, 0.0274),
    ("14.6B", 24, 72): ZBVBubbles(0.2699, 0.1519, 0.1439, 0.0628, 0.0638),
    ("14.6B", 24, 96): ZBVBubbles(0.2229, 0.1184, 0.1121, 0.0480, 0.0483),
    ("14.6B", 24, 192): ZBVBubbles(0.1403, 0.0630, 0.0595, 0.0247, 0.0250),
    ("28.3B", 32, 96): ZBVBubbles(0.2676, 0.1509, 0.1429, 0.0629, 0.0593),
    ("28.3B", 32, 128): ZBVBubbles(0.2204, 0.1177, 0.1111, 0.0478, 0.0451),
    ("28.3B", 32, 256): ZBVBubbles(0.1362, 0.0626, 0.0593, 0.0251, 0.0236),
}

# Table 8's settings -> the Table 6 setting (model, microbatches) whose times stand in for the
# unprinted ZB-V ones: the same model, the same m where Table 6 has it, else the same m / p.
# They time 1F1B, ZB-H1 and ZB-H2 within 0.004 of Table 8 on 28.3B, 0.013 on 14.6B, 0.023 on
# 6.2B (`python -m benchmarks.schedule_search`).
ZB_V_PROXY: dict[tuple[str, int, int], tuple[str, int]] = {
    ("6.2B", 16, 48): ("6.2B", 24), ("6.2B", 16, 64): ("6.2B", 32), ("6.2B", 16, 128): ("6.2B", 64),
    ("14.6B", 24, 72): ("14.6B", 48), ("14.6B", 24, 96): ("14.6B", 64), ("14.6B", 24, 192): ("14.6B", 128),
    ("28.3B", 32, 96): ("28.3B", 96), ("28.3B", 32, 128): ("28.3B", 128), ("28.3B", 32, 256): ("28.3B", 256),
}

# Table 5's columns that jaxpar's named schedules reproduce: column -> schedule name.
REPRODUCED = {"one_f_one_b": "1f1b", "zb_h1": "zb-h1", "zb_h2": "zb-h2"}
# Table 5's searched columns: column -> the memory limit, in M_B per stage (p M_B, 2p M_B).
SEARCHED = {"zb_1p": 1, "zb_2p": 2}
# The columns as the paper heads them.
LABELS = {"one_f_one_b": "1F1B", "interleaved": "1F1B-I", "zb_h1": "ZB-H1", "zb_h2": "ZB-H2",
          "zb_1p": "ZB-1p", "zb_2p": "ZB-2p"}


def weight_memory(model: str) -> float:
    """M_W / M_B of `model` by Table 1: 32h / (34h + 5as)."""
    m = _model(model)
    return 32 * m.hidden / (34 * m.hidden + 5 * m.heads * m.sequence)


def profiled_costs(model: str, microbatches: int) -> Costs:
    """Table 6's times for (model, microbatches) as `Costs` (memory per Table 1)."""
    _model(model)
    if (model, microbatches) not in PROFILED:
        known = sorted(m for name, m in PROFILED if name == model)
        raise ConfigError(f"microbatches={microbatches}: Table 6 profiles {model} at "
                          f"microbatches {', '.join(map(str, known))} only; use one of them")
    t = PROFILED[model, microbatches]
    return Costs(F=t.F, B=t.B, W=t.W, comm=t.comm, weight_memory=weight_memory(model))


@functools.cache
def reproduced(model: str, microbatches: int) -> dict[str, float]:
    """jaxpar's bubble rates for the Table 5 columns it reproduces, under Table 6's times:
    {"one_f_one_b": ..., "zb_h1": ..., "zb_h2": ...} (unrounded; computed once, then kept)."""
    costs = profiled_costs(model, microbatches)
    p = MODELS[model].stages
    return {column: timed(schedule_lib.make(name, p, microbatches), costs).bubble
            for column, name in REPRODUCED.items()}


def searched(model: str, microbatches: int, *, time_limit: float = 1.0) -> dict[str, float]:
    """The bubble rates of jaxpar's searched orders (`search.search`, seed 0) under Table 5's
    memory limits p M_B (ZB-1p) and 2p M_B (ZB-2p) with Table 6's times:
    {"zb_1p": ..., "zb_2p": ...}."""
    costs = profiled_costs(model, microbatches)
    p = MODELS[model].stages
    return {column: search_lib.search(p, microbatches, costs, per_stage * p, time_limit=time_limit).timing.bubble
            for column, per_stage in SEARCHED.items()}


def zb_v_proxy_costs(model: str, stages: int, microbatches: int, *, chunks: int = 1) -> Costs:
    """The stand-in times of a Table 8 setting (`ZB_V_PROXY`: Table 6's times of the same
    model), per action on one of `chunks` chunks a device (F, B, W divided by `chunks`;
    comm unchanged), with Table 1's M_W / M_B."""
    key = (model, stages, microbatches)
    if key not in ZB_V_PROXY:
        raise ConfigError(f"(model, stages, microbatches)={key}: Table 8's settings are "
                          f"{', '.join(map(str, ZB_V_PROXY))}; use one of them")
    t = PROFILED[ZB_V_PROXY[key]]
    return Costs(F=t.F / chunks, B=t.B / chunks, W=t.W / chunks, comm=t.comm, weight_memory=weight_memory(model))


def table(*, search: bool = False, time_limit: float = 1.0) -> list[dict]:
    """Every Table 5 row: model, p, m, the profiled times, the published rates, and ours
    (the named orders timed; with `search`, also the searched ZB-1p and ZB-2p)."""
    rows = []
    for (model, m), published in BUBBLES.items():
        ours = dict(reproduced(model, m)) | (searched(model, m, time_limit=time_limit) if search else {})
        rows.append({"model": model, "stages": MODELS[model].stages, "microbatches": m,
                     "profiled": PROFILED[model, m]._asdict(), "published": published._asdict(), "ours": ours})
    return rows


def _model(model: str) -> Model:
    if model not in MODELS:
        raise ConfigError(f"model {model!r}: Table 3's models are {', '.join(MODELS)}")
    return MODELS[model]
