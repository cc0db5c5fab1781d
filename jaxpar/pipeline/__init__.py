"""Pipeline parallelism (lecture section 2): schedules as data, and a runtime that executes
any of them as one SPMD program.

    schedule   the table actions[tick][device] and its validator; `make`, `simulate`
    stats      the statistics read off the table: bubble, peaks, sends
    orders     each schedule's device programs, the one registry of schedule names, deadlocks
    viz        ASCII timeline (the lecture's alphabet), PNG, Chrome/Perfetto trace
    plan       a schedule as the integer tables the runtime indexes (a Row per step and device)
    formulas   bubble fractions, microbatches in flight, the collectives of one step (pure Python)
    stage      what a stage is: layers(...), Grads, losses, the layer layout
    request    Request: one step's functions, shapes, specs and options, checked once
    passes     one stage's F, B and W: layers scanned, weight gradients added in place,
               the parameters never stored between F and B
    program    the per-device program: one lax.scan over the plan, sends as guarded ppermutes
    runtime    request / local / pipeline / run (an LRU cache of built steps) / run_pipeline:
               the program in one shard_map over every axis
    modules    nnx_layers: a stage from flax NNX modules
    baseline   the forward-only scanned pipeline differentiated by autodiff (GPipe)
    verify     against the lecture and the unsharded model (`jaxpar verify schedule|pp`)

>>> from jaxpar.pipeline import schedule, runtime
>>> s = schedule.make("1f1b", stages=4, microbatches=8)
>>> loss, grads = runtime.run(s, runtime.layers(layer_fn), params, (inputs, targets), mesh=m)

Importing this package imports nothing: `schedule`, `stats`, `orders`, `viz`, `plan` and
`formulas` never import JAX, so `jaxpar schedule` starts at once.
"""
