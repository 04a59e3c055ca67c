"""Throughput, FLOPs, MFU and memory: printed every ``log_freq`` steps, optionally to TensorBoard,
and summarised at the end of the run over a step window that follows the run's length
(:func:`summary_window`), with the final loss and the run's outputs. Slots that expert parallelism's
capacity dropped (``[parallelism] expert_capacity_overflow = "drop"``) appear in the line of a
logged step that dropped any, in TensorBoard at every logged step, and in the summary."""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch

from components.config import Metrics as MetricsConfig
from models.qwen3.args import Qwen3MoEArgs
from models.qwen3.model import count_params

# Dense bf16 peak (TFLOP/s) of GPUs we know; MFU is reported against this unless overridden.
_PEAK_BF16_TFLOPS = {"H100": 989.5, "H200": 989.5, "H800": 989.5, "A100": 312.0}

# A run longer than this many times [metrics] summary_end_step is summarised from summary_start_step
# to its end: its first steps say little about the throughput of the whole run.
LONG_RUN_FACTOR = 5


METRICS_FILE = "metrics.jsonl"  # in job.dump_folder


def flops_per_token(args: Qwen3MoEArgs, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward, no recompute): 6 x the active parameters that
    do matmuls (the embedding lookup does none) plus causal-free attention 12 x layers x heads x
    head_dim x seq_len, TorchTitan's convention, so figures compare with its MFU."""
    _, active = count_params(args)
    embedding = args.vocab_size * args.dim
    return 6 * (active - embedding) + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def device_peak_tflops(device: torch.device, configured: float) -> float | None:
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in _PEAK_BF16_TFLOPS.items():
            if key in name:
                return peak
    return None


