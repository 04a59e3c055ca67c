"""Python garbage collection on the trainer's schedule instead of the interpreter's.

CPython's automatic collector starts a full (generation 2) pass whenever enough objects have been
allocated, wherever the program is. A training process holds a large heap (modules, compiled
graphs, DTensor metadata), so a full pass is long, and the optimizer step, which allocates
many small objects, is where one usually starts: the GPU then idles for it. As TorchTitan does
(``[training] gc_freq``), the trainer turns automatic collection off while it trains and collects
the young generations itself every ``gc_freq`` steps, at the start of a step, so each pause is
short, predictable and inside a step's measured time; cyclic garbage then lives at most
``gc_freq`` steps.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """``with GarbageCollection(freq) as collector:`` around the loop, ``collector.step(n)`` at the
    start of step ``n``. ``freq = 0`` leaves Python's automatic collection on (nothing changes)."""

    def __init__(self, freq: int):
        self.freq = freq

    def __enter__(self) -> GarbageCollection:
        self._was_enabled = gc.isenabled()
        if self.freq > 0:
            gc.collect()  # the start-up garbage (build, compile set-up) once, before timing starts
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.freq > 0 and self._was_enabled:
            gc.enable()

    def step(self, step: int) -> None:
        # Step 2 too: the first step's compilation leaves the most garbage. Generations 0 and 1 hold
        # everything allocated since the last collection; the long-lived generation 2, the
        # expensive part, is left alone.
        if self.freq > 0 and (step == 2 or (step > 1 and step % self.freq == 0)):
            gc.collect(1)
