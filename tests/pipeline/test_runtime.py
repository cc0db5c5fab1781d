"""The pipeline runtime (jaxpar.pipeline.runtime) against the unsharded model and against
the schedule it executes.

* every schedule of schedule.KNOWN, p in {2, 4}, m in {1, 4, 8} (and 16 for interleaved):
  loss, input gradient and every parameter gradient equal stage.unsharded's (float32;
  float64 for one case per schedule), and the combinations schedule.make rejects raise;
* dp x pp meshes (gradients all-reduced over dp), recompute="full", reference transformer
  blocks as stages;
* bubbles: NaN in every unused slot changes nothing (runtime.run and the GPipe baseline);
* collectives: the compiled collective-permutes against oracles written from the
  definitions (tests/oracles.py), never from the plan: how many run (the runtime's
  lockstep steps; by hand GPipe 2(m+p-2), naive 2m(p-1), the baseline 2(m+p-1)), between
  which devices (each crossing stage boundary, forward and back), and the sends they
  carry (2m per crossing boundary); the plan keeps as many residual slots as the peak;
* ValueError, before anything is compiled, for input that does not fit;
* to_stages / from_stages for both placements, and a hypothesis property over drawn cases.

Each verify.compare compiles one program (seconds), so every case is compiled
once per process (`_compare` caches) and the sweep holds only the cases above: p = 2
and 4 (no middle device, then two), m = 1 (no overlap), 4 and 8 (m < p, m = p, m > p
at p = 4), enough for every schedule's fill, steady state and drain.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxpar import comms
from jaxpar.errors import ConfigError
from jaxpar import mesh as mesh_lib
from jaxpar.pipeline import baseline, formulas, runtime, stage
from jaxpar.schedules import schedule
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline import verify
from jaxpar.testing import assert_close
from tests import oracles

WIDTH = 32               # verify.model's MLP width
ROWS_PER_MB = 2          # compare(): rows = 2 * m * dp, so 2 rows per microbatch and dp shard


def act_bytes(itemsize: int = 4) -> int:
    """One microbatch's activation on one device, as compare() builds the batch."""
    return ROWS_PER_MB * WIDTH * itemsize


def rejection(name: str, p: int, m: int) -> str | None:
    """The part of schedule.make's message for a combination it rejects (None: valid),
    written from the rules, not read from the code."""
    if name == "interleaved" and m % p:
        return "multiple of stages"
    if name in ("zb-h1", "zb-h2") and m < p:
        return rf"needs microbatches >= stages: microbatches={m} < stages={p}"
    if name == "dualpipe-v" and m < 2 * p - 1:
        return rf"needs microbatches >= 2\*stages - 1.*microbatches={m} < {2 * p - 1}"
    return None


def by_hand_permutes(name: str, p: int, m: int) -> int | None:
    """Collective-permutes per step, derived from what the runtime does (p >= 2):
    GPipe runs m+p-1 forward steps, sending right on all but the last, and m+p-1 backward
    steps, sending left on all but the last: 2(m+p-2). Naive runs one microbatch at a time
    through p stages and back: p-1 sends each way per microbatch, 2m(p-1)."""
    if name == "gpipe":
        return 2 * (m + p - 2)
    if name == "naive":
        return 2 * m * (p - 1)
    return None


@functools.cache
def _compare(name, p, m, dp=1, recompute="none", layers="mlp", n_layers=None, dtype=jnp.float32):
    return verify.compare(name, p, m, dp=dp, recompute=recompute,
                          model=verify.ModelChoice(layers=layers, n_layers=n_layers, dtype=dtype))


def assert_matches(c: verify.Comparison):
    """Loss, input gradient and every parameter gradient within the dtype's tolerance
    (testing.tolerance, leaf by leaf), and the collectives the formula's."""
    assert all(math.isfinite(e) for e in c.errors.values()), (c.name, c.errors)
    assert c.within, (c.name, c.mesh, c.errors, c.tolerance)
    assert c.measured == c.expected, (c.name, c.mesh, c.measured, c.expected)


def permutes(name: str, p: int, m: int, itemsize: int = 4) -> dict:
    """The collective-permutes of one step by the oracle: lockstep_permutes executions, each
    one microbatch's activation."""
    n = oracles.lockstep_permutes(schedule.make(name, stages=p, microbatches=m))
    return {"collective-permute": (n, n * act_bytes(itemsize))} if n else {}


