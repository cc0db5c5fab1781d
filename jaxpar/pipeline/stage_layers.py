"""How many layers each model stage holds, for pipelines whose stages are uneven.

A model of L layers on p*chunks model stages (p devices, `chunks` each) holds, per stage, either
L / (p*chunks) layers (the even split) or the counts `layers_per_stage` gives, one per model
stage in model order, e.g. (1, 2, 2, 1): the first and last stages also run the embedding
and the LM head, so they hold fewer layers. This module checks such counts against the
model (`layer_split`), proposes the nearest-to-even split (`even_or_near`), tells an even
split (`is_even`) and reads the CLI's "1,2,2,1" form (`parse_layer_split`). The runtime
(`request.py`, `stage.py`), the training spec, the planner and the CLI use it; the layers
a device runs in one step are counted by `plan.Plan.layer_runs`. Pure Python: no JAX.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError, is_whole, whole


def layer_split(layers_per_stage, n_layers: int, n_stages: int, *, what: str = "layers_per_stage") -> tuple[int, ...]:
    """`layers_per_stage` checked against a model of `n_layers` layers on `n_stages` model
    stages (p*chunks: one entry per model stage, in model order, whatever device holds it), as
    a tuple of ints; None gives the even split, refused unless n_stages divides n_layers.
    E.g. (1, 2, 2, 1) for 6 layers on p = 4: the first and last stages, which also run the
    embedding and the LM head, hold fewer layers. ConfigError naming the value and a fix."""
    if layers_per_stage is None:
        if n_layers < n_stages or n_layers % n_stages:
            example = f", e.g. {even_or_near(n_layers, n_stages)}" if n_layers >= n_stages else ""
            raise ConfigError(f"{n_layers} layers do not split evenly into {n_stages} stages: use a layer count "
                              f"divisible by {n_stages}, or give {what} (one count per stage, summing to "
                              f"{n_layers}){example}")
        return (n_layers // n_stages,) * n_stages
    example = even_or_near(n_layers, n_stages) if n_layers >= n_stages else None
    fix = f", e.g. {what}={example}" if example else f": {n_layers} layers cannot fill {n_stages} stages"
    if isinstance(layers_per_stage, (str, bytes)) or not hasattr(layers_per_stage, "__len__"):
        raise ConfigError(f"{what}={layers_per_stage!r}: give a tuple of whole numbers, one per model stage "
                          f"({n_stages}){fix}")
    counts = tuple(layers_per_stage)
    if len(counts) != n_stages:
        raise ConfigError(f"{what}={counts!r} has {len(counts)} entries for {n_stages} model stages (p*v: one "
                          f"per stage, in model order){fix}")
    bad = [c for c in counts if not is_whole(c) or c < 1]
    if bad:
        raise ConfigError(f"{what}={counts!r}: entries {bad!r} are not whole numbers >= 1 (every stage holds at "
                          f"least one layer){fix}")
    counts = tuple(int(c) for c in counts)
    if sum(counts) != n_layers:
        raise ConfigError(f"{what}={counts!r} sums to {sum(counts)}, the model has {n_layers} layers: give counts "
                          f"summing to {n_layers}{fix}")
    return counts


def even_or_near(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """n_layers over n_stages as evenly as whole layers allow, the extra layers on the
    middle stages (the ends carry the embedding and the head): (1, 2, 2, 1) for 6 on 4.
    Every stage holds at least one layer: fewer layers than stages are refused (ConfigError)."""
    whole("n_stages", n_stages, fix="n_stages counts the model stages (p*chunks), e.g. n_stages=4")
    whole("n_layers", n_layers, minimum=n_stages,
          fix=f"every one of the {n_stages} stages holds at least one layer: use n_layers={n_stages} or more, "
              "or fewer stages")
    base, extra = divmod(n_layers, n_stages)
    order = sorted(range(n_stages), key=lambda k: (-min(k, n_stages - 1 - k), k))
    more = set(order[:extra])
    return tuple(base + (k in more) for k in range(n_stages))


def is_even(counts: tuple[int, ...]) -> bool:
    """Whether every stage holds the same number of layers (the runtime's plain program)."""
    return len(set(counts)) <= 1


def parse_layer_split(text: str, *, what: str = "--layers-per-stage") -> tuple[int, ...]:
    """'1,2,2,1' (the CLI's form) -> (1, 2, 2, 1); the counts are checked against the
    model by `layer_split`."""
    parts = [t.strip() for t in str(text).split(",")]
    if not parts or not all(t.isdigit() for t in parts):
        raise ConfigError(f"{what} {text!r}: give whole layer counts separated by commas, one per model stage, "
                          "e.g. 1,2,2,1")
    return tuple(int(t) for t in parts)
