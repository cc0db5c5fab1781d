"""One tolerance rule for every comparison against the reference, chosen by dtype."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

# (rtol, atol). float32 sums run in different orders on different shardings; float64
# is the lecture's "below 1e-9" bound with room to spare.
_TOLERANCES = {
    jnp.dtype(jnp.float64): (1e-12, 1e-12),
    jnp.dtype(jnp.float32): (2e-5, 2e-6),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
}


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing results computed in `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype not in _TOLERANCES:
        return 0.0, 0.0  # integers and bools: exact
    return _TOLERANCES[dtype]


def _leaf_dtype(tree):
    leaves = jax.tree.leaves(tree)
    return jnp.result_type(*leaves) if leaves else jnp.float32


def assert_close(actual, expected, *, scale: float = 1.0) -> None:
    """Trees equal within the dtype's tolerance (times `scale`); exact for integers."""
    rtol, atol = tolerance(_leaf_dtype(expected))
    chex.assert_trees_all_equal_structs(actual, expected)
    chex.assert_trees_all_close(actual, expected, rtol=rtol * scale, atol=atol * scale)


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over all leaves of two trees with the same structure."""
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                         if np.size(x) else 0.0, a, b)
    return max(jax.tree.leaves(diffs), default=0.0)
