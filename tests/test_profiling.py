"""[profiling] traces and memory snapshots, the --debug expert-load log, and the metrics of slots
expert parallelism's capacity dropped."""

from __future__ import annotations

import json
import re

import pytest
import torch

from components.metrics import MetricsLogger, expert_load_stats, format_expert_load
from train import main

SMALL = ["--config", "train_configs/debug_model.toml", "--model.n_layers", "2", "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--metrics.log_freq", "2", "--training.steps", "4"]


def test_trace_is_written_for_the_window(tmp_path, capsys):
    rc = main([*SMALL, "--job.dump_folder", str(tmp_path), "--profiling.enable_profiling",
               "--profiling.profile_start_step", "2", "--profiling.profile_steps", "2",
               "--profiling.enable_memory_snapshot"])
    out = capsys.readouterr().out
    assert rc == 0
    trace = tmp_path / "profile_traces" / "step-2-3" / "rank0_trace.json"
    assert [p.name for p in (tmp_path / "profile_traces").iterdir()] == ["step-2-3"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("aten::mm" in n or "aten::addmm" in n for n in names)  # the model's matmuls were recorded
    assert f"profiler trace of steps 2-3 written to {trace}" in out
    if not torch.cuda.is_available():
        assert "no memory snapshot is written" in out
        assert not (tmp_path / "memory_snapshot").exists()


def test_no_trace_unless_enabled_or_reached(tmp_path, capsys):
    assert main([*SMALL, "--job.dump_folder", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "profile_traces").exists()
    # Without --debug (or [metrics] log_expert_load) no expert-load lines either.
    out = capsys.readouterr().out
    assert "loss:" in out and "expert load" not in out
    # A window past the last step: nothing written, and the profiler is stopped cleanly.
    assert main([*SMALL, "--job.dump_folder", str(tmp_path / "b"), "--profiling.enable_profiling",
                 "--profiling.profile_start_step", "4", "--profiling.profile_steps", "3"]) == 0
    assert not (tmp_path / "b" / "profile_traces").exists()
    assert torch.autograd.profiler._is_profiler_enabled is False


@pytest.mark.unit
def test_expert_load_stats_by_hand():
    counts = torch.tensor([[10.0, 30.0, 20.0, 20.0], [0.0, 0.0, 80.0, 0.0]])
    a, b = expert_load_stats(counts)
    assert a == {"min": 10.0, "max": 30.0, "mean": 20.0, "imbalance": 1.5}
    assert b == {"min": 0.0, "max": 80.0, "mean": 20.0, "imbalance": 4.0}
    assert format_expert_load(7, [a, b]).endswith("L0: 10/30/20.0 (1.50x)  L1: 0/80/20.0 (4.00x)")


def test_debug_flag_logs_expert_load(tmp_path, capsys):
    assert main([*SMALL, "--job.dump_folder", str(tmp_path), "--debug"]) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if "expert load" in l]
    assert [int(l.split()[1]) for l in lines] == [1, 2, 4]  # every log step
    for line in lines:
        per_layer = re.findall(r"L(\d+): (\d+)/(\d+)/([\d.]+) \(([\d.]+)x\)", line)
        assert [int(p[0]) for p in per_layer] == [0, 1]
        for _, lo, hi, mean, imbalance in per_layer:
            # 4 x 64 tokens x top-2 over 8 experts: 64 routed slots per expert on average.
            assert float(mean) == 64.0 and int(lo) <= 64 <= int(hi)
            assert abs(float(imbalance) - int(hi) / 64) < 0.006
    # (The same run without --debug prints none: test_no_trace_unless_enabled_or_reached.)


@pytest.mark.unit
def test_dropped_slots_in_lines_and_tensorboard():
    """Slots dropped by EP's capacity: in the line of a step that dropped any (not otherwise), in
    TensorBoard at every logged step of an EP run, and summed over the run in the summary."""
    from components.config import Metrics

    class Writer:
        def __init__(self):
            self.scalars = {}

        def add_scalar(self, key, value, step):
            self.scalars[key, step] = value

    logger = MetricsLogger(Metrics(), torch.device("cpu"), flops_per_token=1, tokens_per_step=1, expert_parallel=True)
    logger.writer = Writer()
    logger.step_done(1, 5.0, 1234, 40000)
    logger.step_done(2, 4.0, 0, 40000)
    first, second = (logger.log(step, 5.0, 0.0, 1.0, 1e-3) for step in (1, 2))
    assert first.endswith("  ep_dropped: 1,234 of 40,000 routed slots (3.08%)")
    assert "ep_dropped" not in second
    assert {k: v for k, v in logger.writer.scalars.items() if k[0].startswith("ep_")} == {
        ("ep_dropped_slots", 1): 1234, ("ep_dropped_fraction", 1): 1234 / 40000,
        ("ep_dropped_slots", 2): 0, ("ep_dropped_fraction", 2): 0.0}
    assert "  ep_dropped over the run: 1,234 of 80,000 routed slots (1.54%)" in logger.summary([])
    # Without expert parallelism nothing is ever dropped: no such scalars, and no mark.
    plain = MetricsLogger(Metrics(), torch.device("cpu"), flops_per_token=1, tokens_per_step=1)
    plain.writer = Writer()
    plain.step_done(1, 5.0, 0, 40000)
    assert "ep_dropped" not in plain.log(1, 5.0, 0.0, 1.0, 1e-3) + plain.summary([])
    assert not any(k[0].startswith("ep_") for k in plain.writer.scalars)
