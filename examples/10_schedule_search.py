"""Pipeline schedules searched under a memory cap, then run (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", section 3; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").

    python examples/10_schedule_search.py

On 8 fake CPU devices (4 used). `search.search` finds device orders with the backward split into
B and W for measured costs (Qi et al.'s 1.5B model) under a cap on each device's live activations
in M_B (one microbatch's on a stage; p M_B is 1F1B's memory); the result checked and timed against
1F1B and ZB-H1, run by the pipeline runtime on pp=4 against one device, the V placement the same
way, and a cap no order fits refused. Qi et al.'s Table 5: `python -m benchmarks.schedule_search`.
The searched schedule's timeline and its rivals' bubbles from the command line:

    jaxpar schedule search -p 4 -m 8 --memory 4 --costs F=18.522,B=18.086,W=9.337,comm=0.601
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline import runtime, stage  # noqa: E402
from jaxpar.schedules import schedule, search  # noqa: E402
from jaxpar.schedules.timing import Costs, timed  # noqa: E402
from jaxpar.testing import max_abs_diff  # noqa: E402

P, M = 4, 8                                                   # pipeline stages (devices), microbatches
COSTS = Costs.parse("F=18.522,B=18.086,W=9.337,comm=0.601")   # ms per action, Qi et al.'s 1.5B model


def lesson():
    print(f"== demo 1: search p={P}, m={M} under 1F1B's memory ({P} M_B) and twice it ==")
    for cap in (P, 2 * P):
        found = search.search(P, M, COSTS, memory_cap=cap)    # a Schedule: the table the runtime runs
        print(f"  cap {cap} M_B: bubble {found.timing.bubble:.4f}, peak memory "
              f"{max(found.timing.peak_memory):.2f} M_B, found by {found.method} in {found.search_seconds:.2f} s")


def demo_checked_and_timed():
    print(f"\n== demo 2: the schedule at {P} M_B checked and timed against 1F1B and ZB-H1 ==")
    found = search.search(P, M, COSTS, memory_cap=P)
    found.validate()                                      # dependencies, each action once, no deadlock
    search.validate_memory(found, COSTS, P)               # every device under the cap at every moment
    timing = timed(found, COSTS)                          # the same orders timed again: the same figures
    rates = {name: timed(schedule.make(name, P, M), COSTS).bubble for name in ("1f1b", "zb-h1")}
    ok = timing.bubble == found.timing.bubble and timing.bubble <= min(rates.values()) + 1e-12
    print(f"  valid, peak {max(timing.peak_memory):.2f} <= {P} M_B; bubble {timing.bubble:.4f} against "
          f"1F1B {rates['1f1b']:.4f} and ZB-H1 {rates['zb-h1']:.4f}  {'ok' if ok else 'FAIL'}")


def _run_against_one_device(found, what: str) -> None:
    """The schedule through runtime.run on pp=P, float64, against stage.unsharded."""
    m = mesh.make_mesh(pp=P, devices=jax.devices()[:P])
    with jax.enable_x64(True):
        params = stage.mlp_params(2 * P, 32, jnp.float64)     # {"w": [8, 32, 32], "b": [8, 32]}: layers first
        batch = stage.mlp_batch(4 * M, 32, jnp.float64)       # (inputs, targets) [32, 32]: 4-row microbatches
        loss, grads = runtime.run(found, stage.mlp_stage, params, batch, mesh=m)
        ref_loss, ref = stage.unsharded(stage.mlp_stage, params, batch)   # one device, the whole batch
        err = max_abs_diff((loss, grads), (ref_loss, ref))
    print(f"  {what}: max |pipeline - single device| over loss, dx, all weights = {err:.1e}  "
          f"{'ok' if err < 1e-9 else 'FAIL'}")


def demo_run():
    print(f"\n== demo 3: the searched schedule run on pp={P} ==")
    _run_against_one_device(search.search(P, M, COSTS, memory_cap=P), f"searched at {P} M_B")


def demo_v():
    print("\n== demo 4: the V placement (2 chunks a device, half a stage each) ==")
    half = Costs(F=COSTS.F / 2, B=COSTS.B / 2, W=COSTS.W / 2, comm=COSTS.comm)   # a chunk is half a stage
    for cap, name in ((P, "ZB-V's memory"), ((P + 2) // 2, "V-Half's memory")):
        found = search.search(P, M, half, memory_cap=cap, chunks=2, placement="v")
        print(f"  cap {cap} M_B ({name}): bubble {found.timing.bubble:.4f}, peak "
              f"{max(found.timing.peak_memory):.2f} M_B, by {found.method}")
    _run_against_one_device(found, f"V searched at {found.memory_cap:g} M_B")


def demo_bad_cap():
    print("\n== demo 5: a cap no order fits ==")
    try:
        search.search(P, M, COSTS, memory_cap=0.5)
        print("  no error (FAIL)")
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    lesson()
    demo_checked_and_timed()
    demo_run()
    demo_v()
    demo_bad_cap()
