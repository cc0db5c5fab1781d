"""`jaxpar schedule` with measured costs and comm, `--published` (Qi et al.'s Table 5) and
`jaxpar schedule search`: figures as numbers in --json, refusals as one line with exit 2."""

import json

import pytest

from jaxpar.cli.main import main
from jaxpar.schedules import interchange

PAPER = "F=18.522,B=18.086,W=9.337,comm=0.601"   # Qi et al.'s 1.5B model, p=8, m=24 (Table 6)


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("jaxpar schedule: error: "), err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("name,bubble,peak", [("1f1b", 0.2431, 8), ("zb-h1", 0.1585, 8), ("zb-h2", 0.1083, 15)])
def test_timed_costs_give_the_papers_bubble(capsys, name, bubble, peak):
    assert main(["schedule", name, "-p", "8", "-m", "24", "--costs", PAPER]) == 0
    out = capsys.readouterr().out
    assert f"bubble {bubble:.4f}" in out and "timeline is in unit ticks" in out
    assert f"peak activation memory per device (M_B): {peak}," in out
    assert main(["schedule", name, "-p", "8", "-m", "24", "--costs", PAPER, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert round(data["bubble"], 4) == bubble and len(data["peak"]) == 8
    assert all(isinstance(x, float) for x in data["peak"]) and data["peak"][0] == peak
    assert data["timing"]["costs"]["comm"] == 0.601 and data["total_time"] > 0


def test_whole_tick_costs_keep_building_the_table(capsys):
    assert main(["schedule", "zb-h1", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "bubble" not in data and data["costs"] == {"F": 1, "B": 1, "W": 1}


def test_all_with_timed_costs(capsys):
    assert main(["schedule", "--all", "-p", "8", "-m", "24", "--costs", PAPER]) == 0
    out = capsys.readouterr().out
    assert "each order timed with --costs" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[out.splitlines().index(
        next(line for line in out.splitlines() if "peak M_B per device" in line)) + 1:]}
    assert rows["1f1b"] == "24.3%" and rows["zb-h2"] == "10.8%"
    assert main(["schedule", "--all", "-p", "8", "-m", "24", "--costs", PAPER, "--json"]) == 0
    data = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert round(data["zb-h1"]["bubble"], 4) == 0.1585


def test_published_table(capsys):
    assert main(["schedule", "--published"]) == 0
    out = capsys.readouterr().out
    assert "0.2431/0.2431" in out and "0.0257/0.0257" in out and " NO" not in out
    assert out.count(" same") == 12 and "search --published" in out
    assert main(["schedule", "--published", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 12 and rows[0]["published"]["zb_2p"] == 0.0433


def test_search_prints_bubble_memory_time_and_timeline(capsys, tmp_path):
    csv = tmp_path / "s.csv"
    assert main(["schedule", "search", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1,comm=0.1",
                 "--memory", "1.5p", "--csv", str(csv), "--time-limit", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "memory cap 6 M_B" in out and "bubble 0." in out and "peak activation memory per device" in out
    assert "under the same costs: 1f1b" in out and "in unit ticks" in out and "stage 3:" in out
    table = interchange.from_csv(csv.read_text(), microbatches=8)
    assert table.stages == 4
    assert main(["schedule", "search", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1", "--memory", "5",
                 "--time-limit", "0.2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["bubble"], float) and max(data["peak"]) <= 5 + 1e-9
    assert data["memory_cap"] == 5 and data["search_seconds"] >= 0 and data["method"]


def test_search_v_placement(capsys):
    assert main(["schedule", "search", "-p", "4", "-m", "8", "--placement", "v", "--time-limit", "0.2",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chunks"] == 2 and data["placement"] == "v" and max(data["peak"]) <= 4 + 1e-9


@pytest.mark.parametrize("argv,words", [
    (["schedule", "search", "-p", "4", "-m", "8", "--memory", "0.5"], ["--memory 0.5", "smallest feasible cap is 1"]),
    (["schedule", "search", "-p", "4", "-m", "8", "--memory", "lots"], ["--memory 'lots'", "2p"]),
    (["schedule", "search", "-p", "4", "-m", "8", "--placement", "w"], ["--placement 'w'", "'loop', 'v'"]),
    (["schedule", "search", "-p", "4", "-m", "8", "--costs", "F=-1,B=1"], ["F=-1.0", "> 0"]),
    (["schedule", "search", "-p", "4", "-m", "8", "--time-limit", "0"], ["--time-limit 0", "> 0"]),
    (["schedule", "search", "--all"], ["do not apply"]),
    (["schedule", "search", "--csv", "no_such_dir/s.csv"], ["--csv 'no_such_dir/s.csv'", "does not exist"]),
    (["schedule", "1f1b", "--memory", "2p"], ["--memory is an option of `jaxpar schedule search` only"]),
    (["schedule", "1f1b", "--costs", "F=1.5,B=nan"], ["B=nan", "finite"]),
    (["schedule", "1f1b", "--costs", "F=1.5,B=2,X=3"], ["unknown key 'X'"]),
    (["schedule", "1f1b", "-p", "4", "--costs", "F=1/2/3,B=1.5"], ["F has 3 values", "4 model stages"]),
    (["schedule", "1f1b", "--costs", "F=x"], ["write kind=ticks pairs"]),
])
def test_refusals_are_one_line(capsys, argv, words):
    assert main(argv) == 2
    _one_line_error(capsys, *words)
