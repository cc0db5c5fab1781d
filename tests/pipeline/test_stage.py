"""stage.to_microbatches / from_microbatches: the one split of a batch into microbatches."""

import numpy as np

from jaxpar.pipeline.stage import from_microbatches, to_microbatches


def test_microbatch_i_is_rows_i_mb_to_i_plus_1_mb_and_the_inverse_restores_the_batch():
    batch = np.arange(12 * 3).reshape(12, 3)
    parts = to_microbatches(batch, 4)                       # [4, 3, 3]
    assert parts.shape == (4, 3, 3)
    for i in range(4):
        np.testing.assert_array_equal(parts[i], batch[3 * i:3 * (i + 1)])
    np.testing.assert_array_equal(from_microbatches(parts), batch)
