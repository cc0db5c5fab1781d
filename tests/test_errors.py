"""Every refusal is a ConfigError (a ValueError) naming the value, the constraint and a fix,
raised before any compute: the shared checks of jaxpar.errors, then the class of bad input
each entry point meets, and property tests that throw junk at the pure-Python builders
(anything that is not built must be refused with a ConfigError, never another error)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar import errors, mesh, reference
from jaxpar.errors import ConfigError
from jaxpar.pipeline import formulas
from jaxpar.schedules import orders, schedule

JUNK = st.one_of(st.integers(-3, 12), st.floats(allow_nan=True), st.text(max_size=3), st.booleans(), st.none(),
                 st.just([1, 2]), st.just(np.int64(4)), st.just(4.0))


def test_config_error_is_a_value_error_and_schedule_error_is_one():
    assert issubclass(ConfigError, ValueError) and issubclass(schedule.ScheduleError, ConfigError)


@pytest.mark.parametrize("value, match", [
    (True, "n=True is a bool, not a whole number"), (2.0, "n=2.0 is a float"), ("8", "n='8' is a str"),
    (0, "n=0: need at least 1; use n=1 or more"), (10**9, "n=1000000000 is more than 100"),
])
def test_whole(value, match):
    with pytest.raises(ConfigError, match=match):
        errors.whole("n", value, maximum=100)


def test_whole_accepts_numpy_integers_and_returns_an_int():
    got = errors.whole("n", np.int32(4))
    assert got == 4 and type(got) is int


def test_number_flag_one_of_mapping_divisible():
    with pytest.raises(ConfigError, match="eps=True is not a real number"):
        errors.number("eps", True)
    with pytest.raises(ConfigError, match="eps=0: must be > 0"):
        errors.number("eps", 0)
    with pytest.raises(ConfigError, match="eps=nan is not a real number"):
        errors.number("eps", float("nan"))
    with pytest.raises(ConfigError, match="causal=1 is a int: give True or False"):
        errors.flag("causal", 1)
    with pytest.raises(ConfigError, match="mlp='relu': use one of 'gelu', 'swiglu'"):
        errors.one_of("mlp", "relu", ("gelu", "swiglu"))
    with pytest.raises(ConfigError, match=r"costs=\[1\] is a list, not a mapping"):
        errors.mapping("costs", [1], "{'F': 1}")
    with pytest.raises(ConfigError, match="heads=6 is not divisible by tp=4: why. Fix: fix"):
        errors.divisible("heads", 6, "tp", 4, why="why", fix="fix")
    assert errors.divisors(12) == "1, 2, 3, 4, 6, 12"


def test_array_checks_type_rank_dtype_and_emptiness():
    x = jnp.zeros((2, 3), jnp.float32)
    assert errors.array("x", x, ndim=2, kinds="f") == (2, 3)
    assert errors.array("x", jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), kinds="f") == (2, 3)  # bf16 is a float
    with pytest.raises(ConfigError, match="x is a list, not an array"):
        errors.array("x", [[1.0]])
    with pytest.raises(ConfigError, match=r"x has shape \(2, 3\) \(rank 2\); expected rank 3: x\[B, T, D\]"):
        errors.array("x", x, ndim=3, shape_doc="x[B, T, D]")
    with pytest.raises(ConfigError, match="x has dtype int32; x must be floating point"):
        errors.array("x", x.astype(jnp.int32), kinds="f")
    with pytest.raises(ConfigError, match="t has dtype float32; t must be integer"):
        errors.array("t", x, kinds="iu")
    with pytest.raises(ConfigError, match=r"x has shape \(0, 3\), with an empty axis"):
        errors.array("x", jnp.zeros((0, 3)))


# ---- devices and meshes ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["8", True, 2.5, None, 1 << 20])
def test_use_cpu_devices_refuses_what_is_not_a_count(bad):
    with pytest.raises(ConfigError, match=r"n=.*(not a whole number|more than 65,536)"):
        mesh.use_cpu_devices(bad)


def test_make_mesh_refuses_bad_sizes_and_devices():
    with pytest.raises(ConfigError, match="dp='2' must be a positive integer"):
        mesh.make_mesh(dp="2")
    with pytest.raises(ConfigError, match="devices=3: give a non-empty list of jax devices"):
        mesh.make_mesh(dp=1, devices=3)
    with pytest.raises(ConfigError, match="devices=\\[\\]"):
        mesh.make_mesh(dp=1, devices=[])


@pytest.mark.parametrize("kw, match", [
    (dict(coordinator="localhost"), "coordinator='localhost': give 'host:port'"),
    (dict(num_processes=0), "num_processes=0: need at least 1"),
    (dict(process_id=2), "process_id=2 with num_processes=2: ids run from 0 to 1"),
    (dict(process_id=-1), "process_id=-1: need at least 0"),
])
def test_init_distributed_refuses_before_joining(kw, match):
    args = dict(coordinator="127.0.0.1:1", num_processes=2, process_id=0) | kw
    with pytest.raises(ConfigError, match=match):
        mesh.init_distributed(args.pop("coordinator"), **args)


def test_require_mesh():
    with pytest.raises(ConfigError, match="mesh='dp=2' is a str, not a jax.sharding.Mesh"):
        mesh.require_mesh("dp=2", axes=("dp",), needed_by="x")


# ---- the reference ---------------------------------------------------------------------------

FIELDS = {f.name for f in dataclasses.fields(reference.ModelConfig)}


@pytest.mark.parametrize("kw, match", [
    (dict(n_kv_heads=0), "n_kv_heads=0: need at least 1"),
    (dict(d_model=-4), "d_model=-4: need at least 1"),
    (dict(head_dim="4"), "head_dim='4' is a str, not a whole number"),
    (dict(n_heads=8.0), "n_heads=8.0 is a float, not a whole number"),
    (dict(n_layers=0), "n_layers=0: need at least 1"),
    (dict(vocab=1 << 30), "vocab=1073741824 is more than"),
    (dict(n_experts=-1), "n_experts=-1: need at least 0"),
    (dict(causal="yes"), "causal='yes' is a str: give True or False"),
    (dict(norm_eps=0.0), "norm_eps=0.0: must be > 0"),
    (dict(mlp=None), "mlp=None: use one of 'gelu', 'swiglu'"),
])
def test_model_config_refuses_bad_fields(kw, match):
    with pytest.raises(ConfigError, match=match):
        reference.ModelConfig(**kw)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) and value == value


def model_field_accepted(field: str, value) -> bool:
    """Whether ModelConfig(**{field: value}) is a model, by the rules its docstring and
    the lecture give, every other field at its default (8 heads and 8 KV heads of 4, no
    experts, top_k 2, no rotary embedding): sizes whole numbers from 1 (n_experts from 0,
    and then at least top_k) to 2^24; query heads a multiple of the KV heads; the MLP
    gelu or swiglu; flags bools; norm_eps a finite real > 0; rope_theta 0 or a finite base
    above 1; a dense model routes nothing (router softmax, no balance loss, no bias)."""
    if field in ("vocab", "d_model", "head_dim", "d_ff", "n_layers", "top_k", "n_heads", "n_kv_heads"):
        divides = {"n_heads": lambda n: n % 8 == 0, "n_kv_heads": lambda n: 8 % n == 0}.get(field, lambda n: True)
        return _is_int(value) and 1 <= value <= 1 << 24 and divides(value)
    if field == "n_experts":
        return _is_int(value) and (value == 0 or 2 <= value <= 1 << 24)
    if field == "mlp":
        return value in ("gelu", "swiglu") and isinstance(value, str)
    if field in ("moe_renormalize", "causal"):
        return isinstance(value, bool)
    if field == "norm_eps":
        return _is_real(value) and 0 < value < float("inf")
    if field == "rope_theta":
        return _is_real(value) and (value == 0 or 1 < value < float("inf"))
    if field == "router":
        return value == "softmax" and isinstance(value, str)
    assert field in ("aux_loss", "bias_rate"), field
    return _is_real(value) and value == 0


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(sorted(FIELDS)), value=JUNK)
def test_model_config_builds_exactly_what_the_rules_accept(field, value):
    """A config the rules accept builds, holding the value; any other is refused with a
    ConfigError naming the field."""
    if model_field_accepted(field, value):
        assert getattr(reference.ModelConfig(**{field: value}), field) == value
    else:
        with pytest.raises(ConfigError, match=field):
            reference.ModelConfig(**{field: value})


def test_reference_functions_refuse_bad_arrays():
    q = jnp.zeros((1, 4, 2, 3))
    with pytest.raises(ConfigError, match=r"q has shape \(1, 4, 2\) \(rank 3\); expected rank 4"):
        reference.attention(q[..., 0], q, q)
    with pytest.raises(ConfigError, match="q has dtype int32"):
        reference.attention(q.astype(jnp.int32), q, q)
    with pytest.raises(ConfigError, match="k and v must have one shape"):
        reference.attention(q, q, q[:, :, :1])
    with pytest.raises(ConfigError, match="N=2 must be a multiple of KV heads K=3"):
        reference.attention(q, jnp.zeros((1, 4, 3, 3)), jnp.zeros((1, 4, 3, 3)))
    cfg = reference.ModelConfig(n_layers=1)
    with pytest.raises(ConfigError, match="cfg is a dict, not a reference.ModelConfig"):
        reference.init_params(jax.random.key(0), {"d_model": 4})
    with pytest.raises(ConfigError, match="dtype=.*int32.*floating point"):
        reference.init_params(jax.random.key(0), cfg, jnp.int32)
    params = jax.eval_shape(lambda: reference.init_params(jax.random.key(0), cfg))
    with pytest.raises(ConfigError, match=r"tokens has shape \(5,\) \(rank 1\)"):
        reference.loss(params, jnp.zeros((5,), jnp.int32), cfg)
    with pytest.raises(ConfigError, match="at least 2 positions"):
        reference.loss(params, jnp.zeros((2, 1), jnp.int32), cfg)


# ---- schedules and formulas ------------------------------------------------------------------

def schedule_accepted(name, p, m, v, costs) -> bool:
    """Whether schedule.make(name, p, m, v, costs) is a schedule, by the schedules' own
    rules: a registered name; p, m and chunks whole numbers from 1 (chunks defaulting to
    2 for interleaved and dualpipe-v, else 1); one chunk but for interleaved (2 or more,
    and m a multiple of p: Megatron's) and dualpipe-v (2, and m >= 2p - 1: device 0 runs
    2p - 1 forwards before its first backward); ZB-H1 and ZB-H2 m >= p; costs a mapping of
    the schedule's kinds (F, B, and W where the backward is split) to whole ticks >= 1."""
    if not (isinstance(name, str) and name in orders.REGISTRY):
        return False
    chunks = (2 if name in ("interleaved", "dualpipe-v") else 1) if v is None else v
    if not all(_is_int(n) and n >= 1 for n in (p, m, chunks)):
        return False
    shape = {"interleaved": chunks >= 2 and m % p == 0, "zb-h1": chunks == 1 and m >= p,
             "zb-h2": chunks == 1 and m >= p, "dualpipe-v": chunks == 2 and m >= 2 * p - 1}.get(name, chunks == 1)
    kinds = "FBW" if name in ("zb-h1", "zb-h2", "dualpipe-v") else "FB"
    return shape and (costs is None or isinstance(costs, dict) and all(
        k in kinds and _is_int(c) and c >= 1 for k, c in costs.items()))


