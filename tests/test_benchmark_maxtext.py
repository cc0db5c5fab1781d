"""benchmarks/maxtext.py without MaxText: the model and meshes it asks MaxText for, the
log lines it reads back, and the table it prints (no MaxText run, no compile)."""

import math

import jax
import pytest

from benchmarks import maxtext as bench
from jaxpar import reference

# as MaxText 0.2.5 prints them (common/metric_logger.py, utils/max_utils.py)
LOG = """\
I1202 07:01:02.000 train.py:1030] compiled memory [train]: 123456789 bytes
I1202 07:01:02.000 max_utils.py:823] [train] Total estimated memory size: 0.1 GB, estimated output size: 0.0 GB
I1202 07:01:10.500000 1 metric_logger.py:265] completed step: 0, seconds: 9.123, TFLOP/s/device: 0.001, Tokens/s/device: 100.000, total_weights: 2048, loss: 6.250, lm_loss: 6.250, perplexity: 518.000
I1202 07:01:14.000000 1 metric_logger.py:265] completed step: 2, seconds: 1.500, TFLOP/s/device: 0.010, Tokens/s/device: 200.000, total_weights: 2048, loss: 5.000, lm_loss: 5.000, perplexity: 148.000
I1202 07:01:12.000000 1 metric_logger.py:265] completed step: 1, seconds: 2.000, TFLOP/s/device: 0.010, Tokens/s/device: 200.000, total_weights: 2048, loss: 5.500, lm_loss: 5.500, perplexity: 244.000
I1202 07:01:15.500000 1 metric_logger.py:265] completed step: 3, seconds: 1.250, TFLOP/s/device: 0.010, Tokens/s/device: 200.000, total_weights: 2048, loss: 4.500, lm_loss: 4.500, perplexity: 90.000
"""


def _keys(args: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in args)


def _param_count(cfg: reference.ModelConfig) -> int:
    shapes = jax.eval_shape(lambda: reference.init_params(jax.random.key(0), cfg))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))


def test_the_large_size_has_4x_the_parameters():
    default, large = (_param_count(bench.SIZES[s]) for s in ("default", "large"))
    assert default == 4_196_608 and large == 16_781_824
    assert large / default == pytest.approx(4, rel=0.01)


@pytest.mark.parametrize("mesh", bench.MESHES, ids=lambda m: m.name)
def test_maxtext_gets_the_same_model_batch_and_mesh(mesh):
    keys = _keys(bench.maxtext_args(mesh, "default", steps=10, run_name="r", output_dir="/tmp/o"))
    cfg = bench.model_config("default", mesh.moe)
    assert keys["decoder_block"] == ("mixtral" if mesh.moe else "llama2")
    assert (keys["base_emb_dim"], keys["base_num_query_heads"], keys["base_num_kv_heads"], keys["head_dim"],
            keys["base_mlp_dim"], keys["base_num_decoder_layers"], keys["vocab_size"]) == tuple(
        str(v) for v in (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_layers, cfg.vocab))
    assert int(keys["per_device_batch_size"]) * bench.DEVICES == bench.BATCH
    assert keys["max_target_length"] == str(bench.SEQ) and keys["steps"] == "10"
    assert keys["dtype"] == keys["weight_dtype"] == "float32" and keys["hardware"] == "cpu"
    assert float(keys["normalization_layer_epsilon"]) == cfg.norm_eps
    assert float(keys["learning_rate"]) == bench.optim_config(10).lr
    # every MaxText mesh axis is given, and their product is the device count
    ici = {k: int(v) for k, v in keys.items() if k.startswith("ici_")}
    assert len(ici) == 6 and math.prod(ici.values()) == bench.DEVICES
    # the same split as jaxpar's: dp (or fsdp for ZeRO-3), tp, pp, cp, ep
    sizes = mesh.jaxpar
    zero3 = sizes.get("zero") == 3
    assert ici["ici_fsdp_parallelism"] == (sizes["dp"] if zero3 else 1)
    assert ici["ici_data_parallelism"] == (1 if zero3 else sizes.get("dp", 1))
    for axis, key in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        assert ici[f"ici_{key}_parallelism"] == sizes.get(axis, 1)
    if sizes.get("pp", 1) > 1:    # the same placement: MaxText's layers per stage = jaxpar's per chunk
        chunks = sizes.get("chunks") or 1
        assert int(keys["num_layers_per_pipeline_stage"]) * sizes["pp"] * chunks == cfg.n_layers
        assert int(keys["num_pipeline_microbatches"]) == sizes["microbatches"]
    if mesh.moe:
        assert (int(keys["num_experts"]), int(keys["num_experts_per_tok"])) == (cfg.n_experts, cfg.top_k) == (8, 2)
        assert keys["base_moe_mlp_dim"] == keys["base_mlp_dim"] and float(keys["capacity_factor"]) < 0


