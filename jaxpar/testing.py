"""How every check is judged: one tolerance rule by dtype, and the Result a check returns.

`tolerance(dtype)` is the one rule: the tests (`assert_close`), the tour and `jaxpar
verify` (`compare`) all hold a sharded result to it against the reference, computed under
`precision_policy()` (float32 matmuls in float32, also on GPUs). A verify function
returns a `Result`: its errors by name, the tolerance they were held to, the measured and
expected collectives as `comms.Collectives`; only the command line formats it (a table
row, or JSON). A check that needs more devices than there are returns `skipped(...)`, a
row that says so, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import comms
from jaxpar import mesh as mesh_lib

# (rtol, atol). float32 sums run in different orders on different shardings; float64
# is the lecture's "below 1e-9" bound with room to spare.
_TOLERANCES = {
    jnp.dtype(jnp.float64): (1e-12, 1e-12),
    jnp.dtype(jnp.float32): (2e-5, 2e-6),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
}


@contextlib.contextmanager
def precision_policy() -> Iterator[None]:
    """Run the enclosed float32 comparisons with float32 matmuls
    (`jax.default_matmul_precision("highest")`), restoring the previous setting after.

    GPUs compute float32 matmuls in TF32 (a 10-bit mantissa, about 5e-4 relative) unless
    told otherwise, which alone puts a sharded result up to 2e-3 away from the reference
    (and changed the compiled memory of one activation-model case on an H200). The
    tolerances are float32's (`tolerance`), so the checks ask for float32 rather than
    loosening the bounds to fit TF32. On CPU, where float32 matmuls are float32 already,
    it changes nothing."""
    with jax.default_matmul_precision("highest"):
        yield


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
    """Trees equal leaf by leaf, each within its expected dtype's tolerance (times
    `scale`); exact for integers."""
    chex.assert_trees_all_equal_structs(actual, expected)
    for (path, b), a in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(actual)):
        rtol, atol = tolerance(jnp.result_type(b))
        chex.assert_trees_all_close(a, b, rtol=rtol * scale, atol=atol * scale,
                                    custom_message=jax.tree_util.keystr(path))


def max_abs_diff(a, b) -> float:
    """Largest |a - b| over all leaves of two trees with the same structure."""
    diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                         if np.size(x) else 0.0, a, b)
    return max(jax.tree.leaves(diffs), default=0.0)


def close(actual, expected, *, scale: float = 1.0) -> bool:
    """assert_close as a verdict: True when the trees agree by the dtype's tolerance."""
    try:
        assert_close(actual, expected, scale=scale)
    except AssertionError:
        return False
    return True


def compare(actual: Mapping, expected: Mapping) -> tuple[dict[str, float], tuple[float, float], bool]:
    """Named outputs against the reference's: ({name: max abs error}, (rtol, atol) of the
    expected dtype, every name within it)."""
    errors = {name: max_abs_diff(actual[name], expected[name]) for name in expected}
    rule = tolerance(_leaf_dtype(list(expected.values())))
    return errors, rule, all(close(actual[name], expected[name]) for name in expected)


def compiled_collectives(compiled, runs=None) -> comms.Collectives:
    """The collectives of a compiled program (`jit(f).lower(...).compile()`); `runs`
    {scope: count} makes guarded collectives exact (`comms.resolve`)."""
    ops = comms.collective_ops_from_hlo(compiled.as_text())
    return comms.nonzero(comms.summarize(comms.resolve(ops, runs) if runs else ops))


def _apply_vjp(vjp, ct):
    """The backward program: the vjp function (a pytree of residuals) applied to ct."""
    return vjp(ct)


def fwd_bwd(fn: Callable, *args, ct):
    """fn(*args) and its gradients for cotangent ct, from two compiled programs (the
    forward, which also returns the residuals the backward needs, and the backward alone:
    jit of the function jax.vjp returns), with the collectives of each: ((out, grads),
    (forward Collectives, backward Collectives)). The forward is jax.vjp(fn) under one
    jit: the vjp function is a pytree (its residuals) that leaves the program, so the
    forward compiles once; saving residuals adds outputs, not collectives."""
    forward = jax.jit(functools.partial(jax.vjp, fn)).lower(*args).compile()
    out, vjp = forward(*args)
    backward = jax.jit(_apply_vjp).lower(vjp, ct).compile()
    return (out, backward(vjp, ct)), (compiled_collectives(forward), compiled_collectives(backward))


def value_and_grads(fn: Callable, *args, ct):
    """(fn(*args), its gradients for cotangent ct) from ONE compiled program: jax.vjp run
    eagerly compiles the linearized forward, then the backward, and an unjitted fn one
    small program per operation."""
    def step(args, ct):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(ct)
    return jax.jit(step)(args, ct)


