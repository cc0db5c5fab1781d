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
    (("plan", "--config", "tq=8"), "'tq' is not one of tp, pp"),
    (("memory", "--seq", "100", "--tp", "8", "--sp"), "--seq 100 is not divisible by tp x cp = 8"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
