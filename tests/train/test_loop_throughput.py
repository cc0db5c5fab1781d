"""train.throughput: the FLOPs-per-token formula against a count of the reference model's
matmuls, the peak table, MFU, and reading collective time from a profile."""

import dataclasses
import glob
import math
from types import SimpleNamespace

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import mesh, reference
from jaxpar.train import throughput

# a small Llama-style model: grouped-query attention (2 KV heads for 4), SwiGLU, RoPE
CFG = reference.ModelConfig(vocab=48, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=24, n_layers=2,
                            mlp="swiglu", rope_theta=10000.0)
B, T = 2, 8


def dot_flops(jaxpr) -> int:
    """2 x multiply-adds of every dot_general in a jaxpr and the jaxprs inside it (jit,
    custom_jvp, ...; a scan's body `length` times: the reference's layers and experts):
    out elements x contracted size x 2."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracted)
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += times * dot_flops(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += times * dot_flops(sub)
    return total


def forward_loss(params, tokens, cfg):
    return reference.loss(params, tokens, cfg)


@pytest.fixture(scope="module")
def params_and_tokens():
    return reference.init_params(jax.random.key(0), CFG), jnp.zeros((B, T + 1), jnp.int32)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_the_formula_is_the_reference_models_matmuls_exactly(mlp):
    """Forward: 2N + 4·L·N_heads·head_dim·T per token, every dot_general of reference.loss
    counted; a training step (value and gradients): exactly 3 x that, 6N + 12·L·H·Q·T."""
    cfg = dataclasses.replace(CFG, mlp=mlp)
    params, tokens = reference.init_params(jax.random.key(0), cfg), jnp.zeros((B, T + 1), jnp.int32)
    forward = dot_flops(jax.make_jaxpr(forward_loss, static_argnums=2)(params, tokens, cfg).jaxpr)
    assert forward == B * T * throughput.forward_flops_per_token(cfg, T)
    train = dot_flops(jax.make_jaxpr(jax.value_and_grad(forward_loss), static_argnums=2)(params, tokens, cfg).jaxpr)
    assert train == 3 * forward == B * T * throughput.flops_per_token(cfg, T)
    # by hand: per layer wq 16x16, wk and wv 16x8 each, wo 16x16; the MLP 2 or 3 x 16x24; the head 16x48
    mlp_weights = (3 if mlp == "swiglu" else 2) * 16 * 24
    assert throughput.matmul_params(cfg) == 2 * (256 + 2 * 128 + 256 + mlp_weights) + 16 * 48
    assert throughput.attention_flops_per_token(cfg, T) == 4 * 2 * 4 * 4 * T


def test_xla_counts_the_matmuls_plus_some_elementwise_work(params_and_tokens):
    """XLA's cost analysis of the compiled forward (and of the step's value and
    gradients): the formula's matmuls plus the elementwise work it leaves out (norms,
    softmax, RoPE, the loss: about 15% at this tiny width, less at real widths). One
    layer: XLA's cost analysis counts a loop's body once, whatever its trip count, and the
    reference scans its layers (a scan of one step is no loop once compiled)."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    params, tokens = reference.init_params(jax.random.key(0), cfg), params_and_tokens[1]
    fwd = jax.jit(forward_loss, static_argnums=2).lower(params, tokens, cfg).compile().cost_analysis()["flops"]
    expected = B * T * throughput.forward_flops_per_token(cfg, T)
    assert expected <= fwd <= 1.25 * expected, (fwd, expected)
    step = jax.jit(jax.value_and_grad(forward_loss), static_argnums=2).lower(params, tokens, cfg).compile()
    flops, expected = step.cost_analysis()["flops"], B * T * throughput.flops_per_token(cfg, T)
    assert expected <= flops <= 1.25 * expected, (flops, expected)


def test_an_moe_counts_its_top_k_experts_and_the_router():
    moe = dataclasses.replace(CFG, n_experts=8, top_k=2)
    dense = throughput.matmul_params(CFG)
    assert throughput.matmul_params(moe) == dense + 2 * (3 * 16 * 24 + 16 * 8)   # one more expert, the router
    assert throughput.flops_per_token(moe, T) == 6 * throughput.matmul_params(moe) + 12 * 2 * 4 * 4 * T
    assert throughput.matmul_params(dataclasses.replace(moe, top_k=1)) == dense + 2 * 16 * 8


def test_peaks_and_mfu():
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", jnp.bfloat16) == 989e12
    assert throughput.peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert throughput.peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-80GB", jnp.float32) == 156e12      # TF32
    assert throughput.peak_flops("TPU v5 lite", jnp.bfloat16) == 197e12
    assert throughput.peak_flops("TPU v4", jnp.float32) == 275e12
    assert throughput.peak_flops("cpu", jnp.float32) is None                            # never guessed
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", jnp.float64) is None
    assert throughput.mfu(1e6, CFG, T, 8, "cpu", jnp.float32) is None
    assert throughput.format_mfu(None) == "n/a"
    per_token = throughput.flops_per_token(CFG, T)
    value = throughput.mfu(1e9, CFG, T, 4, "NVIDIA H100 80GB HBM3", jnp.bfloat16)
    assert value == pytest.approx(1e9 * per_token / (4 * 989e12))
    assert throughput.format_mfu(0.4123) == "41.2%"


def test_collective_time_from_a_profile(tmp_path):
    """A psum over 4 devices after a matmul, traced: the events named after the
    program's all-reduce are its collective time, a part of the op time."""
    m = mesh.make_mesh(dp=4, devices=jax.devices()[:4])
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x @ x.T, "dp"), mesh=m, in_specs=P("dp"), out_specs=P()))
    x = jnp.ones((64, 64))
    hlo = fn.lower(x).compile().as_text()
    kinds = throughput.instruction_kinds(hlo)
    assert "all-reduce" in kinds.values() and "dot" in kinds.values()
    fn(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            fn(x).block_until_ready()
    (found,) = glob.glob(str(tmp_path / "**" / "*.xplane.pb"), recursive=True)
    measured = throughput.collective_time(found, hlo)
    assert measured is not None and 0 < measured["collective_s"] <= measured["op_s"]
    assert measured["fraction"] == pytest.approx(measured["collective_s"] / measured["op_s"])
    assert throughput.collective_time(found, "HloModule other\n") is None       # nothing of that program


def test_collective_kinds():
    assert throughput.is_collective("all-reduce") and throughput.is_collective("all-gather-start")
    assert throughput.is_collective("collective-permute-done") and not throughput.is_collective("fusion")


def test_only_innermost_events_count():
    """A while loop's event holds its body's ops (on one thread one op runs at a time):
    the loop is left out, the ops inside and after it count; names outside the program
    are not ops of it."""
    def event(name, start, end):
        return SimpleNamespace(name=name, start_ns=start, end_ns=end)
    line = SimpleNamespace(events=[event("while.1", 0, 100), event("dot.2", 10, 40), event("all-reduce.3", 40, 90),
                                   event("Rendezvous", 50, 60), event("add.4", 120, 130)])
    kinds = {"while.1": "while", "dot.2": "dot", "all-reduce.3": "all-reduce", "add.4": "add"}
    assert throughput._innermost(line, kinds) == [(10, 40, "dot"), (40, 90, "all-reduce"), (120, 130, "add")]