@dataclasses.dataclass(kw_only=True)
class Run:
    """One step of a sharded program and of the reference on the same inputs, with the
    collectives of the compiled forward and backward and their formulas. A technique's
    run names its outputs (`named`) so that `compared` can hold each to the rule."""

    out: tuple                      # the sharded program's outputs (and gradients)
    ref: tuple                      # the reference's, the same structure
    forward: comms.Collectives      # of the compiled forward
    backward: comms.Collectives     # of the compiled backward (jit of the vjp function)
    formula_forward: comms.Collectives
    formula_backward: comms.Collectives

    def named(self, outputs) -> dict:
        """{name: output} of `out` or `ref`, the names the errors are reported under."""
        raise NotImplementedError

    @functools.cached_property
    def compared(self) -> tuple[dict[str, float], tuple[float, float], bool]:
        """compare() of the named outputs with the reference's."""
        return compare(self.named(self.out), self.named(self.ref))

    @property
    def max_error(self) -> float:
        return max(self.compared[0].values())

    @property
    def collectives_match(self) -> bool:
        return self.forward == self.formula_forward and self.backward == self.formula_backward


def default_mesh(axis: str, *, sizes: tuple[int, ...] = (4, 2)) -> tuple[jax.sharding.Mesh, str]:
    """(dp x `axis` mesh, note) over the devices there are, for a technique's checks: the
    size of `axis` is one of `sizes`, whichever leaves fewer devices out (the larger on a
    tie), dp as many groups as fit, 1 on one device; the note says which devices were left
    out, or that nothing is split."""
    n = len(jax.devices())
    size = max(sizes, key=lambda s: (n // s * s, s)) if n > 1 else 1
    dp = n // size
    m = mesh_lib.make_mesh(dp=dp, **{axis: size}, devices=jax.devices()[:dp * size])
    if size == 1:
        note = f"1 device: {axis}=1, nothing is split"
    elif dp * size < n:
        note = f"{n - dp * size} of {n} devices unused: {axis}={size} groups must fill the mesh"
    else:
        note = ""
    return m, note


def shortfall(*, needs: int, have: int) -> str:
    """'needs 4 devices, this machine has 2': why a check, or a part of one, did not run."""
    return f"needs {needs} devices, this machine has {have}"


def skipped(name: str, *, needs: int, have: int, mesh: str = "-") -> Result:
    """The row of a check that needs more devices than there are: passed and skipped, the
    note saying why; `mesh` is the one it would have run on."""
    return Result(name=name, mesh=mesh, passed=True, skipped=True,
                  note=f"skipped: {shortfall(needs=needs, have=have)}")


def join_notes(*notes: str) -> str:
    """The non-empty notes, joined by '; '."""
    return "; ".join(n for n in notes if n)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Result:
    """What one check found.

    name: what ran ("TP block (Megatron)", "1F1B schedule p=4 m=8").
    mesh: the mesh it ran on, "dp=2 tp=4" ("-" when no devices are involved).
    errors: {what was compared: its error}; for a comparison with the reference the max
      abs difference of that output, otherwise the quantity the note names.
    tolerance: (rtol, atol) the errors were held to (`tolerance(dtype)`), or None when
      the check is exact or of another kind (the note says which).
    measured, expected: {program: Collectives}, what each compiled program ran and what
      its formula says ("step"; or "fwd" and "bwd" when the forward and the backward are
      compiled apart); None when the check runs no program.
    passed: the check's verdict: errors within tolerance and measured == expected.
    skipped: nothing ran, the machine has too few devices (`skipped`); passed then too,
      and the note says how many it needs.
    seconds: wall time, compile included (0: not timed; the runner fills it in).
    note: what the reader should know (the lecture's figure, the inputs, a caveat).
    """

    name: str
    mesh: str = "-"
    errors: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tolerance: tuple[float, float] | None = None
    measured: Mapping[str, comms.Collectives] | None = None
    expected: Mapping[str, comms.Collectives] | None = None
    passed: bool
    skipped: bool = False
    seconds: float = 0.0
    note: str = ""

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def collectives_match(self) -> bool | None:
        """measured == expected, or None when the check has no formula to meet."""
        if self.measured is None or self.expected is None:
            return None
        return dict(self.measured) == dict(self.expected)

    def to_json(self) -> dict:
        return {"name": self.name, "mesh": self.mesh, "errors": dict(self.errors),
                "tolerance": None if self.tolerance is None else {"rtol": self.tolerance[0],
                                                                  "atol": self.tolerance[1]},
                "measured": None if self.measured is None else {k: c.to_json() for k, c in self.measured.items()},
                "expected": None if self.expected is None else {k: c.to_json() for k, c in self.expected.items()},
                "collectives_match": self.collectives_match, "passed": self.passed,
                "skipped": self.skipped, "seconds": self.seconds, "note": self.note}
