"""Pipeline schedules as data (lecture section 2), in pure Python: no module here imports JAX.

    schedule   the table actions[tick][device] and its validator; `make`, `simulate`
    stats      the statistics read off the table: bubble, peaks, sends
    orders     each schedule's device programs, the one registry of schedule names, deadlocks
    viz        ASCII timeline (the lecture's alphabet), PNG, Chrome/Perfetto trace
    timing     a schedule's order timed with measured costs: F, B, W per stage, comm on every
               send; Qi et al.'s bubble rate and peak memory in M_B
    published  Qi et al. 2023's Tables 3, 5, 6 and 8 (the figures the tests reproduce)
    search     a schedule searched under a memory cap: the API; search_problem (the flat
               tables and their timing), seeds (published orders, a repeated block),
               greedy (Qi et al.'s list scheduler under its policies), annealing (local moves)
    interchange  torch.pipelining's CSV schedule format, both ways

>>> from jaxpar.schedules import schedule
>>> s = schedule.make("1f1b", stages=4, microbatches=8)
>>> s.bubble_fraction()

`jaxpar.pipeline` executes any of these tables as one SPMD program (its `plan` turns a
schedule into the integer tables its scan indexes). An import contract in pyproject.toml
keeps JAX out of this package, so `jaxpar schedule` and `jaxpar plan` start at once.
"""