def compiled_pairs(c: verify.Comparison, p: int) -> dict:
    """{(lane, direction): (source, destination) pp ranks} of the compiled step's
    collective-permutes, read off its HLO (the scope names the channel); ranks of one dp
    group only (each dp group has the same pairs)."""
    out: dict = {}
    for line in c.hlo.splitlines():
        scope = re.search(r"pipeline_send_(F|B)_(right|left)", line)
        pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
        if "collective-permute" not in line or not pairs:
            continue
        assert scope, line[:200]
        got = {(int(a), int(b)) for a, b in re.findall(r"(\d+),(\d+)", pairs.group(1))}
        assert all(a // p == b // p for a, b in got)      # pp is the minor axis: a pair stays in its dp group
        out.setdefault(scope.groups(), set()).update((a, b) for a, b in got if a < p)
    return out


def pp_mesh(p: int, dp: int = 1, **more):
    sizes = dict(dp=dp, pp=p, **more) if dp > 1 else dict(pp=p, **more)
    return mesh_lib.make_mesh(devices=jax.devices()[:math.prod(sizes.values())], **sizes)


def cases(items) -> list:
    """pytest params with readable ids: 1f1b-4-8."""
    return [pytest.param(*c, id="-".join(str(v) for v in c)) for c in items]


# ---- the sweep: every schedule, p in {2, 4}, m in {1, 4, 8} (16 for interleaved; at p = 2,
# m = 4 already runs the steady state m > p, so m = 8 there only for interleaved) ---------

SWEEP = [(name, p, m) for name in schedule.KNOWN for p in (2, 4)
         for m in ((1, 4, 8, 16) if name == "interleaved" else (1, 4, 8) if p == 4 else (1, 4))]
VALID = [case for case in SWEEP if rejection(*case) is None]


def program_key(s: schedule.Schedule) -> tuple:
    """Everything runtime.pipeline reads from a schedule besides its name: two schedules
    with equal keys compile to the same program."""
    plan = plan_lib.plan(s)
    return (s.stages, s.microbatches, s.chunks, s.placement, s.split_backward, plan.table.shape, plan.table.tobytes(),
            plan.channels, plan.flags.tobytes(), tuple(sorted(plan.pairs.items())), plan.deliveries,
            plan.n_x, plan.n_g, plan.n_res)


@functools.cache
def representative(name: str, p: int, m: int) -> tuple:
    """The first case of VALID with the same program (itself, but for m = 1: naive, GPipe
    and 1F1B are then one schedule, F down the stages and B back up)."""
    key = program_key(schedule.make(name, stages=p, microbatches=m))
    return next(c for c in VALID if program_key(schedule.make(c[0], stages=c[1], microbatches=c[2])) == key)


@pytest.mark.parametrize("name,p,m", cases(SWEEP))
def test_schedule_matches_unsharded_and_its_collectives(name, p, m):
    why = rejection(name, p, m)
    if why is not None:  # rejected before anything is built, and said so
        with pytest.raises(ValueError, match=why):
            schedule.make(name, stages=p, microbatches=m)
        with pytest.raises(ValueError, match=why):
            verify.compare(name, p, m)
        return
    s = schedule.make(name, stages=p, microbatches=m)
    if representative(name, p, m) != (name, p, m):
        # the same program as a case compiled in its own test: only check that it is the same
        other = representative(name, p, m)
        assert program_key(s) == program_key(schedule.make(other[0], stages=p, microbatches=m))
        assert m == 1 and name in ("gpipe", "1f1b") and other[0] == "naive"
        return
    c = _compare(name, p, m, n_layers=s.virtual_stages)  # one layer per stage: a shorter compile
    assert_matches(c)
    assert c.measured == permutes(name, p, m)
    assert compiled_pairs(c, p) == oracles.channel_pairs(name, p, s.chunks)
    hand = by_hand_permutes(name, p, m)
    if hand is not None:
        assert c.measured["collective-permute"][0] == hand


def test_sweep_holds_the_expected_rejections():
    """The sweep does not thin out silently: 29 runnable cases, 9 rejected ones."""
    assert len(VALID) == 29 and len(SWEEP) - len(VALID) == 9
    assert len({representative(*c) for c in VALID}) == 25  # m = 1: naive, gpipe, 1f1b one program
    assert {(n, p, m) for n, p, m in SWEEP if rejection(n, p, m)} == {
        ("interleaved", 2, 1), ("interleaved", 4, 1), ("zb-h1", 2, 1), ("zb-h1", 4, 1), ("zb-h2", 2, 1),
        ("zb-h2", 4, 1), ("dualpipe-v", 2, 1), ("dualpipe-v", 4, 1), ("dualpipe-v", 4, 4)}


# One cheap case per schedule (one layer per stage), three of them on dp=2 x pp.
F64_CASES = [("naive", 2, 2, 1), ("gpipe", 4, 4, 2), ("1f1b", 4, 4, 1), ("interleaved", 2, 2, 2),
             ("zb-h1", 2, 2, 1), ("zb-h2", 4, 4, 2), ("dualpipe-v", 2, 3, 1)]


@pytest.mark.parametrize("name,p,m,dp", cases(F64_CASES))
def test_schedule_matches_unsharded_in_float64(x64, name, p, m, dp):
    s = schedule.make(name, stages=p, microbatches=m)
    c = verify.compare(name, p, m, dp=dp, model=verify.ModelChoice(dtype=jnp.float64, n_layers=s.virtual_stages))
    assert_matches(c)
    assert c.tolerance == (1e-12, 1e-12)
    expected = permutes(name, p, m, itemsize=8)
    if dp > 1:  # one layer per chunk: w [W, W] and b [W], and the loss
        expected["all-reduce"] = (1, s.chunks * (WIDTH * WIDTH + WIDTH) * 8 + 8)
    assert c.measured == expected


# ---- dp x pp, recompute, transformer blocks ---------------------------------------------

# float32 here; test_schedule_matches_unsharded_in_float64 has three more dp = 2 cases
# (gpipe p=4, interleaved p=2, zb-h2 p=4)
DP_CASES = [("gpipe", 2, 4), ("1f1b", 4, 8), ("dualpipe-v", 2, 3)]


@pytest.mark.parametrize("name,p,m", cases(DP_CASES))
def test_dp_x_pp_all_reduces_gradients_over_dp(name, p, m):
    c = _compare(name, p, m, dp=2)
    assert c.mesh == f"dp=2 pp={p}"
    assert_matches(c)
    s = schedule.make(name, stages=p, microbatches=m)
    # one all-reduce over dp: each device's 2 layers per chunk (w [W, W], b [W]) and the loss
    grad_bytes = 2 * s.chunks * (WIDTH * WIDTH + WIDTH) * 4
    assert c.measured == {"all-reduce": (1, grad_bytes + 4)} | permutes(name, p, m)
    assert compiled_pairs(c, p) == oracles.channel_pairs(name, p, s.chunks)


@pytest.mark.parametrize("name,p,m", cases([("1f1b", 4, 4), ("zb-h2", 2, 3)]))
def test_recompute_gives_the_same_results(name, p, m):
    """B (and W, split) run the stage's forward again from its stored input."""
    c = _compare(name, p, m, recompute="full")
    assert_matches(c)
    assert c.measured == permutes(name, p, m)  # recompute moves nothing more


@pytest.mark.parametrize("name,p,m", cases([("1f1b", 2, 2), ("zb-h1", 2, 2)]))
def test_reference_blocks_as_stages(name, p, m):
    c = _compare(name, p, m, layers="blocks", n_layers=p)  # one block per stage: compiles faster
    assert_matches(c)


def test_plain_stage_function_keeps_its_own_residuals():
    """A stage function that is not `layers`: its vjp's residuals hold slices of the stage
    weights and a closed-over constant; the split backward rebuilds the vjp at W."""
    shift = jnp.linspace(-0.1, 0.1, WIDTH)

    def stage_fn(params, x):
        for j in range(params["w"].shape[0]):
            x = jnp.tanh(x @ params["w"][j] + params["b"][j]) + shift
        return x

    s = schedule.make("zb-h1", stages=2, microbatches=2)
    _, params, batch = verify.model("mlp", 2 * s.virtual_stages, ROWS_PER_MB * 2)
    loss, grads = runtime.run(s, stage_fn, params, batch, mesh=pp_mesh(2), bubble_fill=math.nan)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    assert_close((loss, grads.params, grads.inputs), (ref_loss, ref.params, ref.inputs))


# ---- bubbles: NaN in unused slots changes nothing ----------------------------------------

def _mlp_case(name, p, m):
    s = schedule.make(name, stages=p, microbatches=m)
    stage_fn, params, batch = verify.model("mlp", 2 * s.virtual_stages, ROWS_PER_MB * m)
    return s, stage_fn, params, batch


def assert_equal_trees(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) and jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b):
        assert np.all(np.isfinite(np.asarray(x)))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name,p,m", cases([("1f1b", 4, 4), ("zb-h2", 2, 3)]))
