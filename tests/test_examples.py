"""Every example runs to the end in a fresh process and prints the figures it promises.

The examples are the documentation people run first; this keeps them from rotting.
Each runs as a user would (`python examples/NN_*.py`), with its own fake CPU devices.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import child_env

EXAMPLES = Path(__file__).parent.parent / "examples"

# "= formula", never "!= formula"
FORMULA = re.compile(r"(?<!!)= formula")
# example -> what its output must contain: substrings, or (regex, how many lines match it)
EXPECTED = {
    "00_foundations.py": ["8 cpu devices", "= parameter bytes 70272: True", "n_kv_heads=0: need at least 1",
                          "head_dim='4' is a str", "costs=[1, 2] is a list, not a mapping",
                          "stages=999999999 is more than 1,024", "passed=True, collectives match the formula: True"],
    "01_pipeline_schedules.py": ["27.3% = (p-1)/(m+p-1) = 27.3%", "(lecture [4, 3, 2, 1])",
                                 (re.compile(r"timeline identical to the lecture's"), 3), "lecture: m >= 63",
                                 "(lecture 64/64); 1F1B 8/1 (lecture 8/1)", "= (p-1)/(6m+p-1) = 5.9%",
                                 "ConfigError: interleaved needs microbatches a multiple of stages"],
    "02_pipeline_parallel.py": ["m=8: max |pipeline - single device|", "29 carrying all 48", "33.1 (1.00x)",
                                "ConfigError: 6 layers do not split",
                                # demo 1: m = 1, 4, 8 each below 1e-9; demo 2: 7 schedules' plans, carrying
                                # 2m(pv-1) sends (interleaved, v=2) and 2m(2p-2) (the V), the V executed = plan
                                (re.compile(r"^  m=[148]: max .* \(lecture: below 1e-9\)  ok$", re.M), 3),
                                (re.compile(r"^  \S+ +\d+ +\d+ carrying all \d+ +sends", re.M), 7),
                                "36 carrying all 112 sends", "78 carrying all 96  sends",
                                "compiled collective-permutes 78 = plan 78  ok"],
    "03_tensor_parallel.py": [(FORMULA, 6), "lecture: 0.82", "never gathered",
                              # TP and SP: tp_block's output against reference.block, float32
                              (re.compile(r"max diff vs reference\.block: output \d\.\de-0[5-9]"), 2),
                              "ConfigError: sequence length T=15 is not divisible by tp=4"],
    "04_activation_memory.py": ["(lecture 0.86 + 2.01 = 2.87 GB); 96 layers 275 GB (lecture 275 GB)",
                                "(lecture: 0.11 GB -> 6.85 GB, 70% -> 99%)", "12.00 MiB compiled, 12.00 MiB model",
                                "3.00 MiB compiled, 3.00 MiB model", "ZeRO-3: params  0.05",
                                "ConfigError: seq_len=2052 is not divisible by tp x cp = 8",
                                # five schedules, the plan's residual slots = the in-flight model
                                (re.compile(r"^  \S+ +plan slots .* = (\S+) stages; model .* = \1  ok$", re.M), 5)],
    "05_context_parallel.py": ["o 25.75", (FORMULA, 3), "contiguous 1.60, zigzag 1.00",
                               # ring attention in float64 against the reference: rounding only
                               (re.compile(r"f64 max \|ring - full\| .* \d\.\de-1[4-7] \(lecture 1\.1e-15\)"), 1),
                               "4 A2A", "ConfigError: seq_len=30 is not divisible by 8"],
    "06_expert_parallel.py": ["(lecture: about 1e-7); dropped 0%", (FORMULA, 1), "busiest rank works", "dropped 36.9%",
                              "dispatch 462 MB (lecture about 462 MB); forward 0.92 GB", "1.85 GB (1.85 GB)",
                              "ConfigError: n_experts=6 is not divisible by ep=4"],
    "07_parallel_planner.py": ["= 32 microbatches per pipeline", "= 74.8 GB of 80 GB", "DP 0.12 s = 8.95 s",
                               "(lecture: t = p = 1, all data parallel", "bubble 48.4% (lecture: near 50%)",
                               "m >= 63", "dispatch 462 MB", "15/47", "ConfigError: gpus=12"],
    "08_train_4d.py": ["(2) n_layers=6", "(5) n_kv_heads=3", "P('pp', 'ep', None, 'tp')",
                       "train dp2 x pp2 x tp2 1f1b, 10 steps: max relative error of the losses and gradient norms",
                       "(tolerance 2e-05): ok", "collectives = the formulas",
                       "restored on pp4 x tp2 1f1b: parameters, AdamW moments and step equal to the saved ones, bit "
                       "for bit: ok",
                       # demo 4: each spec's collectives = the formulas; dots cuts the pipeline's temporaries
                       # from 447 KiB to 157; ZeRO-3 stores the weights as their dp-th
                       (re.compile(r"^  \S.* weights\+state .* KiB; collectives = the formulas: ok$", re.M), 4),
                       (re.compile(r"^  dp2 x pp2 x tp2 1f1b recompute dots +weights\+state \S+ KiB, "
                                   r"temporaries +1[0-9]{2} KiB", re.M), 1),
                       # ZeRO-3, 4 layers: gathered once in F and once in B each, the embedding
                       # once, the head twice (its loss's backward reads the unembedding); one
                       # reduce-scatter each
                       "30 weights stored as their dp-th; one step compiles 11 all-gathers and 6 reduce-scatters",
                       (re.compile(r"^  ZeRO-3, 3 steps against the unsharded model: max relative error \S+ "
                                   r"\(tolerance 2e-05\): ok$", re.M), 1)],
    "09_multihost.py": ["all processes agree with the reference", "(tolerance 1e-05)",
                        (re.compile(r"^process [01]: 4 local of 8 devices, train dp2 x pp2 x tp2 1f1b, 2 processes: "
                                    r"losses( \d\.\d{7}){10}$", re.M), 2),
                        "10 training steps: 2 processes = 1 device (reference_trainer)"],
    "10_schedule_search.py": ["against 1F1B 0.2863 and ZB-H1 0.1950  ok", "smallest feasible cap is 1 M_B",
                              (re.compile(r"^  cap \d M_B: bubble 0\.\d{4}, peak memory \d\.\d\d M_B", re.M), 2),
                              (re.compile(r"^  .*: max \|pipeline - single device\| over loss, dx, all weights = "
                                          r"\S+  ok$", re.M), 2)],
    "11_train_on_text.py": ["4 cpu devices", "validation tokens (uint16), vocab 512",
                            "from a fresh TokenData: the same tokens: ok",
                            (re.compile(r"^  step +\d+: training loss \d\.\d+ .*, validation loss \d\.\d+$", re.M), 3),
                            "training and validation losses fell by more than 1 nat from the first step's: ok",
                            "prompt 'The return value of', 40 tokens on: "],
    "12_attention_kernel.py": ["gpu bfloat16 head_dim 128  auto -> cudnn", "gpu float32  head_dim 128  auto -> xla",
                               "ConfigError: attention_kernel='cudnn' cannot run here: dtype float32",
                               "dV: |xla - reference| / |reference| = 0.0e+00", "the flash model's statistics",
                               "bfloat16 layers on cpu: xla attention (T x T scores; a ring's blocks key chunk by key chunk)",
                               "gpu bfloat16 auto -> xla, pallas -> pallas", "zigzag, float32: max |ring - reference| = "],
    "13_expert_kernel.py": ["grouped, XLA blocks of 2048    at most  47104 rows = 1.44 t*k",
                            "grouped, kernel tiles of 128   at most  33664 rows = 1.03 t*k",
                            (re.compile(r"^  (out|drouter|dw_down|dw_gate|dw_up|dx) +\|kernel - reference\| / "
                                        r"\|reference\| = \d\.\de-0[6-9]$", re.M), 6),
                            "gpu tp=1 ep=1 pallas -> grouped, pallas kernel (128-row tiles, weights read in place)",
                            "ConfigError: expert_kernel='pallas' cannot run here: the kernel runs the grouped experts"]
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("[0-9][0-9]_*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name):
    # The example's own device count (no inherited --xla_force_host_platform_device_count), and
    # the test session's compile flags (conftest.py FAST_COMPILE: code generation only; the HLO
    # passes, hence every collective and buffer an example prints, are unchanged).
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True,
                          timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for expected in EXPECTED[name]:
        if isinstance(expected, tuple):
            pattern, lines = expected
            assert len(pattern.findall(out)) == lines, f"{name}: {lines} lines should match {pattern.pattern!r}:\n{out}"
        else:
            assert expected in out, f"{name} did not print {expected!r}:\n{out[-3000:]}"
    # no verdict failed: "FAIL" ("FAILED") and "!= formula" are how the examples say so
    assert "FAIL" not in out and "!= formula" not in out, f"{name}:\n{out}"
