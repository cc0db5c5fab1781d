"""Model-state memory per device: parameters, gradients, optimizer state (ZeRO, Rajbhandari
et al. 2020), for mixed-precision Adam.

    mixed precision   bf16 parameters (2 bytes) and gradients (2), fp32 master weights,
                      Adam's m and v (4 + 4 + 4 = 12 bytes: ZeRO's K = 12)  -> 16 bytes/param
    fp32              parameters 4, gradients 4, Adam 8                     -> 16 bytes/param

A device holds the dense parameters / (tp * pp) and the expert parameters / (ep * pp)
(experts are not tensor-split here). ZeRO splits over the data-parallel group (dp for
dense weights; dp / ep for experts, whose replicas are dp / ep):
    stage 0  nothing;  1  optimizer state;  2  + gradients;  3  + parameters.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpar import errors
from jaxpar.errors import ConfigError

PRECISIONS = {"mixed": (2, 2, 12), "fp32": (4, 4, 8)}   # (param, grad, optimizer) bytes per parameter


class States(NamedTuple):
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def state_bytes(*, dense: float, experts: float = 0, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                zero: int = 1, precision: str = "mixed") -> States:
    """Bytes per device of parameters, gradients and optimizer state, for `dense` and
    `experts` parameter counts (finite real numbers >= 0; ConfigError otherwise)."""
    dense = errors.number("dense", dense, zero=True, fix="dense is the dense parameter count, e.g. dense=8e9")
    experts = errors.number("experts", experts, zero=True,
                            fix="experts is the expert parameter count, e.g. experts=0 for a dense model")
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
        errors.whole(name, value)
    errors.one_of("precision", precision, tuple(PRECISIONS))
    if not errors.is_whole(zero) or zero not in (0, 1, 2, 3):
        raise ConfigError(f"zero={zero!r}: ZeRO stage 0, 1, 2 or 3")
    if experts and dp % ep:
        raise ConfigError(f"dp={dp} is not divisible by ep={ep}: expert parallelism shares the data-parallel "
                          "devices, ep of them hold one copy of the experts")
    per_param = PRECISIONS[precision]
    groups = ((dense / (tp * pp), dp), (experts / (ep * pp), dp // ep if experts else 1))
    out = [0.0, 0.0, 0.0]
    for n, group in groups:
        for j, b in enumerate(per_param):
            split = group if zero >= 3 - j else 1    # stage 1: optimizer (j=2), 2: grads (j=1), 3: params (j=0)
            out[j] += n * b / split
    return States(*out)