def test_run_with_nan_bubbles_equals_zero_bubbles_exactly(name, p, m):
    s, stage_fn, params, batch = _mlp_case(name, p, m)
    mm = pp_mesh(p)
    with_nan = runtime.run(s, stage_fn, params, batch, mesh=mm, bubble_fill=math.nan)
    with_zero = runtime.run(s, stage_fn, params, batch, mesh=mm, bubble_fill=0.0)
    assert_equal_trees(with_nan, with_zero)
    loss, grads = with_nan
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    assert_close((loss, grads.params, grads.inputs), (ref_loss, ref.params, ref.inputs))


@pytest.mark.parametrize("p,m", cases([(4, 4), (2, 3)]))
def test_gpipe_baseline_nan_bubbles_and_collectives(p, m):
    """The autodiff baseline: m+p-1 forward steps each ppermute, and their transposes:
    2(m+p-1) collective-permutes; NaN bubbles give bit-identical results."""
    s, stage_fn, params, batch = _mlp_case("gpipe", p, m)
    mm = pp_mesh(p)
    pipes = {fill: baseline.gpipe_baseline(stage_fn, params, batch, mesh=mm, microbatches=m, bubble_fill=fill)
             for fill in (math.nan, 0.0)}
    pipe = pipes[math.nan]
    assert pipe.schedule.stages == p and pipe.schedule.microbatches == m
    stats = comms.nonzero(comms.collective_stats(pipe.step, runtime.to_stages(params, pipe.schedule), *batch, None, None))
    n = 2 * (m + p - 1)
    assert stats == {"collective-permute": (n, n * act_bytes())}
    assert stats == formulas.baseline_collectives(stages=p, microbatches=m, batch_size=batch[0].shape[0],
                                                  features=WIDTH, dtype=jnp.float32)
    with_nan, with_zero = (runtime.run_pipeline(pipes[f], params, batch) for f in (math.nan, 0.0))
    assert_equal_trees(with_nan, with_zero)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    assert_close((with_nan[0], with_nan[1].params, with_nan[1].inputs), (ref_loss, ref.params, ref.inputs))


