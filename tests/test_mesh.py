"""jaxpar.mesh: axis order and types, clear errors for bad sizes and a late device request.

conftest.py has asked for 8 fake CPU devices; the checks of a fresh JAX start (XLA_FLAGS,
use_cpu_devices before JAX) run in two subprocesses, each a few seconds.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxpar import mesh
from jaxpar.errors import ConfigError

N = jax.device_count()
needs_8 = pytest.mark.skipif(N != 8, reason="written for the 8 fake CPU devices of conftest.py")


def test_axis_constants():
    assert (mesh.DP, mesh.PP, mesh.CP, mesh.EP, mesh.TP) == ("dp", "pp", "cp", "ep", "tp")
    assert mesh.AXIS_ORDER == ("dp", "pp", "cp", "ucp", "ep", "tp")


@needs_8
@pytest.mark.parametrize(
    "sizes, names, shape",
    [
        (dict(dp=8), ("dp",), (8,)),
        (dict(tp=4, dp=2), ("dp", "tp"), (2, 4)),
        (dict(tp=2, pp=2, dp=2), ("dp", "pp", "tp"), (2, 2, 2)),
        (dict(ep=2, cp=2, tp=2), ("cp", "ep", "tp"), (2, 2, 2)),
        (dict(tp=2, ep=1, cp=1, pp=2, dp=2), ("dp", "pp", "cp", "ep", "tp"), (2, 2, 1, 1, 2)),
    ],
    ids=["dp8", "tp4-dp2", "tp-pp-dp", "ep-cp-tp", "all-five-with-size-1"],
)
def test_make_mesh_orders_axes_dp_pp_cp_ep_tp_whatever_the_keyword_order(sizes, names, shape):
    m = mesh.make_mesh(**sizes)
    assert m.axis_names == names
    assert tuple(m.devices.shape) == shape
    assert dict(m.shape) == {n: s for n, s in zip(names, shape)}


@needs_8
def test_make_mesh_axes_are_auto_typed():
    m = mesh.make_mesh(dp=2, pp=1, tp=4)
    assert tuple(m.axis_types) == (AxisType.Auto,) * 3


@needs_8
def test_tp_is_innermost_so_tp_peers_are_neighbouring_devices():
    # On CPU the devices have no topology: jax.make_mesh keeps them in id order.
    m = mesh.make_mesh(tp=4, dp=2)
    ids = np.vectorize(lambda d: d.id)(m.devices)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_make_mesh_on_a_subset_of_devices():
    devices = jax.devices()[:2]
    m = mesh.make_mesh(tp=2, devices=devices)
    assert m.axis_names == ("tp",)
    assert list(m.devices.flat) == devices


@needs_8
def test_product_mismatch_names_the_sizes_and_the_fix():
    with pytest.raises(ValueError) as e:
        mesh.make_mesh(dp=3, tp=2)
    msg = str(e.value)
    assert "dp=3 x tp=2" in msg
    assert "needs 6 devices but 8 are available" in msg
    assert "product is 8" in msg
    assert "use_cpu_devices(6)" in msg
    assert "--xla_force_host_platform_device_count=6" in msg


def test_product_mismatch_against_devices_argument():
    with pytest.raises(ValueError, match="needs 4 devices but 3 are available"):
        mesh.make_mesh(dp=2, tp=2, devices=jax.devices()[:3])


def test_unknown_axis_is_rejected_with_the_known_ones():
    with pytest.raises(ValueError) as e:
        mesh.make_mesh(dp=2, sp=4)
    assert "'sp'" in str(e.value)
    assert "dp, pp, cp, ucp, ep, tp" in str(e.value)


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2"])
def test_non_positive_or_non_integer_size_is_rejected(bad):
    with pytest.raises(ValueError, match=f"dp={bad!r} must be a positive integer"):
        mesh.make_mesh(dp=bad, tp=1)


def test_no_axes_is_rejected():
    with pytest.raises(ValueError, match="at least one axis"):
        mesh.make_mesh()


@needs_8
def test_numpy_integer_sizes_are_accepted():
    m = mesh.make_mesh(dp=np.int64(2), tp=np.int32(4))
    assert dict(m.shape) == {"dp": 2, "tp": 4}


@needs_8
def test_describe():
    assert mesh.describe(mesh.make_mesh(tp=4, dp=2)) == "dp=2 tp=4"
    assert mesh.describe(mesh.make_mesh(dp=8, pp=1)) == "dp=8 pp=1"


def test_use_cpu_devices_too_late_raises_with_the_fix(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    have = len(jax.devices("cpu"))  # the backends are running from here on
    ask = have + 1
    with pytest.raises(ConfigError) as e:
        mesh.use_cpu_devices(ask)
    msg = str(e.value)
    assert f"use_cpu_devices({ask}) was called after JAX started" in msg
    assert f"with {have} CPU device(s)" in msg
    assert "before anything touches jax.devices()" in msg
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={ask}" in msg


def test_use_cpu_devices_late_with_the_running_count_is_fine(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    have = len(jax.devices("cpu"))
    assert mesh.use_cpu_devices(have) == have


@pytest.mark.parametrize("bad", [0, -1])
def test_use_cpu_devices_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        mesh.use_cpu_devices(bad)


def _fresh_python(code: str, xla_flags: str | None) -> dict:
    """Run `code` in a new interpreter (JAX not started) on the CPU backend; it prints JSON."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fresh_process_use_cpu_devices_before_jax_gives_that_count():
    # Importing every jaxpar module must not start JAX's backends.
    out = _fresh_python("""
        import json
        import jaxpar, jaxpar.mesh, jaxpar.reference, jaxpar.comms, jaxpar.testing, jaxpar.cli, jaxpar.cli.tour, jaxpar.tensor, jaxpar.pipeline.runtime, jaxpar.pipeline.verify
        from jaxpar import mesh
        got = mesh.use_cpu_devices(4)
        import jax
        n = len(jax.devices())
        again = mesh.use_cpu_devices(4)
        try:
            mesh.use_cpu_devices(2)
            late = None
        except ValueError as e:
            late = str(e)
        print(json.dumps({"got": got, "n": n, "again": again, "late": late,
                          "axes": list(mesh.make_mesh(dp=2, tp=2).axis_names)}))
    """, xla_flags=None)
    assert out["got"] == 4 and out["n"] == 4 and out["again"] == 4
    assert out["late"] is not None and "use_cpu_devices(2)" in out["late"]
    assert out["axes"] == ["dp", "tp"]


def test_fresh_process_xla_flags_count_wins():
    out = _fresh_python("""
        import json
        from jaxpar import mesh
        got = mesh.use_cpu_devices(4)
        import jax
        print(json.dumps({"got": got, "n": len(jax.devices()), "late_same_ask": mesh.use_cpu_devices(4)}))
    """, xla_flags="--xla_force_host_platform_device_count=2")
    # The user's XLA_FLAGS count is kept (2), and asking again for 4 does not raise:
    # the flag still wins and the running backend has the count it names.
    assert out == {"got": 2, "n": 2, "late_same_ask": 2}


def test_without_unit_axes_keeps_the_devices_in_order():
    m = mesh.make_mesh(dp=2, ep=1, tp=2, devices=jax.devices()[:4])
    sub = mesh.without_unit_axes(m)
    assert dict(sub.shape) == {"dp": 2, "tp": 2}
    assert list(sub.devices.flat) == list(m.devices.flat)
    one = mesh.without_unit_axes(mesh.make_mesh(dp=1, ep=1, devices=jax.devices()[:1]))
    assert dict(one.shape) == {"dp": 1}          # one device: one axis kept, so it is still a mesh
