"""collective_stats on hand-built shard_map programs whose collectives are known in advance.

Every expected figure is written from the shapes, by the convention of comms.py's docstring:
all-reduce / reduce-scatter / all-to-all count the array each device hands in, all-gather
the gathered (full) array, collective-permute the block each device sends; ops in loops
count once per iteration; a conditional counts, per kind, its costliest branch.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import comms, mesh
from jaxpar.errors import ConfigError

N = jax.device_count()
needs_8 = pytest.mark.skipif(N != 8, reason="written for the 8 fake CPU devices of conftest.py")

ROWS, COLS = 8, 16                      # per-device block f32[8, 16]
BLOCK = ROWS * COLS * 4                 # 512 bytes
RING = [(i, (i + 1) % N) for i in range(N)]


@pytest.fixture(scope="module")
def m1():
    return mesh.make_mesh(dp=N)


def shard(body, m, in_specs=P("dp"), out_specs=P("dp")):
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=in_specs, out_specs=out_specs))


def x_global(dtype=jnp.float32):
    return jnp.ones((ROWS * N, COLS), dtype)


def stats_of(fn, *args):
    return comms.nonzero(comms.collective_stats(fn, *args))


def test_every_kind_is_reported_even_when_absent(m1):
    stats = comms.collective_stats(shard(lambda x: x * 2 + 1, m1), x_global())
    assert set(stats) == set(comms.KINDS)
    assert all(v == {"count": 0, "bytes": 0, "wire_bytes": 0.0, "in_conditional": 0} for v in stats.values())
    assert comms.format_stats(stats) == "-"


def test_psum(m1):
    f = shard(lambda x: jax.lax.psum(x, "dp"), m1)
    assert stats_of(f, x_global()) == {"all-reduce": (1, BLOCK)}


def test_all_gather_tiled_counts_the_gathered_array(m1):
    f = shard(lambda x: jax.lax.all_gather(x, "dp", tiled=True), m1)
    assert stats_of(f, x_global()) == {"all-gather": (1, N * BLOCK)}


def test_all_gather_untiled(m1):
    f = shard(lambda x: jax.lax.all_gather(x, "dp"), m1)
    assert stats_of(f, x_global()) == {"all-gather": (1, N * BLOCK)}


def test_psum_scatter_counts_the_array_before_the_scatter(m1):
    f = shard(lambda x: jax.lax.psum_scatter(x, "dp", tiled=True), m1)
    assert stats_of(f, x_global()) == {"reduce-scatter": (1, BLOCK)}


def test_ppermute_ring(m1):
    f = shard(lambda x: jax.lax.ppermute(x, "dp", RING), m1)
    assert stats_of(f, x_global()) == {"collective-permute": (1, BLOCK)}


def test_all_to_all(m1):
    f = shard(lambda x: jax.lax.all_to_all(x, "dp", 0, 0, tiled=True), m1)
    assert stats_of(f, x_global()) == {"all-to-all": (1, BLOCK)}


@pytest.mark.parametrize("dtype, itemsize", [(jnp.int8, 1), (jnp.float16, 2), (jnp.int32, 4)])
def test_bytes_follow_the_dtype(m1, dtype, itemsize):
    # (bfloat16 is left out: XLA:CPU widens a bf16 all-reduce to f32, and the compiled
    # program is what is counted.)
    f = shard(lambda x: jax.lax.psum(x, "dp"), m1)
    assert stats_of(f, x_global(dtype)) == {"all-reduce": (1, ROWS * COLS * itemsize)}


def test_scan_counts_once_per_step(m1):
    steps = 5

    def body(x):
        def step(c, _):
            c = jax.lax.ppermute(c, "dp", RING)
            return c + jax.lax.psum(c, "dp"), None
        return jax.lax.scan(step, x, None, length=steps)[0]

    got = stats_of(shard(body, m1), x_global())
    assert got == {"collective-permute": (steps, steps * BLOCK), "all-reduce": (steps, steps * BLOCK)}


def test_nested_scan_multiplies_trip_counts(m1):
    outer_steps, inner_steps = 4, 3

    def body(x):
        def inner(c, _):
            return jax.lax.ppermute(c, "dp", RING) * 2, None

        def outer(c, _):
            c = jax.lax.scan(inner, c, None, length=inner_steps)[0]
            return c + jax.lax.psum(c, "dp"), None
        return jax.lax.scan(outer, x, None, length=outer_steps)[0]

    got = stats_of(shard(body, m1), x_global())
    n_perm = outer_steps * inner_steps
    assert got == {"collective-permute": (n_perm, n_perm * BLOCK), "all-reduce": (outer_steps, outer_steps * BLOCK)}


def test_fori_loop_with_static_bounds_is_counted(m1):
    f = shard(lambda x: jax.lax.fori_loop(0, 6, lambda i, c: jax.lax.ppermute(c, "dp", RING) + 1, x), m1)
    assert stats_of(f, x_global()) == {"collective-permute": (6, 6 * BLOCK)}


def test_while_loop_without_known_trip_count_is_an_error(m1):
    def body(x):
        n = x[0, 0].astype(jnp.int32)  # bound known only at run time
        return jax.lax.fori_loop(0, n, lambda i, c: jax.lax.ppermute(c, "dp", RING), x)

    with pytest.raises(ValueError, match="no known trip count.*lax.scan"):
        comms.collective_stats(shard(body, m1), x_global())


def test_cond_bounds_each_kind_by_its_branch(m1):
    def body(x):
        return jax.lax.cond(x.sum() > 0,
                            lambda x: x + jax.lax.psum(x, "dp"),                          # BLOCK
                            lambda x: jax.lax.all_gather(x, "dp", tiled=True)[:ROWS],     # N * BLOCK
                            x)

    assert stats_of(shard(body, m1), x_global()) == {"all-reduce": (1, BLOCK), "all-gather": (1, N * BLOCK)}


def test_switch_takes_the_costliest_branch_per_kind(m1):
    # Branch 0: one all-to-all; branch 1: an all-reduce and a permute; branch 2 nothing.
    # Each kind counts its heaviest branch, so every kind that may run is bounded.
    def body(x):
        i = (x[0, 0] > 0).astype(jnp.int32)
        return jax.lax.switch(i, [
            lambda x: jax.lax.all_to_all(x, "dp", 0, 0, tiled=True),
            lambda x: jax.lax.ppermute(x + jax.lax.psum(x, "dp"), "dp", RING),
            lambda x: x * 3,
        ], x)

    stats = comms.collective_stats(shard(body, m1), x_global())
    assert comms.nonzero(stats) == {"all-to-all": (1, BLOCK), "all-reduce": (1, BLOCK),
                                    "collective-permute": (1, BLOCK)}
    assert all(v["in_conditional"] == v["count"] for v in stats.values())


def test_every_branch_lists_each_branchs_ops_where_the_bound_keeps_the_heaviest(m1):
    """Two branches each with an all-reduce, of different sizes: the bound keeps the larger
    one's; every_branch=True lists both, flagged conditional, each under its own scope
    (what a caller that knows each branch's runs counts exactly: the trainer's ZeRO-3)."""
    def body(x):
        i = (x[0, 0] > 0).astype(jnp.int32)
        def small(x):
            with jax.named_scope("small"):
                return x + jax.lax.psum(x[:1], "dp")
        def big(x):
            with jax.named_scope("big"):
                return x + jax.lax.psum(x, "dp")
        return jax.lax.switch(i, [small, big], x)

    hlo = comms.compiled_text(shard(body, m1), x_global())
    heaviest = [o for o in comms.collective_ops_from_hlo(hlo) if o.kind == "all-reduce"]
    every = [o for o in comms.collective_ops_from_hlo(hlo, every_branch=True) if o.kind == "all-reduce"]
    assert [o.bytes for o in heaviest] == [BLOCK]
    assert sorted(o.bytes for o in every) == sorted([BLOCK, BLOCK // ROWS]) and all(o.conditional for o in every)
    assert {("big" in o.scope, "small" in o.scope) for o in every} == {(True, False), (False, True)}


def test_nested_conditionals_in_a_scan_bound_every_kind(m1):
    # switch(nothing | psum | all_gather) in a scan of 6: a per-branch maximum would drop
    # the all-reduce; the per-kind bound keeps both kinds, 6 times each.
    steps = 6

    def body(x):
        def step(c, i):
            c = jax.lax.switch(i % 3, [
                lambda c: c * 2,
                lambda c: c + jax.lax.psum(c, "dp"),
                lambda c: jax.lax.cond(c.sum() > 0,
                                       lambda c: jax.lax.all_gather(c, "dp", tiled=True)[:ROWS],
                                       lambda c: jax.lax.ppermute(c, "dp", RING), c),
            ], c)
            return c, None
        return jax.lax.scan(step, x, jnp.arange(steps))[0]

    stats = comms.collective_stats(shard(body, m1), x_global())
    assert comms.nonzero(stats) == {"all-reduce": (steps, steps * BLOCK),
                                    "all-gather": (steps, steps * N * BLOCK),
                                    "collective-permute": (steps, steps * BLOCK)}
    assert sum(v["in_conditional"] for v in stats.values()) == 3 * steps


def test_scan_around_a_cond(m1):
    steps = 3

    def body(x):
        def step(c, _):
            c = jax.lax.cond(c.sum() > 0, lambda c: jax.lax.ppermute(c, "dp", RING), lambda c: c * 2, c)
            return c, None
        return jax.lax.scan(step, x, None, length=steps)[0]

    assert stats_of(shard(body, m1), x_global()) == {"collective-permute": (steps, steps * BLOCK)}


@needs_8
@pytest.mark.parametrize("axis, group", [("tp", 4), ("dp", 2)])
def test_psum_over_one_axis_of_a_2d_mesh_sets_group_size_and_wire_bytes(axis, group):
    m = mesh.make_mesh(dp=2, tp=4)
    pspec = P(("dp", "tp"))
    f = shard(lambda x: jax.lax.psum(x, axis), m, pspec, pspec)
    (op,) = comms.collective_ops(f, x_global())
    assert (op.kind, op.group_size, op.bytes, op.executions) == ("all-reduce", group, BLOCK, 1)
    stats = comms.collective_stats(f, x_global())["all-reduce"]
    assert stats["wire_bytes"] == pytest.approx(BLOCK * 2 * (group - 1) / group)  # ring all-reduce


@needs_8
def test_all_gather_over_tp_of_a_2d_mesh():
    m = mesh.make_mesh(dp=2, tp=4)
    pspec = P(("dp", "tp"))
    f = shard(lambda x: jax.lax.all_gather(x, "tp", tiled=True), m, pspec, pspec)
    (op,) = comms.collective_ops(f, x_global())
    assert (op.kind, op.group_size, op.bytes) == ("all-gather", 4, 4 * BLOCK)
    assert op.wire_bytes == pytest.approx(3 * BLOCK)  # (n-1)/n of the gathered array


def test_permute_wire_bytes_are_the_block(m1):
    (op,) = comms.collective_ops(shard(lambda x: jax.lax.ppermute(x, "dp", RING), m1), x_global())
    assert (op.group_size, op.wire_bytes) == (2, BLOCK)


def test_grad_of_ppermute_is_the_reverse_ppermute(m1):
    f = shard(lambda x: jax.lax.ppermute(x, "dp", RING), m1)
    g = jax.jit(jax.grad(lambda x: (f(x) ** 2).sum()))
    assert stats_of(g, x_global()) == {"collective-permute": (2, 2 * BLOCK)}


def test_grad_of_all_gather_is_a_reduce_scatter(m1):
    f = shard(lambda x: jax.lax.all_gather(x, "dp", tiled=True), m1)
    g = jax.jit(jax.grad(lambda x: (f(x) ** 2).sum()))
    assert stats_of(g, x_global()) == {"all-gather": (1, N * BLOCK), "reduce-scatter": (1, N * BLOCK)}


def test_grad_of_a_psum_program_reduces_the_cotangent(m1):
    # y = x * psum(x^2); loss = sum(y^2). The backward psum of (dy * x) needs dy, which
    # needs the forward psum, so XLA cannot merge the two all-reduces into one.
    f = shard(lambda x: x * jax.lax.psum(x * x, "dp"), m1)
    g = jax.jit(jax.grad(lambda x: (f(x) ** 2).sum()))
    assert stats_of(g, x_global()) == {"all-reduce": (2, 2 * BLOCK)}


def test_combined_all_reduce_keeps_the_bytes_of_all_operands(m1):
    # Two independent psums: XLA may combine them into one tuple all-reduce (one op) or not;
    # either way the bytes are the two arrays'.
    f = shard(lambda x: (jax.lax.psum(x, "dp"), jax.lax.psum(2 * x, "dp")), m1, out_specs=(P("dp"), P("dp")))
    (count, nbytes), = stats_of(f, x_global()).values()
    assert nbytes == 2 * BLOCK and count in (1, 2)


def test_refuses_an_unjitted_function_and_counts_it_jitted(m1):
    # the collectives are read from a compiled program: comms needs no JAX of its own
    fn = jax.shard_map(lambda x: jax.lax.psum(x, "dp"), mesh=m1, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(ConfigError, match="is not jitted.*jax.jit"):
        stats_of(fn, x_global())
    assert stats_of(jax.jit(fn), x_global()) == {"all-reduce": (1, BLOCK)}


def test_collectives_value_compares_adds_and_serialises():
    a = comms.Collectives({"all-reduce": (2, 64), "all-gather": (0, 0)})
    assert a == {"all-reduce": (2, 64)} and list(a) == ["all-reduce"] and len(a) == 1
    b = a + {"collective-permute": (3, 12), "all-reduce": (1, 8)}
    assert b == {"all-reduce": (3, 72), "collective-permute": (3, 12)}
    assert list(b) == ["all-reduce", "collective-permute"]           # KINDS order, whatever the input order
    assert b.format() == "3 AR 72 B + 3 CP 12 B" and comms.Collectives().format() == "-"
    assert b.to_json() == {"all-reduce": {"count": 3, "bytes": 72}, "collective-permute": {"count": 3, "bytes": 12}}
    with pytest.raises(ConfigError, match="'all-sum'"):
        comms.Collectives({"all-sum": (1, 1)})


# ---------------------------------------------------------------- the HLO reader on text

# GPU-style HLO: async start/done pairs, iota replica groups, operand types printed inline.
GPU_STYLE_HLO = """\
HloModule jit_f, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[8,16]{1,0}) %p), index=0
  %c = f32[8,16]{1,0} get-tuple-element((s32[], f32[8,16]{1,0}) %p), index=1
  %cps = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(f32[8,16]{1,0} %c), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %cpd = f32[8,16]{1,0} collective-permute-done((f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) %cps)
  %one = s32[] constant(1)
  %j = s32[] add(s32[] %i, s32[] %one)
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(s32[] %j, f32[8,16]{1,0} %cpd)
}