def test_jaxpar_optimizer_follows_maxtexts_schedule():
    optim = bench.optim_config(40)
    assert (optim.lr, optim.warmup, optim.steps, optim.final_ratio) == (3e-3, 4, 40, 0.1)
    assert (optim.b1, optim.b2, optim.eps, optim.weight_decay, optim.clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)


def test_parse_maxtext_log_reads_steps_in_order_and_exact_memory():
    parsed = bench.parse_maxtext_log(LOG)
    at = 7 * 3600 + 60
    assert parsed == {"seconds": [9.123, 2.0, 1.5, 1.25], "losses": [6.25, 5.5, 5.0, 4.5],
                      "logged_at": [at + 10.5, at + 12.0, at + 14.0, at + 15.5], "memory_bytes": 123456789}
    assert bench.steady_ms([parsed["seconds"]]) == pytest.approx(1375.0)
    assert bench.log_intervals(parsed["logged_at"]) == pytest.approx([0.0, 1.5, 2.0, 1.5])
    assert bench.log_intervals([86399.5, 0.5]) == pytest.approx([0.0, 1.0])        # past midnight
    assert bench.log_intervals([1.0, None]) == []


def test_parse_maxtext_log_falls_back_to_maxtexts_gb_and_to_nothing():
    without_bytes = "\n".join(line for line in LOG.splitlines() if "bytes" not in line)
    assert bench.parse_maxtext_log(without_bytes)["memory_bytes"] == round(0.1 * 2 ** 30)
    assert bench.parse_maxtext_log("nothing here") == {"seconds": [], "losses": [], "logged_at": [],
                                                       "memory_bytes": None}


def test_last_error_line_names_the_error():
    text = "starting\nTraceback (most recent call last):\n  File x\nValueError: mesh axes do not divide 4\n\n"
    assert bench.last_error_line(text) == "ValueError: mesh axes do not divide 4"
    assert bench.last_error_line("a\nlast words\n") == "last words"
    assert bench.last_error_line("") == "no output"
    assert len(bench.last_error_line("Error: " + "x" * 500)) == 160


def test_a_failing_side_shows_in_its_cell_and_the_table_goes_on():
    good = bench.Run(seconds=[5.0, 3.0, 1.0, 2.0, 3.0], losses=[6.2, 6.0], memory_bytes=3 * 2 ** 20)
    failed = bench.Run(error="ValueError: no")
    rows = [bench.row("dp8", [good], [good]), bench.row("tp8", [failed], [good]),
            bench.row("fsdp8 / ZeRO-4", [good], [bench.Run(error="failed: zero=4: one of 0, 1, 2, 3")])]
    assert rows[0]["MaxText ms"] == rows[0]["jaxpar ms"] == 2000.0 and rows[0]["jaxpar / MaxText"] == 1.0
    assert rows[1]["MaxText ms"] == "failed: ValueError: no" and rows[1]["jaxpar / MaxText"] is None
    assert rows[2]["jaxpar ms"] == "failed: zero=4: one of 0, 1, 2, 3"
    table = bench.markdown(rows).splitlines()
    assert len(table) == 5
    assert table[2] == "| dp8 | 2000.0 | 2000.0 | 1.00 | 6.200 / 6.200 | 3.0 / 3.0 |"
    assert table[3] == "| tp8 | failed: ValueError: no | 2000.0 | n/a | n/a / 6.200 | n/a / 3.0 |"


@pytest.mark.parametrize("mesh", bench.MESHES, ids=lambda m: m.name)
def test_jaxpar_takes_every_mesh_maxtext_is_run_on(mesh):
    assert bench.jaxpar_unavailable(mesh) is None


def test_a_mesh_jaxpar_refuses_shows_its_reason_in_the_row():
    refused = bench.Mesh("fsdp8 / ZeRO-4", {"dp": 8, "zero": 4}, {})
    reason = bench.jaxpar_unavailable(refused)
    assert reason.startswith("failed: ") and "zero=4" in reason
    run = bench.run_jaxpar(refused, "default", steps=2, workdir="/nonexistent", round_index=0)
    assert run.error == reason and not run.seconds


def test_without_maxtext_it_says_how_to_install_and_exits_0(tmp_path, capsys):
    assert bench.main(["--maxtext-venv", str(tmp_path / "absent")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "skipped" in out[0] and "pip install" in out[0] and "maxtext[tpu]==0.2.5" in out[0]
