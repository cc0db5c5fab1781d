"""The optimizer: optax AdamW, linear warm-up then cosine decay, clipping by the global
gradient norm.

    opt = OptimConfig(lr=3e-3, warmup=10, steps=200, clip=1.0)
    tx = opt.transform()                    # optax AdamW (decoupled decay, not on norm gains)
    g = clip(grads, norm, opt.clip)         # grads * min(1, clip / norm)

The norm is the TRUE global norm: on a sharded model every device holds a piece of some
weights and a copy of others, so `global_norm` sums each leaf's squares over exactly the
axes that leaf varies over (its shards) and no others (its copies): sqrt(sum over the
whole model of g^2), the number the unsharded model gets. AdamW is elementwise, so each
device updates its own shards (or, under ZeRO-1, its dp-th of them) with optax as is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxpar import errors
from jaxpar.collectives import varying_axes
from jaxpar.errors import ConfigError

FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)     # a setting past it is inf in a float32 step


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """lr: the peak learning rate, reached after `warmup` steps, then cosine decay to
    lr * final_ratio at `steps`; AdamW's b1, b2, eps, weight_decay (not on the norm
    gains); clip: the global gradient norm clipped to (0: no clipping)."""

    lr: float = 3e-3
    warmup: int = 10
    steps: int = 200
    final_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0

    def __post_init__(self):
        for name in ("lr", "final_ratio", "b1", "b2", "eps", "weight_decay", "clip"):
            rule = "0 < lr" if name == "lr" else "0 <= b < 1" if name in ("b1", "b2") else f"{name} >= 0"
            value = errors.number(name, getattr(self, name), zero=name != "lr", fix=f"give {rule}")
            if name in ("b1", "b2") and value >= 1:
                raise ConfigError(f"{name}={value}: give {rule}")
            if value > FLOAT32_MAX:       # it would become inf in the step, and the weights NaN
                raise ConfigError(f"{name}={value} is not finite in float32 (at most {FLOAT32_MAX:.4g}), the dtype "
                                  f"the step computes in: give {rule}, e.g. {name}={getattr(OptimConfig, name)}")
        errors.whole("steps", self.steps, maximum=1 << 30)
        errors.whole("warmup", self.warmup, minimum=0, maximum=1 << 30)
        if self.warmup > self.steps:
            raise ConfigError(f"warmup={self.warmup} is longer than steps={self.steps}: use warmup <= steps")

    def schedule(self) -> optax.Schedule:
        """The learning rate at a step count: optax.warmup_cosine_decay_schedule's rule and
        operations (linear from 0 to lr over `warmup` steps, then cosine decay to
        lr * final_ratio at `steps`), in JAX's default float dtype. optax computes the
        warm-up in float32 always, so a float64 run's rate would carry float32 rounding,
        and two programs that round one float32 division differently (XLA may emit it
        either way) would train float64 models 1e-9 apart; here float32 runs get optax's
        numbers bit for bit and float64 runs a float64 rate."""
        lr, warmup = self.lr, self.warmup
        decay_steps = max(self.steps, warmup + 1) - warmup
        alpha = (lr * self.final_ratio) / lr                    # optax's end_value / init_value

        def rate(count):
            dtype = jnp.result_type(float)                      # float64 under jax_enable_x64
            count = jnp.asarray(count)
            since = jnp.minimum((count - warmup).astype(dtype), decay_steps)
            cosine = 0.5 * (1 + jnp.cos(jnp.pi * since / decay_steps))
            decayed = lr * ((1 - alpha) * cosine + alpha)
            if not warmup:
                return decayed
            frac = jnp.clip(count, 0, warmup).astype(dtype) / jnp.asarray(warmup, dtype)
            warming = -lr * (1 - frac) + lr
            return jnp.where(count < warmup, warming, decayed).astype(dtype)

        return rate

    def transform(self) -> optax.GradientTransformation:
        """optax.adamw with this schedule; weight decay on all but the norm gains."""
        return optax.adamw(self.schedule(), b1=self.b1, b2=self.b2, eps=self.eps,
                           weight_decay=self.weight_decay, mask=decay_mask)


def decay_mask(params):
    """Decay every weight but the norm gains (by name: any key ending in "norm"), so
    the mask is the same on the reference's dict and on any sharded layout of it."""
    def keep(path, _):
        last = path[-1]
        return not str(getattr(last, "key", getattr(last, "name", last))).endswith("norm")
    return jax.tree_util.tree_map_with_path(keep, params)


def clip(grads, norm, max_norm: float):
    """grads scaled to global norm at most max_norm (optax.clip_by_global_norm's rule)."""
    if not max_norm:
        return grads
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


def global_norm(grads):
    """sqrt(sum of g^2 over the whole model). Outside shard_map: optax.tree.norm. Inside:
    each leaf's local sum of squares is summed over the axes the leaf varies over (its
    shards), so a weight copied on several devices is counted once."""
    total = 0.0
    for g in jax.tree.leaves(grads):
        s = jnp.sum(jnp.square(g))
        axes = _shards(s)
        total = total + (jax.lax.psum(s, axes) if axes else s)
    return jnp.sqrt(total)


def _shards(x) -> tuple[str, ...]:
    """The axes of more than one device x varies over (none outside shard_map)."""
    return tuple(a for a in varying_axes(x) if jax.lax.axis_size(a) > 1)
