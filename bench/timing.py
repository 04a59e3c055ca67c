"""Timing on the GPU: CUDA events around each run, the median after warm-up."""

from __future__ import annotations

import statistics

import torch


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median over ``iters`` runs of ``fn``, in ms, each run timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
