"""benchmarks.attention_gpu on CPU: it skips saying why where there is no GPU, and with
--cpu (the Pallas kernel interpreted) writes a row per implementation, cuDNN's with its
error rather than a crash."""

import json

from benchmarks import attention_gpu


def test_without_a_gpu_it_skips_and_says_why(capsys):
    assert attention_gpu.main([]) == 0
    assert "skipped: no GPU" in capsys.readouterr().out


def test_with_cpu_every_implementation_is_a_row(tmp_path):
    assert attention_gpu.main(["--cpu", "--seq", "64", "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "attention_gpu.json").read_text())["rows"]}
    assert set(rows) == {"whole-xla", "whole-cudnn", "whole-pallas", "ring-xla", "ring-pallas"}
    assert "error" in rows["whole-cudnn"]
    for name in ("whole-xla", "whole-pallas", "ring-xla", "ring-pallas"):
        assert rows[name]["ms"] > 0 and rows[name]["temp_mib"] >= 0, rows[name]
