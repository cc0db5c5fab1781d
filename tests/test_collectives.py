"""collectives.varying_axes: the one reading of shard_map's varying types."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar.collectives import is_varying, pvary, varying_axes


def test_outside_shard_map_nothing_varies():
    assert varying_axes(jnp.ones(3)) == ()
    assert varying_axes(jax.ShapeDtypeStruct((2,), jnp.float32)) == ()
    assert not is_varying(jnp.ones(3), "dp")


def test_inside_shard_map_the_axes_a_value_varies_over_sorted():
    m = mesh_lib.make_mesh(dp=2, tp=2, cp=2)
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = varying_axes(x), varying_axes(w)
        seen["both"] = varying_axes(pvary(pvary(w, "tp"), "cp"))
        seen["is"] = is_varying(x, "dp"), is_varying(x, "tp")
        return x

    jax.shard_map(body, mesh=m, in_specs=(P("dp"), P()), out_specs=P("dp"))(jnp.ones((4, 2)), jnp.ones(2))
    assert seen == {"x": ("dp",), "w": (), "both": ("cp", "tp"), "is": (True, False)}
