"""[profiling] traces and memory snapshots, and the --debug expert-load log."""

from __future__ import annotations

import json
import re

import pytest
import torch

from components.metrics import expert_load_stats, format_expert_load
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
