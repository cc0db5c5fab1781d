"""Pipeline parallelism (lecture section 2): a runtime that executes any schedule as one
SPMD program. The schedules themselves, pure data, are `jaxpar.schedules`.

    plan       a schedule as the integer tables the runtime indexes (a Row per step and device)
    stage_layers  how many layers each model stage holds (uneven stages): checked, proposed, parsed
    formulas   bubble fractions, microbatches in flight, the collectives of one step, bubble
               times with comm (pure Python)
    stage      what a stage is: layers(...), Grads, losses, the layer layout
    request    Request: one step's functions, shapes, pspecs and options, checked once
    local_shapes  what each device sees: the batch and the pspecs checked against the mesh
    passes     one stage's F, B and W: layers scanned, weight gradients added in place,
               the parameters never stored between F and B
    program    the per-device program: one lax.scan over the plan, sends as guarded ppermutes
    direct     the one-stage program (pp = 1): value_and_grad over the layers
    runtime    request / local / pipeline / run (an LRU cache of built steps) / run_pipeline:
               the program in one shard_map over every axis; layers_per_stage= for
               uneven stages (each padded to the largest, the padding skipped)
    modules    nnx_layers: a stage from flax NNX modules
    baseline   the forward-only scanned pipeline differentiated by autodiff (GPipe)
    verify     against the lecture and the unsharded model (`jaxpar verify schedule|pp`)

>>> from jaxpar.schedules import schedule
>>> from jaxpar.pipeline import runtime
>>> s = schedule.make("1f1b", stages=4, microbatches=8)
>>> loss, grads = runtime.run(s, runtime.layers(layer_fn), params, (inputs, targets), mesh=m)

Importing this package imports nothing: `plan`, `formulas` and `stage_layers` never import
JAX, so `jaxpar plan` starts at once.
"""
