"""benchmarks.gpu on CPU: it says why it skips where there is no GPU, and with --cpu its
rows (a tiny model in place of the GPU sizes) carry every figure the GPU run quotes."""

import json

import pytest

from benchmarks import gpu
from jaxpar import reference

TINY = (reference.ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, mlp="swiglu",
                              rope_theta=1e4, vocab=64), 2, 16, False)


def test_without_a_gpu_it_skips_and_says_why(capsys):
    assert gpu.main(["--quick"]) == 0
    assert "skipped: no GPU" in capsys.readouterr().out


def test_a_cpu_run_writes_every_figure(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu.MODELS, "tiny", TINY)
    assert gpu.main(["--cpu", "--only", "tiny", "--steps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    (row,) = report["rows"]
    for key in ("ms_per_step", "tokens_per_s", "tflops", "mfu", "footprint_gib", "attention", "compile_s"):
        assert key in row, key
    assert row["attention"] == "xla" and row["mfu"] is None          # CPU: no fused kernel, no known peak
    assert len(row["losses"]) == 2 and report["facts"]["platform"] == "cpu"


def test_an_unknown_model_is_refused():
    with pytest.raises(ValueError, match="models are"):
        gpu.main(["--cpu", "--only", "2B"])
