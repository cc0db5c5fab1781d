"""The MoE's experts as a grouped-matmul kernel: each expert's rows only, its weights read in place.

    python examples/13_expert_kernel.py                  # CPU: the kernel in Pallas' interpreter
    PYTHONPATH=. python3 examples/13_expert_kernel.py    # on a GPU: the kernel through Triton

  demo 1  the rows each path multiplies at the GPU benchmark's MoE (t = 16384 tokens, 8
          experts, top-2): the padded buffer E*t, the XLA grouped blocks of t*k/2E rows
          (and one copy of an expert's matrix per block), the kernel's 128-row tiles;
  demo 2  one MoE layer, experts by the kernel (MoEOptions(kernel="pallas")), against
          reference.moe: the output and the gradients of x, the router and every expert;
  demo 3  what the trainer runs for its experts (recipe.choose_expert_kernel) on a GPU and
          here, and the one-line refusal where the kernel cannot run.
"""

import jax
import jax.numpy as jnp

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.expert import dispatch, grouped
from jaxpar.expert.verify import moe_inputs
from jaxpar.kernels import grouped as kernel
from jaxpar.testing import precision_policy
from jaxpar.train import ParallelSpec, recipe

PLATFORM = jax.default_backend()


def rows():
    t, E, k = 16384, 8, 2
    print(f"== demo 1: rows per expert matmul at t={t}, E={E}, top-{k} (t*k = {t * k} routed) ==")
    b = grouped.block_rows(t * k, E)
    for name, n in [("padded buffer, C = t", E * t),
                    (f"grouped, XLA blocks of {b}", (t * k + E * (b - 1)) // b * b),
                    (f"grouped, kernel tiles of {kernel.TILE_ROWS}",
                     (t * k + E * (kernel.TILE_ROWS - 1)) // kernel.TILE_ROWS * kernel.TILE_ROWS)]:
        print(f"  {name:<30} at most {n:>6} rows = {n / (t * k):.2f} t*k")


def layer():
    dtype = jnp.bfloat16 if PLATFORM == "gpu" else jnp.float32
    cfg = reference.ModelConfig(n_layers=1, d_model=64, d_ff=128, n_experts=8, top_k=2, mlp="swiglu")
    p, x, dy = moe_inputs(cfg, 2, 256, skew=1.0, dtype=dtype)
    print(f"\n== demo 2: one MoE layer through the kernel ({'Triton' if PLATFORM == 'gpu' else 'interpreted'}, "
          f"{jnp.dtype(dtype).name}) against reference.moe (float32) ==")
    options = dispatch.MoEOptions.of(cfg, kernel="pallas")
    ours = jax.jit(lambda p, x: dispatch.ep_moe_shard(p, x.reshape(-1, 64), axis=None, options=options)[0])
    y, vjp = jax.vjp(ours, p, x)
    got = (y, *vjp(dy.reshape(-1, 64)))
    with precision_policy():
        up = jax.tree.map(lambda a: a.astype(jnp.float32), (p, x, dy))
        y_ref, vjp_ref = jax.vjp(lambda p, x: reference.moe(p, x, top_k=2, mlp="swiglu").reshape(-1, 64), *up[:2])
        want = (y_ref, *vjp_ref(up[2].reshape(-1, 64)))
    names = ["out"] + [f"d{n}" for n in sorted(p)] + ["dx"]
    for name, a, b in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        rel = jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b)
        print(f"  {name:<8} |kernel - reference| / |reference| = {float(rel):.1e}")


def trainer_choice():
    print("\n== demo 3: what the trainer's experts run ==")
    cfg = reference.ModelConfig(d_model=1024, d_ff=2816, n_experts=8, top_k=2)
    for requested, spec, platform in [("auto", ParallelSpec(), "gpu"), ("pallas", ParallelSpec(), "gpu"),
                                      ("pallas", ParallelSpec(tp=2), "gpu"), ("auto", ParallelSpec(ep=2), "gpu"),
                                      ("auto", ParallelSpec(), PLATFORM)]:
        chosen = recipe.choose_expert_kernel(requested, cfg, spec, platform=platform)
        print(f"  {platform} tp={spec.tp} ep={spec.ep} {requested:<6} -> {kernel.describe(chosen, spec.ep)}")
    try:
        recipe.choose_expert_kernel("pallas", cfg, ParallelSpec(ep=2), platform="gpu")
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    rows()
    layer()
    trainer_choice()