def test_gpipe_baseline_error_on_dp_x_pp():
    # gpipe_baseline_error fills bubbles with NaN; an absolute error, on values of order 1
    assert verify.gpipe_baseline_error(p=2, m=4, dp=2) < 1e-5


# ---- the plan: every send carried, residual slots = the schedule's peak -----------------

PLAN_CASES = [(name, p, m) for name in schedule.KNOWN for p in (1, 2, 3, 4) for m in range(1, 9)
              if rejection(name, p, m) is None]


@pytest.mark.parametrize("name", schedule.KNOWN)
def test_plan_carries_every_send_in_peak_residual_slots(name):
    drawn = [c for c in PLAN_CASES if c[0] == name]
    assert drawn
    for _, p, m in drawn:
        s = schedule.make(name, stages=p, microbatches=m)
        plan = plan_lib.plan(s)
        assert plan.n_sends == len(s.sends) == oracles.sends(name, p, m, s.chunks), (name, p, m)
        assert plan.permutes == oracles.lockstep_permutes(s), (name, p, m)
        assert {k: set(v) for k, v in plan.pairs.items()} == oracles.channel_pairs(name, p, s.chunks), (name, p, m)
        assert plan.n_res == max(s.peak_in_flight), (name, p, m)
        # every (step, device) of the table is one of the schedule's actions or idle, once each
        runs = sum(int(plan.table[j, d, plan_lib.FIELDS[f]] > 0)
                   for j in range(plan.steps) for d in range(p) for f in ("f_branch", "b_branch"))
        assert runs == sum(len(s.program(d)) for d in range(p)), (name, p, m)
        if p == 1:
            assert plan.permutes == 0
            assert formulas.pipeline_collectives(schedule=s, batch_size=2 * m, features=WIDTH, dtype=jnp.float32) == {}


