"""Timing on the GPU: CUDA events around each run, the median after warm-up."""

from __future__ import annotations

import statistics
import time

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


def wall_ms(fn, iters: int) -> float:
    """Mean wall-clock ms of ``fn`` after one warm-up run: for the CPU smoke runs of benchmarks."""
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters
