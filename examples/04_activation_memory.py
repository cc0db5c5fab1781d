"""Activation memory, term by term (lecture sections 4.2-4.5).

    python examples/04_activation_memory.py

Mirrors the lecture's 04_activation_memory.py, lecture figures beside jaxpar's. Opens
with the technique: the activation model (Korthikanti et al. 2022, term by term) of one
small layer, sbh(32 + 2as/h) without dropout, against what XLA keeps for the backward:
the compiled program's memory_analysis, unsharded and with TP + SP over 4 devices. Then:
  demo 1  GPT-3 175B's layer (s=2048, h=12288, a=96, b=1), Korthikanti's terms:
          0.86 + 2.01 = 2.87 GB, 275 GB for 96 layers;
  demo 2  the same layer with t = 8: TP, TP + SP, selective and full recompute;
  demo 3  TP + SP at t = 8 as the sequence grows 2K -> 128K: 34sbh/t from 0.11 to 6.85 GB,
          the attention matrix's share from 70% to 99%;
  demo 4  modern blocks (no dropout, SwiGLU, grouped-query, flash attention): Llama 3 405B;
  demo 5  the microbatches each schedule keeps in flight on the first stage: the model
          against the residual slots of the runtime's plan;
  demo 6  model-state memory and ZeRO 0-3 for Llama 3 405B on TP 8 x PP 16 x DP 128.
Every case against the compiled program (TP alone, selective and full recompute, plain
autodiff, the pipeline's compiled memory): `jaxpar verify memory`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import dataclasses  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import reference, tensor  # noqa: E402
from jaxpar.memory import activations as A  # noqa: E402
from jaxpar.memory import states  # noqa: E402
from jaxpar.memory import verify  # noqa: E402
from jaxpar.pipeline import formulas as pipeline_formulas  # noqa: E402
from jaxpar.pipeline import plan  # noqa: E402
from jaxpar.schedules import orders, schedule
from jaxpar.planner import catalog  # noqa: E402
from jaxpar.planner.search import block  # noqa: E402

GPT3 = A.Block(d_model=12288, n_heads=96)
QUADRATIC = ("softmax output", "softmax dropout mask", "dropout output")
CFG = verify.CFG                    # D=256, 8 heads of 32, GeLU MLP of 1024, no dropout
B, T = 2, 256                       # float32 activations
# keep exactly the tensors Megatron's layer stores (verify.tagged_block names them), recompute the rest
MEGATRON = jax.checkpoint_policies.save_only_these_names(*verify.SAVED["none"])


def shapes(cfg: reference.ModelConfig) -> dict:
    """reference.init_params(cfg)'s shapes and dtypes: nothing drawn, nothing compiled."""
    return jax.eval_shape(lambda: reference.init_params(jax.random.key(0), cfg))


def stored_per_layer(tp: int, sp: bool) -> float:
    """One layer's stored activations on one device, read from the compiled program: the
    temp bytes (memory_analysis) of jit(grad) of a scan over 4 layers minus over 2, halved
    (the weights, gradients and loss are the same in both and cancel)."""
    layer = jax.checkpoint(partial(verify.tagged_block, cfg=CFG, axis=mesh.TP if tp > 1 else None, sp=sp),
                           policy=MEGATRON)

    def loss(blocks, x):                                # blocks: each weight stacked [L, ...]
        y, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), x, blocks)
        return jnp.sum(y * y)

    grad = jax.grad(loss, argnums=(0, 1))
    if tp > 1:                                          # Megatron's layout, weights [L, ...] split by tp
        m = mesh.make_mesh(tp=tp, devices=jax.devices()[:tp])
        specs = tensor.TPSpecs.megatron(n_kv_heads=CFG.n_kv_heads, tp=tp).params(shapes(CFG)["blocks"])
        specs = {k: P(None, *s) for k, s in specs.items()}
        act = P(None, mesh.TP) if sp else P()           # x [B, T/t, D] per device under SP
        grad = jax.shard_map(grad, mesh=m, in_specs=(specs, act), out_specs=(specs, act))

    def temp_bytes(layers: int) -> int:
        cfg = dataclasses.replace(CFG, n_layers=layers)
        blocks = shapes(cfg)["blocks"]
        x = jax.ShapeDtypeStruct((B, T, CFG.d_model), jnp.float32)
        return jax.jit(grad).lower(blocks, x).compile().memory_analysis().temp_size_in_bytes

    return (temp_bytes(4) - temp_bytes(2)) / 2


def lesson():
    s, b, h, a = T, B, CFG.d_model, CFG.n_heads
    print(f"== one layer's stored activations, s={s} b={b} h={h} a={a}, float32: the model against the compiled "
          "program ==")
    layer = A.Block(d_model=h, n_heads=a, d_ff=CFG.d_ff, dropout=False, act_bytes=4)   # the same layer, for the model
    print(f"  model, no dropout: sbh(32 + 2as/h) bytes at 16 bits, x 2 in float32 = "
          f"{s * b * h * (32 + 2 * a * s / h) * 2 / 2**20:.2f} MiB; TP + SP splits every term t ways")
    for name, tp, sp in (("no parallelism", 1, False), ("TP + SP, t=4", 4, True)):
        model = A.layer_bytes(layer, seq_len=s, batch_size=b, tp=tp, sp=sp)
        print(f"  {name:<16} per layer {stored_per_layer(tp, sp) / 2**20:.2f} MiB compiled, "
              f"{model / 2**20:.2f} MiB model")


