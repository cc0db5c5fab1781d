"""benchmarks.gpu on CPU: it says why it skips where there is no GPU, and with --cpu its
rows (a tiny model in place of the GPU sizes) carry every figure the GPU run quotes."""

import dataclasses
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


def test_compare_experts_runs_the_moe_again_through_the_kernel(tmp_path, monkeypatch):
    """--compare-experts: a second row of the MoE with expert_kernel="pallas", which on CPU
    is a row saying why it cannot run (the kernel would run interpreted), not a crash."""
    cfg, b, t, recompute = TINY
    moe = (dataclasses.replace(cfg, n_experts=4, top_k=2), b, t, recompute)
    monkeypatch.setitem(gpu.MODELS, "tinymoe", moe)
    assert gpu.main(["--cpu", "--only", "tinymoe", "--steps", "1", "--compare-experts", "tinymoe",
                     "--out", str(tmp_path)]) == 0
    first, again = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    assert first["experts"] == "xla" and again["experts"] == "pallas"
    assert "interpreter" in again["error"]
