"""Profiling and debugging: a torch profiler trace and a CUDA memory snapshot over a step window.

    profiler = StepProfiler(cfg.profiling, dump_folder, rank, device)
    for step in ...:
        profiler.step_start(step)
        ...                                   # the training step
        profiler.step_end(step)               # after the window's last step: files are written
    profiler.close()

``[profiling] profile_start_step`` .. ``+ profile_steps - 1`` is the window. Outputs, per rank:
  * ``<dump_folder>/<save_traces_folder>/step-<a>-<b>/rank<r>_trace.json``: a Chrome trace (open in
    chrome://tracing or https://ui.perfetto.dev), CPU ops and, on CUDA, kernels.
  * ``<dump_folder>/<save_memory_snapshot_folder>/step-<b>/rank<r>_memory_snapshot.pickle``: every
    CUDA allocation and free of the window with its stack (drag into https://pytorch.org/memory_viz).
    CPU runs have no CUDA allocator to record: a note is printed instead.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from components.config import Profiling as ProfilingConfig

# Allocation events kept by the CUDA allocator's history (a ring buffer): enough for a few steps.
_MEMORY_HISTORY_ENTRIES = 100_000


class StepProfiler:
    def __init__(self, cfg: ProfilingConfig, dump_folder: str, rank: int, device: torch.device,
                 log=print):
        self.cfg, self.rank, self.device, self.log = cfg, rank, device, log
        self.first = cfg.profile_start_step
        self.last = cfg.profile_start_step + cfg.profile_steps - 1
        self.trace_dir = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self._profiler: torch.profiler.profile | None = None
        self._recording_memory = False
        self.written: list[Path] = []
        self.snapshot = cfg.enable_memory_snapshot and device.type == "cuda"
        if cfg.enable_memory_snapshot and device.type != "cuda":
            log(f"note: [profiling] enable_memory_snapshot records the CUDA caching allocator; this run is on "
                f"{device.type}, so no memory snapshot is written (the trace and the memory column of the "
                f"step log still are)", flush=True)

    def step_start(self, step: int) -> None:
        if step != self.first:
            return
        if self.cfg.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                    profile_memory=True, with_stack=False)
            self._profiler.__enter__()
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
            self._recording_memory = True

    def step_end(self, step: int) -> None:
        if step != self.last:
            return
        if self._profiler is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._profiler.__exit__(None, None, None)
            out = self.trace_dir / f"step-{self.first}-{self.last}"
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{self.rank}_trace.json"
            self._profiler.export_chrome_trace(str(path))
            self._profiler = None
            self.written.append(path)
            self.log(f"profiler trace of steps {self.first}-{self.last} written to {path}", flush=True)
        if self._recording_memory:
            out = self.snapshot_dir / f"step-{self.last}"
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{self.rank}_memory_snapshot.pickle"
            with path.open("wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
            self.written.append(path)
            self.log(f"CUDA memory snapshot of steps {self.first}-{self.last} written to {path}", flush=True)

    def close(self) -> None:
        """A run that ends inside the window still stops the profiler (nothing is written)."""
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self._profiler = None
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
