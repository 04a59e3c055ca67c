"""bench.loss_curves: reading runs (metrics.jsonl, resumed runs, logs of either trainer) and the picture."""

import json

import pytest
import torch

from bench import loss_curves as L

PNG = b"\x89PNG\r\n\x1a\n"


def _metrics(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_metrics_file_written_by_the_trainer_is_read_back(tmp_path):
    """MetricsLogger writes a start record and one line per logged step; a resumed run appends its
    own start, and the reader keeps the new run's steps from there on."""
    from components.config import Metrics
    from components.metrics import METRICS_FILE, MetricsLogger

    path = tmp_path / "run" / METRICS_FILE
    for first, last, offset in ((1, 6, 0.0), (4, 8, 100.0)):  # a run to step 6, resumed from step 3's checkpoint
        logger = MetricsLogger(Metrics(), torch.device("cpu"), flops_per_token=1, tokens_per_step=8,
                               metrics_path=str(path))
        logger.start(first)
        for step in range(first, last + 1):
            logger.step_done(step, 10.0 - step + offset)
            logger.log(step, 10.0 - step + offset, 0.0, 1.0, 1e-3)
        logger.close()
    assert L.read_losses(tmp_path / "run") == {1: 9.0, 2: 8.0, 3: 7.0, 4: 106.0, 5: 105.0, 6: 104.0, 7: 103.0,
                                               8: 102.0}
    first_line = json.loads(path.read_text().splitlines()[1])
    assert set(first_line) >= {"step", "loss", "grad_norm", "lr", "tps", "step_time"}


def test_logs_of_either_trainer(tmp_path):
    ours = tmp_path / "ours.log"
    ours.write_text("step:     1  loss:   9.5000  aux_loss: 0.0000  grad_norm:  1.0000  lr: 1.00e-04  "
                    "memory:   1.00GiB  tps: 1,000  step_time: 0.100s\nstep:     2  loss:   9.0000  tps: 1,000\n")
    titan = tmp_path / "titan.log"
    titan.write_text("[titan] \x1b[31mstep:  1  \x1b[32mloss:  9.7000  \x1b[33mmemory: 50.00GiB(35%)  "
                     "\x1b[34mtps: 900\x1b[39m\n")
    assert L.read_losses(ours) == {1: 9.5, 2: 9.0} and L.read_losses(titan) == {1: 9.7}


def test_bands_over_the_steps_all_runs_logged():
    a = {s: 4.0 for s in range(1, 6)}
    b = {s: 2.0 for s in range(2, 8)}
    steps, mean, lo, hi = L.band([a, b], window=1)
    assert steps == [2, 3, 4, 5] and mean == [3.0] * 4 and lo == [2.0] * 4 and hi == [4.0] * 4
    assert L.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_cli_writes_the_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for i, seed_shift in enumerate((0.0, 0.1)):
        _metrics(tmp_path / f"s{i}" / "metrics.jsonl",
                 [{"start": 1}] + [{"step": s, "loss": 5.0 - s / 100 + seed_shift} for s in range(1, 101)])
    assert L.main([str(tmp_path / "s0")]) == 0
    assert (tmp_path / "s0" / "loss.png").read_bytes()[:8] == PNG
    out = tmp_path / "pic" / "both.png"
    assert L.main(["--group", f"bf16={tmp_path / 's0'},{tmp_path / 's1'}", "--out", str(out), "--smooth", "5"]) == 0
    assert out.read_bytes()[:8] == PNG and f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("make,message", [
    (lambda p: p, "does not exist"),
    (lambda p: (p.mkdir(), p)[1], "holds no metrics.jsonl"),
    (lambda p: (p.write_text("no steps here\n"), p)[1], "has no logged steps"),
    (lambda p: (_metrics(p / "metrics.jsonl", []), (p / "metrics.jsonl").write_text("{bad\n"), p)[2], "not a JSON line"),
])
def test_bad_runs_are_named(tmp_path, capsys, make, message):
    run = make(tmp_path / "run")
    assert L.main([str(run)]) == 2
    assert message in capsys.readouterr().err
    assert L.main(["--group", "nothing"]) == 2
