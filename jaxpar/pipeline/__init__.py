"""Pipeline parallelism (lecture section 2): schedules as data, and a runtime that executes
any of them as one SPMD program.

    schedule   the table actions[tick][device] and its validator; `make`, `simulate`
    stats      the statistics read off the table: bubble, peaks, sends
    orders     each schedule's device programs, the one registry of schedule names, deadlocks
    viz        ASCII timeline (the lecture's alphabet), PNG, Chrome/Perfetto trace
    plan       a schedule as the integer tables the runtime indexes (a Row per step and device)
    stage_layers  how many layers each model stage holds (uneven stages): checked, proposed, parsed
    formulas   bubble fractions, microbatches in flight, the collectives of one step, bubble
               times with comm (pure Python)
    timing     a schedule's order timed with measured costs: F, B, W per stage, comm on every
               send; Qi et al.'s bubble rate and peak memory in M_B
    published  Qi et al. 2023's Tables 3, 5, 6 and 8 (the figures the tests reproduce)
    search     a schedule searched under a memory cap: the API; search_problem (the flat
               tables and their timing), seeds (published orders, a repeated block),
               greedy (Qi et al.'s list scheduler under its policies), annealing (local moves)
    interchange  torch.pipelining's CSV schedule format, both ways
    stage      what a stage is: layers(...), Grads, losses, the layer layout
    request    Request: one step's functions, shapes, specs and options, checked once
    local_shapes  what each device sees: the batch and the specs checked against the mesh
    passes     one stage's F, B and W: layers scanned, weight gradients added in place,
               the parameters never stored between F and B
    program    the per-device program: one lax.scan over the plan, sends as guarded ppermutes
    runtime    request / local / pipeline / run (an LRU cache of built steps) / run_pipeline:
               the program in one shard_map over every axis; layers_per_stage= for
               uneven stages (each padded to the largest, the padding skipped)
    modules    nnx_layers: a stage from flax NNX modules
    baseline   the forward-only scanned pipeline differentiated by autodiff (GPipe)
    verify     against the lecture and the unsharded model (`jaxpar verify schedule|pp`)

>>> from jaxpar.pipeline import schedule, runtime
>>> s = schedule.make("1f1b", stages=4, microbatches=8)
>>> loss, grads = runtime.run(s, runtime.layers(layer_fn), params, (inputs, targets), mesh=m)

Importing this package imports nothing: `schedule`, `stats`, `orders`, `viz`, `plan`,
`formulas`, `timing`, `published`, `search`, `interchange` and `stage_layers` never import JAX, so
`jaxpar schedule` starts at once.
"""