@settings(max_examples=150, deadline=None)
@given(name=st.one_of(st.sampled_from(sorted(orders.REGISTRY)), JUNK), p=JUNK, m=JUNK,
       v=st.one_of(st.none(), JUNK),
       costs=st.one_of(st.none(), JUNK, st.dictionaries(st.sampled_from(["F", "B", "W", "X", 1]), JUNK, max_size=2)))
def test_schedule_make_builds_exactly_what_the_rules_accept(name, p, m, v, costs):
    if schedule_accepted(name, p, m, v, costs):
        s = schedule.make(name, p, m, v, costs)
        assert (s.name, s.stages, s.microbatches) == (name, p, m)
    else:
        with pytest.raises(ConfigError):
            schedule.make(name, p, m, v, costs)


def test_formulas_refuse_sizes_that_do_not_split():
    s = schedule.make("1f1b", 2, 4)
    with pytest.raises(ConfigError, match="batch_size=6 is not divisible by dp x microbatches=8"):
        formulas.pipeline_collectives(schedule=s, batch_size=6, features=4, dtype=jnp.float32, dp=2)
    with pytest.raises(ConfigError, match="features=0: need at least 1"):
        formulas.pipeline_collectives(schedule=s, batch_size=8, features=0, dtype=jnp.float32)


def test_save_png_into_a_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        schedule.make("1f1b", 2, 2).save_png(str(tmp_path / "no_such_dir" / "t.png"))