%cond (q: (s32[], f32[8,16])) -> pred[] {
  %q = (s32[], f32[8,16]{1,0}) parameter(0)
  %k = s32[] get-tuple-element((s32[], f32[8,16]{1,0}) %q), index=0
  %lim = s32[] constant(7)
  ROOT %lt = pred[] compare(s32[] %k, s32[] %lim), direction=LT
}

ENTRY %main (x: f32[8,16]) -> f32[64,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %ars = f32[8,16]{1,0} all-reduce-start(f32[8,16]{1,0} %x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = f32[8,16]{1,0} all-reduce-done(f32[8,16]{1,0} %ars)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}) tuple(s32[] %zero, f32[8,16]{1,0} %ard)
  %w = (s32[], f32[8,16]{1,0}) while((s32[], f32[8,16]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %y = f32[8,16]{1,0} get-tuple-element((s32[], f32[8,16]{1,0}) %w), index=1
  %ags = (f32[8,16]{1,0}, f32[64,16]{1,0}) all-gather-start(f32[8,16]{1,0} %y), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %agd = f32[64,16]{1,0} all-gather-done((f32[8,16]{1,0}, f32[64,16]{1,0}) %ags)
}
"""


def test_reader_on_gpu_style_hlo_text():
    ops = {op.kind: op for op in comms.collective_ops_from_hlo(GPU_STYLE_HLO)}
    assert set(ops) == {"all-reduce", "collective-permute", "all-gather"}  # start/done counted once
    ar, cp, ag = ops["all-reduce"], ops["collective-permute"], ops["all-gather"]
    assert (ar.bytes, ar.group_size, ar.executions) == (BLOCK, 4, 1)        # [2,4]<=[8]: groups of 4
    assert (cp.bytes, cp.executions, cp.computation) == (BLOCK, 7, "body")  # known_trip_count 7
    assert (ag.bytes, ag.group_size, ag.executions) == (8 * BLOCK, 8, 1)
    stats = comms.summarize(list(ops.values()))
    assert stats["collective-permute"] == {"count": 7, "bytes": 7 * BLOCK, "wire_bytes": 7.0 * BLOCK,
                                           "in_conditional": 0}


def test_reader_rejects_text_without_entry():
    with pytest.raises(ValueError, match="no ENTRY"):
        comms.collective_ops_from_hlo("HloModule m\n")


def test_format_and_human_bytes():
    stats = comms.summarize([
        comms.CollectiveOp("all-reduce", "a", "main", 32768, 8, 2),
        comms.CollectiveOp("collective-permute", "b", "body", 2048, 2, 4),
    ])
    assert comms.nonzero(stats) == {"all-reduce": (2, 65536), "collective-permute": (4, 8192)}
    assert comms.format_stats(stats) == "2 AR 64.0 KiB + 4 CP 8.0 KiB"
    assert [comms.human_bytes(b) for b in (512, 1536, 3 * 2**20, 5 * 2**30)] == \
        ["512 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]


# GPU-style: XLA:GPU wraps reduce-scatter / all-to-all in async-start/async-done, and both
# instructions name the wrapped computation with calls=.
ASYNC_WRAPPED_HLO = """\
HloModule jit_g, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%async_rs (p0: f32[64,16]) -> f32[8,16] {
  %p0 = f32[64,16]{1,0} parameter(0)
  ROOT %rs = f32[8,16]{1,0} reduce-scatter(f32[64,16]{1,0} %p0), channel_id=1, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[64,16]) -> f32[8,16] {
  %x = f32[64,16]{1,0} parameter(0)
  %rs-start = ((f32[64,16]{1,0}), f32[8,16]{1,0}) async-start(f32[64,16]{1,0} %x), calls=%async_rs
  ROOT %rs-done = f32[8,16]{1,0} async-done(((f32[64,16]{1,0}), f32[8,16]{1,0}) %rs-start), calls=%async_rs
}
"""


def test_reader_counts_an_async_wrapped_collective_once():
    ops = comms.collective_ops_from_hlo(ASYNC_WRAPPED_HLO)
    assert [(op.kind, op.bytes, op.group_size, op.executions) for op in ops] == [("reduce-scatter", 8 * BLOCK, 8, 1)]


_MERGED = """HloModule m, num_partitions=2

ENTRY %main (p0: f32[4], p1: f32[8]) -> (f32[4], f32[8]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  ROOT %all-reduce = (f32[4]{0}, f32[8]{0}) all-reduce(%p0, %p1), channel_id=1, replica_groups=[1,2]<=[2], to_apply=%add, metadata={op_name="jit(f)/shard_map/(NAMES)"}
}
"""


def test_a_merged_all_reduce_splits_into_the_collectives_it_was_made_of():
    # XLA's combiner names the parts it merged, one per tuple element, after their common prefix
    hlo = _MERGED.replace("NAMES", "a/psum:transpose(jvp(b:c))/psum")
    (whole,) = comms.collective_ops_from_hlo(hlo)
    assert (whole.bytes, whole.group_size) == (48, 2)
    parts = comms.collective_ops_from_hlo(hlo, split_combined=True)
    assert [(p.kind, p.bytes, p.scope) for p in parts] == [
        ("all-reduce", 16, "jit(f)/shard_map/a/psum"), ("all-reduce", 32, "jit(f)/shard_map/transpose(jvp(b:c))/psum")]
    assert all(p.group_size == 2 and p.executions == 1 for p in parts)


@pytest.mark.parametrize("names", ["a/psum", "a/psum:b/psum:c/psum"])
def test_a_merged_all_reduce_whose_names_do_not_match_its_elements_stays_whole(names):
    (op,) = comms.collective_ops_from_hlo(_MERGED.replace("NAMES", names), split_combined=True)
    assert op.bytes == 48


def test_a_merged_all_reduce_of_one_name_splits_into_its_elements():
    # psums written under one name (the same line of JAX code, e.g. each layer's gain
    # gradient) keep that name when XLA merges them: one part per tuple element, each its bytes
    hlo = _MERGED.replace("/(NAMES)", "/transpose(jvp())/psum")
    parts = comms.collective_ops_from_hlo(hlo, split_combined=True)
    assert [(p.kind, p.bytes, p.scope) for p in parts] == [
        ("all-reduce", 16, "jit(f)/shard_map/transpose(jvp())/psum"),
        ("all-reduce", 32, "jit(f)/shard_map/transpose(jvp())/psum")]
    (whole,) = comms.collective_ops_from_hlo(hlo)
    assert whole.bytes == 48
