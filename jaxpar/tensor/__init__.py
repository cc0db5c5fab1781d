"""Megatron tensor parallelism and sequence parallelism (lecture sections 3 and 4.4).

    ops       f, g and the sequence-parallel all-gather / reduce-scatter pair
    layers    column- and row-parallel linears, attention, MLP and block on one tp shard
    block     TPSpecs (every PartitionSpec of the block: Megatron's layout), the input
              checks, tp_block over a mesh
    vocab     VocabSpecs (the vocabulary-parallel layout); vocabulary-parallel embedding,
              LM head and cross-entropy; tp_loss end to end
    formulas  the collectives and bytes in closed form (pure Python)
    verify    against reference.block and reference.loss (`jaxpar verify tp|sp`)

>>> from jaxpar import tensor
>>> y = tensor.tp_block(reference.layer_params(params, 0), x, mesh=m, cfg=cfg, sequence_parallel=True)

The names below are loaded from their module on first use (PEP 562), so that importing
`jaxpar.tensor.formulas` (pure Python, read by the planner) does not start JAX.
"""

from jaxpar import lazy

# public name -> the module of this package that defines it
_EXPORTS = {
    "block": ("TPSpecs", "tp_block", "validate_batch", "validate_block_inputs", "validate_tp", "without_axis"),
    "formulas": ("block_param_bytes", "block_param_shapes", "cross_entropy_collectives", "embedding_collectives",
                 "lm_loss_collectives", "ring_bytes_per_device", "tp_block_collectives"),
    "layers": ("attention_shard", "block_shard", "column_parallel", "mlp_shard", "row_parallel", "row_split_gelu",
               "row_split_gelu_error"),
    "ops": ("copy_to_tp", "gather_from_sp", "reduce_from_tp", "reduce_scatter_to_sp"),
    "vocab": ("VocabSpecs", "cross_entropy_shard", "embedding_shard", "lm_head_loss_shard", "tp_loss",
              "vocab_parallel_cross_entropy", "vocab_parallel_embedding", "vocab_parallel_lm_loss"),
}
__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
