"""benchmarks/torch_peer.py: jaxpar's weights named and shaped as the torch module's
parameters (no torch needed), the skip without torch, and, where torch is installed,
the tiny model trained side by side on the CPU in float32."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from benchmarks import torch_peer as bench
from jaxpar import reference

TINY = bench.SIZES["tiny"]
GELU_MHA = dataclasses.replace(TINY, cfg=dataclasses.replace(TINY.cfg, mlp="gelu", n_kv_heads=TINY.cfg.n_heads))


def _torch_shapes(cfg: reference.ModelConfig) -> dict[str, tuple]:
    """nn.Linear(in, out).weight is [out, in]; nn.Embedding(V, D).weight [V, D]."""
    D, F, V, NH, KH = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"embed.weight": (V, D), "final_norm": (D,), "unembed.weight": (V, D)}
    for layer in range(cfg.n_layers):
        block = {"attn_norm": (D,), "mlp_norm": (D,), "wq.weight": (NH, D), "wk.weight": (KH, D),
                 "wv.weight": (KH, D), "wo.weight": (D, NH), "w_up.weight": (F, D), "w_down.weight": (D, F)}
        if cfg.mlp == "swiglu":
            block["w_gate.weight"] = (F, D)
        shapes |= {f"blocks.{layer}.{name}": shape for name, shape in block.items()}
    return shapes


@pytest.mark.parametrize("size", [TINY, GELU_MHA], ids=["swiglu-gqa", "gelu-mha"])
def test_every_jaxpar_weight_becomes_a_torch_parameter_of_its_shape(size):
    params = reference.init_params(jax.random.key(0), size.cfg)
    weights = bench.torch_weights(params, size.cfg)
    assert {name: a.shape for name, a in weights.items()} == _torch_shapes(size.cfg)
    assert sum(a.size for a in weights.values()) == sum(a.size for a in jax.tree.leaves(params))
    assert all(a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable for a in weights.values())


def test_each_torch_weight_computes_what_the_jaxpar_weight_does():
    """y = W x of nn.Linear equals the reference's einsum with the same weight, layer 1."""
    cfg = TINY.cfg
    params = jax.tree.map(np.asarray, reference.init_params(jax.random.key(1), cfg))
    weights, b = bench.torch_weights(params, cfg), params["blocks"]
    x, o = np.random.default_rng(0).normal(size=(2, cfg.d_model)), np.random.default_rng(1).normal(
        size=(2, cfg.n_heads, cfg.head_dim))
    np.testing.assert_allclose(x @ weights["blocks.1.wq.weight"].T,
                               np.einsum("bd,dnh->bnh", x, b["wq"][1]).reshape(2, -1), rtol=1e-5)
    np.testing.assert_allclose(x @ weights["blocks.1.wk.weight"].T,
                               np.einsum("bd,dkh->bkh", x, b["wk"][1]).reshape(2, -1), rtol=1e-5)
    np.testing.assert_allclose(o.reshape(2, -1) @ weights["blocks.1.wo.weight"].T,
                               np.einsum("bnh,nhd->bd", o, b["wo"][1]), rtol=1e-5)
    np.testing.assert_allclose(x @ weights["blocks.1.w_gate.weight"].T, x @ b["w_gate"][1], rtol=1e-5)
    np.testing.assert_allclose(x @ weights["unembed.weight"].T, x @ params["unembed"], rtol=1e-5)
    np.testing.assert_array_equal(weights["embed.weight"], params["embed"])
    np.testing.assert_array_equal(weights["blocks.1.mlp_norm"], b["mlp_norm"][1])


def test_without_torch_it_skips_in_one_json_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "torch", None)
    assert bench.main(["--size", "tiny", "--out", str(tmp_path)]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and json.loads(line) == {"skipped": bench.skip_reason(False)}
    assert "torch is not installed" in json.loads(line)["skipped"]
    assert json.loads((tmp_path / "torch_peer.json").read_text()) == json.loads(line)


@pytest.mark.parametrize("size", [TINY, GELU_MHA], ids=["swiglu-gqa", "gelu-mha"])
def test_torch_and_jaxpar_train_the_tiny_model_to_the_same_losses_in_float32(size):
    pytest.importorskip("torch")
    result = bench.compare(size, steps=6, device="cpu")
    assert "error" not in result["jaxpar"] and "error" not in result["torch"], result
    assert len(result["jaxpar"]["losses"]) == len(result["torch"]["losses"]) == 6
    assert result["max_rel_loss_diff"] < 1e-4, (result["jaxpar"]["losses"], result["torch"]["losses"])
    assert result["jaxpar"]["losses"][-1] < result["jaxpar"]["losses"][0]       # it trains
