"""benchmarks.expert_gpu on CPU: it skips saying why where there is no GPU, and with --cpu
(the grouped kernel interpreted, at a small size) writes a row per implementation."""

import json

from benchmarks import expert_gpu


def test_without_a_gpu_it_skips_and_says_why(capsys):
    assert expert_gpu.main([]) == 0
    assert "skipped: no GPU" in capsys.readouterr().out


def test_with_cpu_every_implementation_is_a_row(tmp_path):
    assert expert_gpu.main(["--cpu", "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "expert_gpu.json").read_text())["rows"]}
    assert set(rows) == {"padded", "grouped-xla", "grouped-pallas"}
    for row in rows.values():
        assert "error" not in row and row["ms"] > 0 and row["temp_mib"] >= 0, row
