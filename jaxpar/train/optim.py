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
            value = errors.number(name, getattr(self, name))
            if value < 0 or (name in ("b1", "b2") and value >= 1) or (name == "lr" and value == 0):
                raise ConfigError(f"{name}={value}: give " + ("0 < lr" if name == "lr" else "0 <= b < 1" if name in
                                                              ("b1", "b2") else f"{name} >= 0"))
        errors.whole("steps", self.steps, maximum=1 << 30)
        errors.whole("warmup", self.warmup, minimum=0, maximum=1 << 30)
        if self.warmup > self.steps:
            raise ConfigError(f"warmup={self.warmup} is longer than steps={self.steps}: use warmup <= steps")

    def schedule(self) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=self.lr, warmup_steps=self.warmup,
            decay_steps=max(self.steps, self.warmup + 1), end_value=self.lr * self.final_ratio)

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