def demo_layer():
    print("\n== demo 1: one GPT-3 175B layer, s=2048 b=1 (16-bit activations, 1-byte masks) ==")
    terms = A.breakdown(GPT3, seq_len=2048)
    for name, b in terms:
        print(f"  {name:<28} {b / 1e9:7.3f} GB")
    quad = sum(b for name, b in terms if name in QUADRATIC)
    total = sum(b for _, b in terms)
    print(f"  34sbh {(total - quad) / 1e9:.2f} + 5as^2b {quad / 1e9:.2f} = {total / 1e9:.2f} GB "
          f"(lecture 0.86 + 2.01 = 2.87 GB); 96 layers {96 * total / 1e9:.0f} GB (lecture 275 GB)")


def demo_parallel():
    print("\n== demo 2: the same layer, t = 8 ==")
    for what, kw in [("no parallelism", {}), ("TP: sbh(10 + 24/t + 5as/(ht))", dict(tp=8)),
                     ("TP + SP: sbh/t (34 + 5as/h)", dict(tp=8, sp=True)),
                     ("TP + selective recompute", dict(tp=8, recompute="selective")),
                     ("TP + SP + selective: 34sbh/t", dict(tp=8, sp=True, recompute="selective")),
                     ("TP + SP + full recompute: 2sbh/t", dict(tp=8, sp=True, recompute="full"))]:
        print(f"  {what:<34} {A.layer_bytes(GPT3, seq_len=2048, **kw) / 1e9:6.3f} GB per layer")


def demo_long():
    print("\n== demo 3: TP + SP, t = 8, as the sequence grows ==")
    for s in (2048, 8192, 32768, 131072):
        lin = A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True, recompute="selective")
        full = A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True)
        print(f"  s={s:>6}: 34sbh/t {lin / 1e9:5.2f} GB, attention matrix {1 - lin / full:4.0%} of the layer")
    print("  (lecture: 0.11 GB -> 6.85 GB, 70% -> 99%)")


def demo_modern():
    print("\n== demo 4: Llama 3 405B's own layer (no dropout, SwiGLU F=3.25h, 8 KV heads), s=8192, t=8 + SP ==")
    m = catalog.model("llama3-405b")
    for activation_model in ("gpt", "block"):
        blk = block(m, activation_model)
        sel = A.layer_bytes(blk, seq_len=8192, tp=8, sp=True, recompute="selective")
        in_flight = pipeline_formulas.in_flight("1f1b", p=16, m=16)      # 16: p warm-up forwards
        first = A.first_stage_bytes(blk, n_layers=126, seq_len=8192, tp=8, sp=True, recompute="selective", pp=16,
                                    in_flight=in_flight)
        print(f"  {activation_model:<5}: selective {sel / 1e9:.3f} GB per layer; first stage of PP 16 under 1F1B (8 layers x "
              f"{in_flight:g} in flight): {first / 1e9:.0f} GB")
    flash = A.Block(d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, mlp="swiglu", dropout=False, flash=True)
    flash_layer = A.layer_bytes(flash, seq_len=8192, tp=8, sp=True)
    print(f"  flash attention, no recompute: {flash_layer / 1e9:.3f} GB per layer "
          "(no s^2 term: the softmax statistics instead)")


def demo_pipeline(p=4, m=8):
    print(f"\n== demo 5: microbatches in flight on the first stage, p={p} m={m}: the model against the residual "
          "slots the runtime's plan allocates ==")
    forms = {"one": "1", "all": "m", "p": "p", "2p-1": "2p - 1", "interleaved": "p + (p - 1)/v"}
    for name in ("gpipe", "1f1b", "zb-h2", "interleaved", "dualpipe-v"):
        s = schedule.make(name, stages=p, microbatches=m)
        slots = plan.plan(s).n_res                      # each slot holds one chunk's residuals: 1/chunks stage
        model = pipeline_formulas.in_flight(name, p=p, m=m, chunks=s.chunks)
        form = forms[orders.REGISTRY[name].in_flight]
        print(f"  {name:<12} plan slots {slots:>2} of 1/{s.chunks} stage = {slots / s.chunks:g} stages; model "
              f"{form} = {model:g}  {'ok' if slots / s.chunks == model else 'FAIL'}")


def demo_states():
    print("\n== demo 6: model states, Llama 3 405B on TP 8 x PP 16 x DP 128, mixed-precision Adam ==")
    m = catalog.model("llama3-405b")
    for zero in (0, 1, 2, 3):
        st = states.state_bytes(dense=m.params, tp=8, pp=16, dp=128, zero=zero)
        print(f"  ZeRO-{zero}: params {st.params / 1e9:5.2f} + grads {st.grads / 1e9:5.2f} + optimizer "
              f"{st.optimizer / 1e9:5.2f} = {st.total / 1e9:5.2f} GB per GPU")


if __name__ == "__main__":
    lesson()
    demo_layer()
    demo_parallel()
    demo_long()
    demo_modern()
    demo_pipeline()
    demo_states()