def test_plan_counts_by_hand():
    assert plan_lib.plan(schedule.make("1f1b", stages=4, microbatches=8)).permutes == 29
    assert plan_lib.plan(schedule.make("gpipe", stages=4, microbatches=8)).permutes == 20
    # sends by hand: 2m(p-1) (ZB: W sends nothing), 2m(pv-1) interleaved, 2m(2p-2) for the V
    for name, p, m, v, hand in (("zb-h1", 4, 8, 1, 48), ("zb-h2", 3, 5, 1, 20), ("interleaved", 4, 8, 2, 112),
                                ("interleaved", 2, 4, 3, 40), ("dualpipe-v", 4, 8, 1, 96), ("dualpipe-v", 2, 3, 1, 12),
                                ("dualpipe-v", 1, 1, 1, 0)):
        assert oracles.sends(name, p, m, v) == hand
        s = schedule.make(name, stages=p, microbatches=m, chunks=v if v > 1 else None)
        assert plan_lib.plan(s).n_sends == hand
    for p in (2, 3, 4, 5):
        for m in (1, 2, 3, 4, 7, 8):
            for name in ("gpipe", "naive"):
                s = schedule.make(name, stages=p, microbatches=m)
                assert plan_lib.plan(s).permutes == oracles.lockstep_permutes(s) == by_hand_permutes(name, p, m)
            # residual slots by hand: GPipe keeps all m, 1F1B at most p (device 0), naive 1
            assert plan_lib.plan(schedule.make("gpipe", stages=p, microbatches=m)).n_res == m
            assert plan_lib.plan(schedule.make("1f1b", stages=p, microbatches=m)).n_res == min(m, p)
            assert plan_lib.plan(schedule.make("naive", stages=p, microbatches=m)).n_res == 1


# ---- bad input: ValueError before compiling, naming the value ---------------------------

