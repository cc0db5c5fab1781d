"""Activation memory, term by term (lecture sections 4.2-4.5).

    python examples/04_activation_memory.py

Mirrors the lecture's 04_activation_memory.py, lecture figures beside jaxpar's:
  demo 1  GPT-3 175B's layer (s=2048, h=12288, a=96, b=1), Korthikanti's terms:
          0.86 + 2.01 = 2.87 GB, 275 GB for 96 layers;
  demo 2  the same layer with t = 8: TP, TP + SP, selective and full recompute;
  demo 3  TP + SP at t = 8 as the sequence grows 2K -> 128K: 34sbh/t from 0.11 to 6.85 GB,
          the attention matrix's share from 70% to 99%;
  demo 4  modern blocks (no dropout, SwiGLU, grouped-query, flash attention): Llama 3 405B;
  demo 5  the model against the compiled program on 8 fake CPU devices: one layer's stored
          activations measured from memory_analysis, and the pipeline's in-flight microbatches;
  demo 6  model-state memory and ZeRO 0-3 for Llama 3 405B on TP 8 x PP 16 x DP 128.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

from jaxpar.memory import activations as A  # noqa: E402
from jaxpar.memory import states  # noqa: E402
from jaxpar.memory import verify  # noqa: E402
from jaxpar.pipeline import formulas as pipeline_formulas  # noqa: E402
from jaxpar.planner import catalog  # noqa: E402
from jaxpar.planner.search import block  # noqa: E402

GPT3 = A.Block(hidden=12288, heads=96)
QUADRATIC = ("softmax output", "softmax dropout mask", "dropout output")


def demo_layer():
    print("== demo 1: one GPT-3 175B layer, s=2048 b=1 (16-bit activations, 1-byte masks) ==")
    terms = A.breakdown(GPT3, seq=2048)
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
        print(f"  {what:<34} {A.layer_bytes(GPT3, seq=2048, **kw) / 1e9:6.3f} GB per layer")


def demo_long():
    print("\n== demo 3: TP + SP, t = 8, as the sequence grows ==")
    for s in (2048, 8192, 32768, 131072):
        lin = A.layer_bytes(GPT3, seq=s, tp=8, sp=True, recompute="selective")
        full = A.layer_bytes(GPT3, seq=s, tp=8, sp=True)
        print(f"  s={s:>6}: 34sbh/t {lin / 1e9:5.2f} GB, attention matrix {1 - lin / full:4.0%} of the layer")
    print("  (lecture: 0.11 GB -> 6.85 GB, 70% -> 99%)")


def demo_modern():
    print("\n== demo 4: Llama 3 405B's own layer (no dropout, SwiGLU F=3.25h, 8 KV heads), s=8192, t=8 + SP ==")
    m = catalog.model("llama3-405b")
    for kind in ("gpt", "block"):
        blk = block(m, kind)
        sel = A.layer_bytes(blk, seq=8192, tp=8, sp=True, recompute="selective")
        in_flight = pipeline_formulas.in_flight("1f1b", p=16, m=16)      # 16: p warm-up forwards
        first = A.first_stage_bytes(blk, layers=126, seq=8192, tp=8, sp=True, recompute="selective", pp=16,
                                    in_flight=in_flight)
        print(f"  {kind:<5}: selective {sel / 1e9:.3f} GB per layer; first stage of PP 16 under 1F1B (8 layers x "
              f"{in_flight:g} in flight): {first / 1e9:.0f} GB")
    flash = A.Block(hidden=16384, heads=128, kv_heads=8, ffn=53248, mlp="swiglu", dropout=False, flash=True)
    print(f"  flash attention, no recompute: {A.layer_bytes(flash, seq=8192, tp=8, sp=True) / 1e9:.3f} GB per layer "
          "(no s^2 term: the softmax statistics instead)")


def demo_compiled():
    print("\n== demo 5: the model against the compiled program (f32, B=2, T=256, D=256, 8 heads; every case: "
          "jaxpar verify memory) ==")
    cases = [c for c in verify.CASES if c[0] in ("no parallelism", "TP+SP t=4", "selective recompute")]
    for r in verify.check_memory(cases=cases) + verify.check_pipeline_memory(m=4, seq=64):
        print(f"  {r.name:<48} {'ok' if r.passed else 'FAIL'}  {r.note}")


def demo_states():
    print("\n== demo 6: model states, Llama 3 405B on TP 8 x PP 16 x DP 128, mixed-precision Adam ==")
    m = catalog.model("llama3-405b")
    for zero in (0, 1, 2, 3):
        st = states.state_bytes(dense=m.params, tp=8, pp=16, dp=128, zero=zero)
        print(f"  ZeRO-{zero}: params {st.params / 1e9:5.2f} + grads {st.grads / 1e9:5.2f} + optimizer "
              f"{st.optimizer / 1e9:5.2f} = {st.total / 1e9:5.2f} GB per GPU")


if __name__ == "__main__":
    demo_layer()
    demo_parallel()
    demo_long()
    demo_modern()
    demo_compiled()
    demo_states()
