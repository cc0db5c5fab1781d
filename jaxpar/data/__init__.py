"""Data parallelism (lecture 8 sec. 1 and 7): the gradient reduction every runtime ends
with, and ZeRO.

    reduce    reduce_gradients: each gradient summed over the batch axes its
              PartitionSpec does not split, once, after the backward (per shard)
    zero      ZeRO-1/2 and ZeRO-3: the plan (the dimension each leaf splits along over
              dp), the gradients' reduce-scatter, this rank's slice of a weight, the
              all-gather that rebuilds it, the optimizer state's PartitionSpecs; and
              ZeRO-3's `gathered` (a layer's weights gathered on entry, again in its
              backward, their gradients reduce-scattered)
    formulas  the bytes of the reduction and of ZeRO's collectives (pure Python)
    verify    against the unsharded gradient and AdamW step (`jaxpar verify dp`)

>>> from jaxpar import data
>>> grads = data.reduce_gradients(grads, pspecs, batch_axes=("dp",))      # inside shard_map

The composed trainer (`train.step`) and the pipeline runtime (`pipeline.runtime.pipeline`)
end with reduce_gradients. Not to be confused with `jaxpar.train.data`, the training
text. The names below load from their module on first use (PEP 562), so that importing
`jaxpar.data.formulas` does not start JAX.
"""

from jaxpar import lazy

# public name -> the module of this package that defines it
_EXPORTS = {
    "reduce": ("reduce_gradients", "weights"),
    "zero": ("gather_params", "local_shape", "plan", "reduce_scatter_gradients", "slice_params", "state_pspec",
             "state_pspecs", "zero_dim"),
    "formulas": ("Weight", "all_reduce_axes", "dp_collectives", "group_size", "reduction_bytes", "summed_axes",
                 "zero_bytes"),
}
__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
