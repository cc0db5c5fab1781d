"""The statistics of a schedule, all read off its table: busy and idle time, the bubble
(one step, and steps back to back), peak live activations, microbatches in flight until
W, and the sends between devices. `Schedule` inherits them; nothing here knows how a
table was built."""

from __future__ import annotations

import functools
from typing import NamedTuple

from jaxpar.errors import ConfigError


class Send(NamedTuple):
    """A point-to-point send: the output of F (activation, to the next stage) or of B
    (input gradient, to the previous stage) of `microbatch`, ready at `tick` on `src`
    (chunk `chunk`) and consumed from `needed_at` on `dst` (chunk `dst_chunk`)."""

    tick: int
    src: int
    dst: int
    kind: str
    microbatch: int
    chunk: int
    dst_chunk: int
    needed_at: int


class Statistics:
    """Mixed into `schedule.Schedule`: reads `_programs`, `cost`, `stage_of`, `device_of`,
    `start`, `total_time`, `stages`, `virtual_stages` and `split_backward`."""

    @functools.cached_property
    def busy_time(self) -> list[int]:
        return [sum(self.cost(a) for _, a in p) for p in self._programs]

    @functools.cached_property
    def idle_time(self) -> list[int]:
        """Idle ticks per device within [0, total_time)."""
        return [self.total_time - b for b in self.busy_time]

    @functools.cached_property
    def bubble_fraction(self) -> float:
        """Idle time / total time over all devices (the lecture's bubble)."""
        return sum(self.idle_time) / (self.stages * self.total_time) if self.total_time else 0.0

    @functools.cached_property
    def steady_bubble_fraction(self) -> float:
        """The bubble when steps run back to back and each device starts its next step as
        soon as its own last action ends (Qi et al.'s optimizer post-validation): the
        period is the longest per-device span from first start to last end."""
        spans = [p[-1][0] + self.cost(p[-1][1]) - p[0][0] for p in self._programs if p]
        period = max(spans, default=0)
        return 1 - sum(self.busy_time) / (self.stages * period) if period else 0.0

    def _peak(self, until: str, weights=None) -> list:
        """Per device, the most live microbatch-chunks from the start of F to the end of
        `until`, each counted 1 or, with `weights`, its model stage's weight."""
        peaks = []
        for d, prog in enumerate(self._programs):
            events = []
            for t, a in prog:
                w = 1 if weights is None else weights[self.stage_of(d, a.chunk)]
                if a.kind == "F":
                    events.append((t, 1, w))
                elif a.kind == until:
                    events.append((t + self.cost(a), 0, -w))
            live = peak = 0
            for _, _, delta in sorted(events):  # at a tie, the free (0) sorts before the new F (1)
                live += delta
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def weighted_peaks(self, weights) -> list:
        """`peak_activations` with each microbatch-chunk weighted by its model stage's entry
        of `weights` (one per virtual stage, e.g. its layers): uneven stages' activation
        peaks, in layers x microbatches, exact where a device's chunks differ in size."""
        if len(weights) != self.virtual_stages:
            raise ConfigError(f"{len(weights)} weights for {self.virtual_stages} stages: give one per stage")
        return self._peak("B", weights)

    @functools.cached_property
    def peak_activations(self) -> list[int]:
        """Per device, the most microbatch-chunks live at once (microbatches when chunks = 1; a
        chunk's activation is 1/chunks of a stage's), from the start of its F to the end of its B
        (input gradient)."""
        return self._peak("B")

    @functools.cached_property
    def peak_in_flight(self) -> list[int]:
        """Per device, the most microbatch-chunks whose weight gradient is still to come
        (from F to the end of W; equals `peak_activations` without the backward split):
        the slots for vjp residuals that the runtime keeps (`plan.py`)."""
        return self._peak("W" if self.split_backward else "B")

    @functools.cached_property
    def sends(self) -> list[Send]:
        """Every activation (F) and input gradient (B) that crosses devices, by tick; a
        hand-over between two chunks of one device (the turn of the V placement) is none."""
        out = []
        for d, prog in enumerate(self._programs):
            for t, a in prog:
                k = self.stage_of(d, a.chunk)
                nxt = k + 1 if a.kind == "F" else k - 1
                if a.kind == "W" or not 0 <= nxt < self.virtual_stages:
                    continue
                dst, dst_chunk = self.device_of(nxt)
                if dst != d:
                    out.append(Send(t + self.cost(a), d, dst, a.kind, a.microbatch, a.chunk,
                                    dst_chunk, self.start(a.kind, a.microbatch, nxt)))
        return sorted(out)