def summary_window(first: int, last: int, start: int, end: int) -> tuple[int, int, str]:
    """The steps the end-of-run summary averages, for a run of steps ``first``..``last``, and a note
    when they are not ``[metrics] summary_start_step``..``summary_end_step`` (``start``..``end``).

    Steps count from the run's first (a resumed run warms up again, so it is measured the same way):
    * a run of at least ``end`` steps: ``start``..``end``, the window benchmarks are compared on;
    * a shorter run: from ``min(start, its middle)`` to its end, so the first step (compile and
      allocator warm-up) is left out whenever there is another;
    * a run longer than ``LONG_RUN_FACTOR x end`` steps: from ``start`` to its end."""
    n = last - first + 1
    if n < end:
        lo, hi, note = min(start, n // 2 + 1), n, f"run shorter than the window {start}-{end}"
    elif n > LONG_RUN_FACTOR * end:
        lo, hi, note = start, n, f"run longer than {LONG_RUN_FACTOR} x the window {start}-{end}"
    else:
        lo, hi, note = start, end, ""
    return first + lo - 1, first + hi - 1, note


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass
class MetricsLogger:
    cfg: MetricsConfig
    device: torch.device
    flops_per_token: int
    tokens_per_step: int  # per device
    log_dir: str | None = None
    simulated_world: int = 0  # > 1: rank 0 of a simulated world of this many ranks (parallelisms/simulate.py)
    step_times: dict[int, float] = field(default_factory=dict)
    # Simulated world: seconds of each step's loopback copies on the compute stream (the stand-ins for
    # its collectives), left out of the compute-only figures.
    loopback_times: dict[int, float] = field(default_factory=dict)
    # With expert parallelism TensorBoard gets the slots its capacity dropped at every logged step (0 too).
    expert_parallel: bool = False
    # Every logged step's figures as one JSON line (rank 0), read by ``python -m bench.loss_curves``.
    metrics_path: str | None = None

    def __post_init__(self) -> None:
        self.peak_tflops = device_peak_tflops(self.device, self.cfg.peak_tflops)
        self.writer = None
        if self.cfg.enable_tensorboard and self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self.writer = SummaryWriter(self.log_dir)
        self.metrics_file = None  # opened at the first record: a trainer built but never run writes nothing
        self._last = time.perf_counter()
        self.final_loss: tuple[int, float] | None = None
        # (dropped, routed) (token, expert) slots: per step, and summed over the run.
        self.drops: dict[int, tuple[int, int]] = {}
        self.run_drops = (0, 0)

    def start(self, first_step: int = 1) -> None:
        """Mark the start of the first timed step (after model build and compile warm-up setup)."""
        if self.metrics_path is not None:
            self._write({"start": first_step, "time": time.time()})
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._last = time.perf_counter()

    def step_done(self, step: int, loss: float, dropped: int = 0, routed: int = 0, loopback_s: float = 0.0) -> float:
        """Record the wall time and loss of ``step``, the (token, expert) slots it routed and expert
        parallelism's capacity ``dropped`` (over all ranks), and in a simulated world the seconds of
        its loopback copies; the caller has synchronised with the device."""
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self.step_times[step] = dt
        self.loopback_times[step] = loopback_s
        self.final_loss = (step, loss)
        self.drops[step] = (dropped, routed)
        self.run_drops = (self.run_drops[0] + dropped, self.run_drops[1] + routed)
        return dt

    def exclude_pause(self) -> None:
        """Leave the time since the last step (a checkpoint save) out of the next step's time."""
        self._last = time.perf_counter()

    def log(self, step: int, loss: float, aux_loss: float, grad_norm: float, lr: float) -> str:
        dt = self.step_times[step]
        tps = self.tokens_per_step / dt
        tflops = tps * self.flops_per_token / 1e12
        mfu = f"{100 * tflops / self.peak_tflops:.1f}%" if self.peak_tflops else "n/a"
        mem = peak_memory_gib(self.device)
        dropped, routed = self.drops.get(step, (0, 0))
        drops = f"  ep_dropped: {format_drops(dropped, routed)}" if dropped else ""
        line = (f"step: {step:5d}  loss: {loss:8.4f}  aux_loss: {aux_loss:.4f}  grad_norm: {grad_norm:7.4f}  "
                f"lr: {lr:.2e}  memory: {mem:6.2f}GiB  tps: {tps:,.0f}  step_time: {dt:.3f}s  "
                f"tflops: {tflops:.2f}  mfu: {mfu}{drops}{self._simulated([step])}")
        if self.writer is not None:
            scalars = [("loss", loss), ("aux_loss", aux_loss), ("grad_norm", grad_norm), ("lr", lr),
                       ("tokens_per_second", tps), ("tflops", tflops), ("memory_gib", mem)]
            if self.expert_parallel and routed:
                scalars += [("ep_dropped_slots", dropped), ("ep_dropped_fraction", dropped / routed)]
            for key, value in scalars:
                self.writer.add_scalar(key, value, step)
        if self.metrics_path is not None:
            self._write({"step": step, "loss": loss, "aux_loss": aux_loss, "grad_norm": grad_norm, "lr": lr,
                         "tps": tps, "step_time": dt, "memory_gib": mem, "tflops": tflops})
        return line

    def _write(self, record: dict) -> None:
        if self.metrics_file is None:
            os.makedirs(os.path.dirname(self.metrics_path) or ".", exist_ok=True)
            # Appended: a resumed run continues the file; its "start" record tells readers to drop
            # the steps from there on that an earlier run wrote.
            self.metrics_file = open(self.metrics_path, "a", encoding="utf-8")
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def log_expert_load(self, step: int, tokens_per_expert_LE: torch.Tensor) -> str:
        """The ``[metrics] log_expert_load`` line (and TensorBoard scalars) for one step's counts."""
        stats = expert_load_stats(tokens_per_expert_LE)
        if self.writer is not None:
            for i, s in enumerate(stats):
                self.writer.add_scalar(f"expert_load/imbalance_layer{i}", s["imbalance"], step)
                self.writer.add_scalar(f"expert_load/max_layer{i}", s["max"], step)
        return format_expert_load(step, stats)

    def summary(self, outputs: list[str]) -> str:
        """The closing lines: means over :func:`summary_window`, peak memory and the final loss, then
        ``outputs`` (what the run wrote, e.g. ``"checkpoints a, b"``)."""
        if not self.step_times:
            return "summary: no steps were run"
        ran = sorted(self.step_times)
        lo, hi, note = summary_window(ran[0], ran[-1], self.cfg.summary_start_step, self.cfg.summary_end_step)
        window_steps = [s for s in ran if lo <= s <= hi]
        window = [self.step_times[s] for s in window_steps]
        mean_dt = sum(window) / len(window)
        mean_tps = sum(self.tokens_per_step / t for t in window) / len(window)
        tflops = mean_tps * self.flops_per_token / 1e12
        mfu = f"{100 * tflops / self.peak_tflops:.1f}%" if self.peak_tflops else "n/a"
        step, loss = self.final_loss
        return (f"summary: steps {lo}-{hi} (of {ran[0]}-{ran[-1]}{'; ' + note if note else ''}): mean tokens/s "
                f"per device {mean_tps:,.0f}  mean step time {mean_dt:.3f}s  tflops {tflops:.2f}  mfu {mfu}  "
                f"peak memory {peak_memory_gib(self.device):.2f}GiB  final loss {loss:.4f} (step {step})"
                f"{self._run_drops()}{self._simulated(window_steps)}\n"
                f"outputs: {'; '.join(outputs) or 'none'}")

    def _run_drops(self) -> str:
        return f"  ep_dropped over the run: {format_drops(*self.run_drops)}" if self.run_drops[0] else ""

    def _simulated(self, steps: list[int]) -> str:
        """The mark of a simulated run's numbers (one rank's compute and memory, no communication),
        with the mean time of ``steps``' loopback copies and what is left without them: compute only."""
        if self.simulated_world < 2:
            return ""
        copies = sum(self.loopback_times.get(s, 0.0) for s in steps) / len(steps)
        compute = [self.step_times[s] - self.loopback_times.get(s, 0.0) for s in steps]
        mean_compute = sum(compute) / len(compute)
        tps = sum(self.tokens_per_step / t for t in compute) / len(compute) if min(compute) > 0 else float("nan")
        return (f"  [simulated rank 0 of {self.simulated_world}: no communication; loopback copies {copies:.3f}s, "
                f"compute only {mean_compute:.3f}s, {tps:,.0f} tokens/s per device]")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
            self.metrics_file = None


def format_drops(dropped: int, routed: int) -> str:
    """``dropped`` of ``routed`` (token, expert) slots, for the lines that report expert parallelism's
    capacity drops."""
    return f"{dropped:,} of {routed:,} routed slots ({100 * dropped / routed:.3g}%)"


def expert_load_stats(tokens_per_expert_LE: torch.Tensor) -> list[dict[str, float]]:
    """Per layer: min, max and mean routed (token, k) slots per expert, and the imbalance max/mean
    (1.0 = perfectly balanced, E = every slot on one expert)."""
    counts = tokens_per_expert_LE.detach().float().cpu()
    out = []
    for row_E in counts:
        mean = row_E.mean().item()
        out.append({"min": row_E.min().item(), "max": row_E.max().item(), "mean": mean,
                    "imbalance": row_E.max().item() / mean if mean > 0 else 0.0})
    return out


def format_expert_load(step: int, stats: list[dict[str, float]]) -> str:
    per_layer = "  ".join(f"L{i}: {s['min']:.0f}/{s['max']:.0f}/{s['mean']:.1f} ({s['imbalance']:.2f}x)"
                          for i, s in enumerate(stats))
    return f"step: {step:5d}  expert load (tokens per expert min/max/mean, max/mean): {per_layer}"