@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if the runtime gets as far as building its program."""
    def refuse(*args, **kwargs):
        raise AssertionError("the runtime built its program before rejecting the input")
    monkeypatch.setattr(runtime, "Program", refuse)
    monkeypatch.setattr(runtime.jax, "shard_map", refuse)


def _bad_run(name="1f1b", p=2, m=4, *, n_layers=None, rows=None, target_rows=None, mesh=None, stage_fn=None,
             chunks=None):
    s = schedule.make(name, stages=p, microbatches=m, chunks=chunks)
    fn, params, (inputs, targets) = verify.model("mlp", n_layers or 2 * s.virtual_stages,
                                                         rows or ROWS_PER_MB * m)
    if target_rows is not None:
        targets = targets[:target_rows]
    return runtime.run(s, stage_fn or fn, params, (inputs, targets), mesh=mesh or pp_mesh(p))


def test_layers_not_divisible_by_stages(no_compile):
    with pytest.raises(ValueError, match=r"6 layers do not split into p\*v = 4\*1 = 4 stages"):
        _bad_run(p=4, n_layers=6)
    with pytest.raises(ValueError, match=r"6 layers do not split into p\*v = 2\*2 = 4 stages"):
        _bad_run("interleaved", p=2, n_layers=6)


def test_batch_not_divisible_by_dp_x_microbatches(no_compile):
    with pytest.raises(ValueError, match=r"batch of 10 rows does not split into dp=1 x microbatches=4"):
        _bad_run(p=2, m=4, rows=10)
    with pytest.raises(ValueError, match=r"batch of 12 rows does not split into dp=2 x microbatches=4.*by 8"):
        _bad_run(p=2, m=4, rows=12, mesh=pp_mesh(2, dp=2))


def test_schedule_for_another_p(no_compile):
    with pytest.raises(ValueError, match=r"built for p=2 devices but the mesh has pp=4"):
        _bad_run(p=2, mesh=pp_mesh(4))


def test_mesh_axes_and_specs_are_checked(no_compile):
    """Any mesh axis may be there (a stage is per-shard code); the specs that name them
    are checked against the mesh and the arrays."""
    with pytest.raises(ValueError, match=r"needs a mesh with a 'pp' axis; got axes \{'dp': 2\}"):
        _bad_run(p=2, mesh=mesh_lib.make_mesh(dp=2, devices=jax.devices()[:2]))
    s = schedule.make("1f1b", stages=2, microbatches=2)
    fn, params, batch = verify.model("mlp", 4, 4)
    mm = pp_mesh(2, tp=2)
    run = lambda **kw: runtime.run(s, fn, params, batch, mesh=mm, **kw)
    cases = [
        (dict(param_pspecs={"w": P(None, "cp"), "b": P()}),
         r"param_pspecs: the pspec .* names axis 'cp'; the mesh has"),
        (dict(param_pspecs={"w": P("pp"), "b": P()}), r"names axis 'pp'.*pp is the pipeline's own"),
        (dict(param_pspecs={"w": P()}), r"param_pspecs has the structure .*: give one PartitionSpec per array"),
        (dict(param_pspecs={"w": P(), "b": P(None, "tp")}),
         r"names 2 dimensions, the array has 1 after its layer axis"),
        (dict(param_pspecs={"w": "tp", "b": P()}), r"the pspec 'tp' is a str, not a jax.sharding.PartitionSpec"),
        (dict(batch_pspec=P("tp", None, None)), r"batch_pspec for the inputs: the pspec .* names 3 dimensions"),
        (dict(first_params={"e": jnp.ones(3)}), r"first_params given without first_fn"),
        (dict(first_fn=lambda p, x: x, first_params={"e": jnp.ones(3)}, input_grads="no"),
         r"input_grads='no' is a str: give True or False"),
    ]
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            run(**kw)
    ids = jnp.zeros((4, 8), jnp.int32)
    with pytest.raises(ConfigError, match=r"input_grads=True but the inputs are int32: there is no gradient"):
        runtime.run(s, fn, params, (ids, batch[1]), mesh=mm, first_fn=lambda p, x: x, first_params={},
                    input_grads=True)


def test_stage_fn_changing_the_activation(no_compile):
    with pytest.raises(ValueError, match=r"\(2, 32\) float32 to \(2, 16\) float32"):
        _bad_run(p=2, stage_fn=lambda params, x: x[:, :16])
    with pytest.raises(ValueError, match=r"\(2, 32\) float32 to \(2, 32\) float16"):
        _bad_run(p=2, stage_fn=lambda params, x: x.astype(jnp.float16))
    # layers(layer_fn) whose layer narrows the activation: the next layer's matmul would fail (a TypeError)
    with pytest.raises(ConfigError, match=r"stage_fn's layer_fn maps a microbatch \(2, 32\) float32 to "
                                          r"\(2, 16\) float32: .* must keep the activation's shape and dtype"):
        _bad_run(p=2, stage_fn=runtime.layers(lambda params, x: (x @ params["w"])[:, :16]))


def test_targets_with_another_row_count(no_compile):
    with pytest.raises(ValueError, match=r"inputs have 8 rows but targets 6"):
        _bad_run(p=2, m=4, target_rows=6)


def test_more_bad_input_is_refused_before_compiling(no_compile):
    s = schedule.make("1f1b", stages=2, microbatches=4)
    fn, params, (inputs, targets) = verify.model("mlp", 4, 8)
    run = lambda **kw: runtime.run(kw.pop("s", s), kw.pop("fn", fn), kw.pop("params", params),
                                   kw.pop("batch", (inputs, targets)), mesh=pp_mesh(2), **kw)
    cases = [
        (dict(batch=(inputs[:0], targets[:0])), r"inputs has shape \(0, 32\), with an empty axis"),
        (dict(params={"w": params["w"][:0], "b": params["b"][:0]}), r"0 layers do not split"),
        (dict(params={}), r"params has no arrays"),
        (dict(params={"w": [[1.0]]}), r"a params leaf is a float, not an array"),
        (dict(batch=inputs), r"batch is a ArrayImpl.*give the pair \(inputs"),
        (dict(batch=(inputs, targets, targets)), r"batch is a tuple of 3.*give the pair"),
        (dict(batch=(inputs.astype(jnp.int32), targets)), r"inputs has dtype int32.*floating point"),
        (dict(loss_fn=lambda y, t: (y - t) ** 2), r"loss_fn\(y, targets\) gives \(2, 32\) float32: it must be a "
                                                  r"floating scalar"),
        (dict(loss_fn="mse"), r"loss_fn='mse' is not callable"),
        (dict(fn=None), r"stage_fn=None is not callable"),
        (dict(s="1f1b"), r"schedule is a str, not a Schedule.*schedule.make"),
        (dict(recompute="yes"), r"recompute='yes': use one of 'none', 'full'"),
        (dict(recompute=True), r"recompute=True: use one of 'none', 'full'"),   # a retired word, on purpose
        (dict(input_grads="yes"), r"input_grads='yes' is a str: give True or False"),
        (dict(bubble_fill="nan"), r"bubble_fill='nan': give a number"),
    ]
    for kw, match in cases:
        with pytest.raises(ConfigError, match=match):
            run(**kw)
    with pytest.raises(ConfigError, match=r"mesh=.* is a str, not a jax.sharding.Mesh"):
        runtime.run(s, fn, params, (inputs, targets), mesh="pp=2")
    with pytest.raises(ConfigError, match=r"shape \(3, 32, 32\) does not split into p\*v = 2\*1 = 2 stages"):
        runtime.to_stages({"w": params["w"][:3]}, s)
    with pytest.raises(ConfigError, match="schedule is a str, not a Schedule"):
        formulas.pipeline_collectives(schedule="1f1b", batch_size=8, features=32, dtype=jnp.float32)


def test_gpipe_baseline_rejects_bad_input_too(no_compile):
    stage_fn, params, batch = verify.model("mlp", 6, 8)
    with pytest.raises(ValueError, match=r"6 layers do not split into p\*v = 4\*1 = 4 stages"):
        baseline.gpipe_baseline(stage_fn, params, batch, mesh=pp_mesh(4), microbatches=4)
    with pytest.raises(ValueError, match=r"batch of 8 rows does not split into dp=1 x microbatches=3"):
        baseline.gpipe_baseline(stage_fn, params, batch, mesh=pp_mesh(2), microbatches=3)


# ---- to_stages / from_stages -------------------------------------------------------------

@pytest.mark.parametrize("name,p,m,chunks", cases([("interleaved", 4, 4, 2), ("interleaved", 2, 2, 3),
                                                   ("dualpipe-v", 4, 7, None), ("dualpipe-v", 1, 1, None),
                                                   ("1f1b", 4, 4, None)]))
def test_to_stages_round_trip_and_placement(name, p, m, chunks):
    s = schedule.make(name, stages=p, microbatches=m, chunks=chunks)
    S, per = s.virtual_stages, 3                # 3 layers per stage
    L = S * per
    params = {"layer": jnp.arange(L, dtype=jnp.int32),
              "w": jnp.arange(L * 2 * 5, dtype=jnp.int32).reshape(L, 2, 5)}
    placed = runtime.to_stages(params, s)
    assert placed["layer"].shape == (p, s.chunks, per) and placed["w"].shape == (p, s.chunks, per, 2, 5)
    for d in range(p):
        for c in range(s.chunks):
            k = s.stage_of(d, c)
            np.testing.assert_array_equal(placed["layer"][d, c], np.arange(k * per, (k + 1) * per))
            np.testing.assert_array_equal(placed["w"][d, c], params["w"][k * per:(k + 1) * per])
    back = runtime.from_stages(placed, s)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), back) == jax.tree.map(lambda a: (a.shape, a.dtype), params)
    for key in params:
        np.testing.assert_array_equal(back[key], params[key])
    if s.placement == "v":  # device 0 holds the first and the last stage, device p-1 the turn
        assert placed["layer"][0, 1, 0] == (S - 1) * per and placed["layer"][p - 1, 1, 0] == p * per


# ---- property: drawn schedule, p, m and dp ----------------------------------------------

@st.composite
def runtime_cases(draw):
    name = draw(st.sampled_from(schedule.KNOWN))
    p = draw(st.sampled_from([2, 4]))            # p = 1 (nothing sent) is the explicit example
    # the two smallest valid m (the program does not grow with m; the run does, a little)
    m = draw(st.sampled_from([m for m in range(1, 2 * p + 2) if rejection(name, p, m) is None][:2]))
    dp = draw(st.sampled_from([1, 2]))
    return name, p, m, dp


# three drawn cases on p > 1 and the degenerate p = 1 (one device holds the whole V), four
# compiled programs in all
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(runtime_cases())
@example(("dualpipe-v", 1, 1, 2))
def test_drawn_cases_match_unsharded_and_collectives(case):
    name, p, m, dp = case
    n_layers = schedule.make(name, stages=p, microbatches=m).virtual_stages
    c = _compare(name, p, m, dp=dp, n_layers=n_layers)
    assert_matches(c)
    assert c.measured.get("collective-permute") == permutes(name, p, m).get("collective-permute")
