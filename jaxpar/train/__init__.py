"""Techniques composed (DESIGN.md "Composition"): the only package that imports several.

    stages   the reference model as per-shard pipeline stages: tensor-parallel blocks,
             the vocab-parallel embedding on the first stage, the LM head and
             vocab-parallel cross-entropy on the last, run by `pipeline.runtime`
    verify   against `reference.loss` (`jaxpar verify pp-tp`)
"""
