"""Activation memory, term by term (lecture sections 4.2-4.5, script 04_activation_memory.py).

    python examples/04_activation_memory.py     # 8 fake CPU devices unless XLA_FLAGS says

memory.activations (Korthikanti et al. 2022) prices one layer's stored activations term by
term, under TP, SP and recompute: the lecture's GPT-3 figures, then the model against what
the compiled program keeps, the pipeline's residual slots and ZeRO. Any model, term by term,
and its first pipeline stage: `jaxpar memory --model M [--tp T --sp --pp P ...]`; every case
against the compiled program (TP alone, recompute, the pipeline): `jaxpar verify memory`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import dataclasses  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.memory import activations as A  # noqa: E402
from jaxpar.memory import states, verify  # noqa: E402
from jaxpar.pipeline import formulas as pipeline_formulas  # noqa: E402
from jaxpar.pipeline import plan  # noqa: E402
from jaxpar.planner import catalog  # noqa: E402
from jaxpar.schedules import orders, schedule  # noqa: E402

GPT3 = A.Block(d_model=12288, n_heads=96)          # GPT-3 175B's layer: LayerNorm, GeLU MLP of 4h, dropout
QUADRATIC = ("softmax output", "softmax dropout mask", "dropout output")    # the 5as^2b terms
gb = lambda b: f"{b / 1e9:.3f} GB"

print("== 4.2: one GPT-3 175B layer, s=2048 b=1 (16-bit activations, 1-byte masks) ==")
terms = A.breakdown(GPT3, seq_len=2048)            # [(term, bytes on one device)]
for i in range(0, len(terms), 2):
    print("  " + "   ".join(f"{name:<26} {gb(b)}" for name, b in terms[i:i + 2]))
quad = sum(b for name, b in terms if name in QUADRATIC)
total = sum(b for _, b in terms)
print(f"  34sbh {(total - quad) / 1e9:.2f} + 5as^2b {quad / 1e9:.2f} = {total / 1e9:.2f} GB "
      f"(lecture 0.86 + 2.01 = 2.87 GB); 96 layers {96 * total / 1e9:.0f} GB (lecture 275 GB)")

print("\n== 4.3-4.5: the same layer, t = 8 ==")
for what, kw in [("no parallelism", {}), ("TP: sbh(10 + 24/t + 5as/(ht))", dict(tp=8)),
                 ("TP + SP: sbh/t (34 + 5as/h)", dict(tp=8, sp=True)),
                 ("TP + selective recompute", dict(tp=8, recompute="selective")),
                 ("TP + SP + selective: 34sbh/t", dict(tp=8, sp=True, recompute="selective")),
                 ("TP + SP + full recompute: 2sbh/t", dict(tp=8, sp=True, recompute="full"))]:
    print(f"  {what:<34} {gb(A.layer_bytes(GPT3, seq_len=2048, **kw))} per layer")

print("\n== 5.1: TP + SP, t = 8, as the sequence grows ==")
for s in (2048, 8192, 32768, 131072):
    lin = A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True, recompute="selective")
    full = A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True)
    print(f"  s={s:>6}: 34sbh/t {lin / 1e9:5.2f} GB, attention matrix {1 - lin / full:4.0%} of the layer")
print("  (lecture: 0.11 GB -> 6.85 GB, 70% -> 99%)")

print("\n== modern blocks: Llama 3 405B's own layer (no dropout, SwiGLU, 8 KV heads), s=8192, t=8 + SP ==")
llama = A.Block(d_model=16384, n_heads=128, n_kv_heads=8, d_ff=53248, mlp="swiglu", dropout=False)
sel = A.layer_bytes(llama, seq_len=8192, tp=8, sp=True, recompute="selective")
flash = A.layer_bytes(dataclasses.replace(llama, flash=True), seq_len=8192, tp=8, sp=True)
print(f"  selective recompute {gb(sel)} per layer; flash attention, no recompute: {gb(flash)} (no s^2 term: "
      "the softmax statistics instead)")

# The model against XLA: the temp bytes (memory_analysis) of jit(grad) of a scan over 4 layers
# minus over 2, halved, each layer keeping exactly what Megatron's stores (verify.tagged_block).
cfg, B, T = verify.CFG, 2, 256                     # D=256, 8 heads of 32, GeLU MLP of 1024, no dropout
print(f"\n== the model against the compiled program: one layer, s={T} b={B} h={cfg.d_model} a={cfg.n_heads}, "
      "float32, no dropout: sbh(32 + 2as/h) x 2 bytes ==")
for name, tp, sp in (("no parallelism", 1, False), ("TP + SP, t=4", 4, True)):
    got = verify.measured_layer(cfg, batch_size=B, seq_len=T, tp=tp, sp=sp)
    model = A.layer_bytes(verify.block_of(cfg), seq_len=T, batch_size=B, tp=tp, sp=sp)
    print(f"  {name:<16} per layer {got / 2**20:.2f} MiB compiled, {model / 2**20:.2f} MiB model")

p, m = 4, 8
print(f"\n== the first pipeline stage's microbatches in flight, p={p} m={m}: the model against the residual "
      "slots the runtime's plan allocates ==")
forms = {"one": "1", "all": "m", "p": "p", "2p-1": "2p - 1", "interleaved": "p + (p - 1)/v"}
for name in ("gpipe", "1f1b", "zb-h2", "interleaved", "dualpipe-v"):
    s = schedule.make(name, stages=p, microbatches=m)
    slots = plan.plan(s).n_res                      # each slot holds one chunk's residuals: 1/chunks stage
    model = pipeline_formulas.in_flight(name, p=p, m=m, chunks=s.chunks)
    print(f"  {name:<12} plan slots {slots:>2} of 1/{s.chunks} stage = {slots / s.chunks:g} stages; model "
          f"{forms[orders.REGISTRY[name].in_flight]} = {model:g}  {'ok' if slots / s.chunks == model else 'FAIL'}")

print("\n== model states: Llama 3 405B on TP 8 x PP 16 x DP 128, mixed-precision Adam ==")
for zero in (0, 1, 2, 3):
    st = states.state_bytes(dense=catalog.model("llama3-405b").params, tp=8, pp=16, dp=128, zero=zero)
    print(f"  ZeRO-{zero}: params {st.params / 1e9:5.2f} + grads {st.grads / 1e9:5.2f} + optimizer "
          f"{st.optimizer / 1e9:5.2f} = {st.total / 1e9:5.2f} GB per GPU")

print("\nBad input: sequence parallelism on s=2052 over t=8")
try:
    A.layer_bytes(GPT3, seq_len=2052, tp=8, sp=True)
except ConfigError as e:
    print(f"  ConfigError: {e}")
