"""`jaxpar plan`, `jaxpar memory` and `jaxpar exercise`: tables, --json, one-line errors."""

import json

import pytest

from jaxpar.cli.main import main as cli_main


def run(capsys, *argv):
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_table_and_choice(capsys):
    code, out, _ = run(capsys, "plan", "--top", "3")
    assert code == 0 and "585 configurations, 48 feasible" in out
    assert "planner's choice" in out and "published configuration" in out and "Llama 3 paper" in out


def test_plan_json_and_why(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--gpus", "64", "--tokens", "4M", "--json", "--why")
    data = json.loads(out)
    assert code == 0 and data["choice"]["config"].startswith("tp=1 pp=1 dp=64")
    assert data["rejected"] and all("rejected" in r for r in data["rejected"])


def test_plan_one_config(capsys):
    code, out, _ = run(capsys, "plan", "--config", "tp=8,pp=16,dp=128,recompute=full", "--json")
    data = json.loads(out)
    assert code == 0 and data["m"] == 16 and abs(data["bubble"] - 15 / 31) < 1e-12
    # dp left out: the GPUs tp x pp leave; the labels the table prints (mb=, v=) read back
    code, out, _ = run(capsys, "plan", "--config", "tp=8,pp=16,recompute=full,mb=1,v=2", "--json")
    data = json.loads(out)
    assert code == 0 and data["config"] == "tp=8 pp=16 dp=128 v=2 mb=1 full"


def test_memory_takes_each_schedules_own_chunks(capsys):
    """interleaved without --chunks runs its default 2 chunks: p + (p-1)/v = 23.5 whole
    stages in flight at p = 16, as with --chunks 2 (1F1B: 16)."""
    base = ("memory", "--model", "gpt3-175b", "--tp", "8", "--sp", "--pp", "16", "--microbatches", "64", "--json")
    figures = {}
    for extra in (("--schedule", "interleaved"), ("--schedule", "interleaved", "--chunks", "2"), ()):
        code, out, _ = run(capsys, *base, *extra)
        figures[extra] = json.loads(out)["in_flight"]
    assert list(figures.values()) == [23.5, 23.5, 16.0]


def test_memory_and_exercises(capsys):
    code, out, _ = run(capsys, "memory")
    assert code == 0 and "= 2.87 GB" in out and "96 layers: 275 GB" in out
    code, out, _ = run(capsys, "memory", "--seq", "131072", "--tp", "8", "--sp", "--recompute", "selective", "--json")
    assert code == 0 and round(json.loads(out)["layer_bytes"] / 1e9, 2) == 6.85
    for k, text in ((1, "m >= 63"), (3, "0.94 GB"), (7, "dispatch 462 MB"), (8, "15/47")):
        code, out, _ = run(capsys, "exercise", str(k))
        assert code == 0 and text in out


@pytest.mark.parametrize("argv,message", [
    (("plan", "--gpus", "12"), "--gpus 12 is not a multiple of the 8 h100 per node"),
    (("plan", "--model", "gpt5"), "unknown model 'gpt5'; known:"),
    (("plan", "--gpu", "v100"), "unknown GPU 'v100'; known:"),
    (("plan", "--tokens", "1000"), "not a whole number of 8192-token sequences"),
    (("plan", "--tokens", "lots"), "--tokens 'lots'"),
    (("plan", "--gpus", "8"), "fits no configuration on 8 h100: the closest"),
    (("plan", "--config", "tq=8"), "--config: 'tq=8' is not key=value with a key of tp, pp"),
    (("plan", "--config", "tp=8,tp=4"), "--config: tp is given twice"),
    (("plan", "--config", "tp=x"), "--config tp='x' is not a whole number"),
    (("plan", "--config", "tp=0,pp=16,dp=128"), "tp=0: need at least 1"),
    (("plan", "--config", "tp=3,pp=16"), "tp x pp x cp = 48 does not divide the 16384 GPUs"),
    (("plan", "--tokens", "nan"), "--tokens nan"),
    (("plan", "--tokens", "1e30"), "--tokens 1e+30"),
    (("plan", "--cp", "0"), "--cp 0: context-parallel sizes run from 1 to the 16384 GPUs"),
    (("plan", "--cp", "1,2,x"), "--cp 'x' is not a whole number"),
    (("plan", "--top", "0"), "--top 0: need at least 1"),
    (("memory", "--tp", "7"), "--tp 7 splits neither the 96 heads nor the 96 KV heads"),
    (("memory", "--pp", "200"), "is 200 stages for the 96 layers of gpt3-175b"),
    (("memory", "--pp", "4", "--schedule", "interleaved", "--microbatches", "6"),
     "interleaved needs microbatches a multiple of stages"),
    (("memory", "--pp", "4", "--schedule", "dualpipe-v", "--microbatches", "4"), "--microbatches 4 < 7"),
    (("memory", "--chunks", "2"), "--chunks 2 applies to interleaved only"),
    (("memory", "--seq", "100", "--tp", "8", "--sp"), "--seq 100 is not divisible by tp x cp = 8"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
