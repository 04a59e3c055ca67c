"""bench.fp8_parity: the curve comparison, and one tiny end-to-end run of the script on CPU."""

import json
import sys
from pathlib import Path

import pytest

from bench import fp8_parity as P


def test_end_loss_and_comparison():
    bf16 = {s: 10.0 - 0.01 * s for s in range(1, 101)}  # last 10 steps: 9.00 .. 9.09
    close = {s: v * 1.005 for s, v in bf16.items()}
    far = {s: v * 1.02 for s, v in bf16.items()}
    assert P.end_loss(bf16) == pytest.approx(sum(10.0 - 0.01 * s for s in range(91, 101)) / 10)
    assert P.end_loss({3: 2.0}) == 2.0  # one step: itself
    cmp = P.compare_curves({"bf16": bf16, "mega_fp8": close, "gmm_fp8": far, "mega_fp8_all": {}})
    assert "rel_diff" not in cmp["bf16"]
    assert cmp["mega_fp8"]["rel_diff"] == pytest.approx(0.005) and cmp["mega_fp8"]["within"] is True
    assert cmp["gmm_fp8"]["rel_diff"] == pytest.approx(0.02) and cmp["gmm_fp8"]["within"] is False
    assert cmp["mega_fp8_all"]["end_loss"] is None  # a run that logged nothing is reported, not compared
    table = P.markdown({"command": "c", "date": "d", "setting": "s", "comparison": cmp})
    assert "| gmm_fp8 | 100 |" in table and "**no**" in table and "no steps logged" in table
    # A run cut short is compared over the steps both curves have, and says so.
    short = P.compare_curves({"bf16": bf16, "mega_fp8": {s: v for s, v in close.items() if s <= 60}})
    assert short["mega_fp8"]["rel_diff"] == pytest.approx(0.005) and short["mega_fp8"]["steps"] == 60
    assert "stopped at step 60" in P.markdown({"command": "c", "date": "d", "setting": "s", "comparison": short})


def test_reuse_keeps_complete_runs(tmp_path, monkeypatch):
    """--reuse: a log holding all the steps of the same command is read, not rerun; the report is
    written after every run."""
    ran = []

    def fake_run_one(run, log_path, timeout, env):
        ran.append(run.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"step: {s:5d}  loss: {5.0 - s / 10:8.4f}  tps: 100" for s in range(1, 4)]
        log_path.write_text("$ " + " ".join(run.cmd) + "\n" + "\n".join(lines) + "\n")
        return {"returncode": 0, "timed_out": False, "wall_s": 0.0}

    monkeypatch.setattr(P, "run_one", fake_run_one)
    monkeypatch.setattr(P, "display", lambda cmd: " ".join(cmd))
    monkeypatch.setattr(P.shlex, "join", lambda cmd: " ".join(cmd))
    args = ["--runs", "bf16,mega_fp8", "--steps", "3", "--out", str(tmp_path)]
    assert P.main(args) == 0 and ran == ["bf16", "mega_fp8"]
    assert P.main(args + ["--reuse"]) == 0 and ran == ["bf16", "mega_fp8"]  # nothing rerun
    (tmp_path / "logs" / "mega_fp8.log").write_text("$ other command\n")
    assert P.main(args + ["--reuse"]) == 0 and ran == ["bf16", "mega_fp8", "mega_fp8"]
    assert json.loads((tmp_path / "parity.json").read_text())["comparison"]["mega_fp8"]["within"] is True


def test_upstream_run_uses_its_own_trainer(tmp_path, monkeypatch):
    """titan_bf16 runs upstream's trainer from the TOML the script writes, without our trainer's
    overrides; without torchtitan it is reported as skipped and the script fails."""
    import bench.compare as C

    ran = {}

    def fake_run_one(run, log_path, timeout, env):
        ran[run.name] = run
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("\n".join(f"step: {s}  loss: {5.0 - s / 10:8.4f}  tps: 100" for s in range(1, 4)) + "\n")
        return {"returncode": 0, "timed_out": False, "wall_s": 0.0}

    monkeypatch.setattr(P, "run_one", fake_run_one)
    monkeypatch.setattr(C, "_has", lambda package: True)
    args = ["--runs", "bf16,titan_bf16", "--steps", "3", "--out", str(tmp_path), "--ours-args", "--model.flavor debug"]
    assert P.main(args) == 0
    titan = ran["titan_bf16"]
    assert titan.trainer == "torchtitan" and "--model.flavor" not in titan.cmd
    toml = titan.cmd[titan.cmd.index("--job.config_file") + 1]
    assert toml == str(tmp_path / "torchtitan.toml") and "steps = 3" in Path(toml).read_text()
    assert "--model.flavor" in ran["bf16"].cmd
    monkeypatch.setattr(C, "_has", lambda package: False)
    assert P.main(args) == 1
    assert json.loads((tmp_path / "parity.json").read_text())["comparison"]["titan_bf16"]["status"] == "no steps logged"


def test_bad_arguments():
    with pytest.raises(SystemExit):
        P.parse_args(["--runs", "mega_fp8"])  # no bf16 reference
    with pytest.raises(SystemExit):
        P.parse_args(["--runs", "bf16,fp4"])


@pytest.mark.skipif(sys.platform != "linux", reason="spawns the trainer")
def test_runs_end_to_end_on_cpu(tmp_path):
    """Two tiny runs (debug model, bf16 and TorchTitan's rowwise FP8 emulated on CPU) through the
    script: each logs every step, the report compares them."""
    # --optimizer.implementation: on a GPU machine the script picks the triton AdamW, which needs CUDA.
    cpu = ("--training.device cpu --optimizer.implementation foreach --model.flavor debug --compile.enable false "
           "--moe.backend grouped_mm --training.mixed_precision_param float32 --metrics.summary_start_step 1 "
           "--metrics.summary_end_step 3")
    rc = P.main(["--runs", "bf16,gmm_fp8", "--steps", "3", "--seq-len", "64", "--layers", "1",
                 "--out", str(tmp_path), "--ours-args", cpu])
    report = json.loads((tmp_path / "parity.json").read_text())
    assert set(report["curves"]) == {"bf16", "gmm_fp8"}
    assert all(len(c) == 3 for c in report["curves"].values()), report["curves"]
    assert "--precision.moe fp8_rowwise" in report["commands"]["gmm_fp8"]
    assert report["comparison"]["gmm_fp8"]["within"] is True  # 3 steps from the same init: ~equal
    assert rc == 0
    assert (tmp_path / "parity.md").read_text().startswith("`python -m bench.fp8_parity")
