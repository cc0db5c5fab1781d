"""Megatron tensor and sequence parallelism (lecture sections 3 and 4.4, script 03_tensor_parallel.py).

    python examples/03_tensor_parallel.py     # 8 fake CPU devices (dp=2 x tp=4) unless XLA_FLAGS says

tensor.tp_block runs the attention + MLP block split over tp, without and with sequence
parallelism (the lecture's demos 1 and 3), checked against reference.block, its compiled
collectives against the formulas; then the counterexample, the vocabulary-parallel LM head, a
refused input. The same as one table: `jaxpar verify tp|sp`; the whole model (tensor.tp_loss)
against reference.loss: tests/tensor/test_tensor.py.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import comms, reference, tensor  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.testing import fwd_bwd, max_abs_diff  # noqa: E402


@partial(jax.jit, static_argnums=3)
def reference_step(p, x, dy, cfg):
    """One device: reference.block, and the gradients of <y, dy> by jax.vjp."""
    y, vjp = jax.vjp(lambda p, x: reference.block(p, x, cfg), p, x)
    return y, vjp(dy)


def against(name, got, want, note=""):
    """One compiled program's collectives against the closed form."""
    print(f"  {name:11s}: {comms.format_stats(got)}  {'= formula' if got == want else '!= formula'}  {note}".rstrip())


tp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
dp = n // tp
m = mesh.make_mesh(dp=dp, tp=tp)                    # 8 devices: dp=2 x tp=4
cfg = reference.ModelConfig(n_layers=1, n_heads=8, n_kv_heads=8, d_model=64, head_dim=8, d_ff=256, vocab=64 * tp)
B, T = 2 * dp, 16
rng = np.random.default_rng(0)                      # inputs drawn with numpy: no RNG kernel to compile
normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
p = reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0)
# wq [D, N, H] = [64, 8, 8] and w_up [D, F] = [64, 256] split by columns: [64, 8/t, 8] and [64, 256/t]
# per device; wo [8, 8, 64] and w_down [256, 64] by rows; the norm gains replicated
x = normal(B, T, cfg.d_model)                       # [B, T, D]; [B/dp, T, D] per device ([B/dp, T/t, D] under SP)
dy = normal(B, T, cfg.d_model) / (B * T)            # the cotangent of a mean loss
y_ref, (g_ref, dx_ref) = reference_step(p, x, dy, cfg)
kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp, tp=tp)
print(f"{n} devices, mesh {mesh.describe(m)}; block D={cfg.d_model} N={cfg.n_heads} F={cfg.d_ff}, B={B} T={T}")

b = B // dp                                         # the local batch: s = T, h = D below
notes = {False: f"lecture: 2 all-reduces of s*d each way; here 2*b*s*h = {2 * b * T * cfg.d_model} elements "
                "each way (the backward also all-reduces the param gradients over dp)",
         True: "an all-gather + a reduce-scatter move the bytes of one all-reduce: SP sends no more than TP "
               "(the norm gains' gradients all-reduced over tp)"}
colls = {}
for sp, title in ((False, f"{tp}-way tensor parallel: f and g, 2 all-reduces each way"),
                  (True, "+ sequence parallel: all-gather + reduce-scatter instead, the norms on T/t tokens")):
    print(f"\ntensor.tp_block, {title}")
    (y, (g, dx)), colls[sp] = fwd_bwd(partial(tensor.tp_block, mesh=m, cfg=cfg, sequence_parallel=sp), p, x, ct=dy)
    print(f"  max diff vs reference.block: output {max_abs_diff(y, y_ref):.1e}, input grad "
          f"{max_abs_diff(dx, dx_ref):.1e}, every param grad {max_abs_diff(g, g_ref):.1e} (lecture: about 1e-6)")
    for part, got in zip(("forward", "backward"), colls[sp]):
        against(f"{'SP' if sp else 'TP'} {part}", got,
                tensor.tp_block_collectives(**kw, sequence_parallel=sp, backward=part == "backward"))
    print(f"  {notes[sp]}")
ring = tensor.ring_bytes_per_device(cfg=cfg, batch_size=b, seq_len=T, dtype=jnp.float32, tp=tp)
dp_bytes = tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=tp) if dp > 1 else 0
tp_ar = sum(c["all-reduce"][1] for c in colls[False]) - dp_bytes     # TP's all-reduced bytes, dp's left out
print(f"\nPer-device ring traffic per layer, 8*b*s*h*(t-1)/t = {ring / 4:.0f} elements; measured: TP all-reduce "
      f"bytes x 2(t-1)/t = {tp_ar * 2 * (tp - 1) / tp / 4:.0f} elements")

print("\nCounterexample: split A by rows, GeLU of the partial sums")
print(f"  max |sum_i GeLU(X_i A_i) - GeLU(XA)| = {tensor.row_split_gelu_error(mesh=m):.2f}   (lecture: 0.82 for "
      "its setup): GeLU(a + b) != GeLU(a) + GeLU(b), so row-splitting A needs an all-reduce before GeLU")

V = cfg.vocab
print(f"\ntensor.vocab_parallel_lm_loss: unembed[D, V/t] per device, V={V}; the logits [B, T, V/t] are never gathered")
gain = 1 + 0.1 * normal(cfg.d_model)                        # final_norm [D]
unembed = normal(cfg.d_model, V) / cfg.d_model ** 0.5       # [D, V]: [D, V/t] per device
targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
(loss, grads), (fwd, bwd) = fwd_bwd(lambda *a: tensor.vocab_parallel_lm_loss(*a, targets, mesh=m, cfg=cfg),
                                    x, gain, unembed, ct=jnp.float32(1.0))
ref = jax.jit(jax.value_and_grad(reference.lm_head_loss, argnums=(0, 1, 2)))(x, gain, unembed, targets)
print(f"  loss {float(loss):.4f}; loss and dL/dx, dL/dfinal_norm, dL/dunembed vs cross_entropy(rms_norm(x) "
      f"@ unembed): max diff {max_abs_diff((loss, grads), ref):.1e}")
against("forward", fwd, tensor.lm_loss_collectives(**kw), "(the max, then sum exp + target logit, [b, T] each)")
against("backward", bwd, tensor.lm_loss_collectives(**kw, backward=True), "(f: dL/dz over tp; grads over dp)")
print(f"  the full logits would be {comms.human_bytes(B * T * V * 4)}; each device holds 1/{tp} of them")

print(f"\nBad input: sequence parallel on T=15 tokens over tp={tp}")
try:
    tensor.tp_block(p, x[:, :15], mesh=m, cfg=cfg, sequence_parallel=True)
except ConfigError as e:
    print(f"  ConfigError: {e}")
