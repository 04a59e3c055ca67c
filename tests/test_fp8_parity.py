"""bench.fp8_parity: the per-seed summary and checks, the report from earlier logs, and one tiny
end-to-end run of the script on CPU."""

import json
import sys
from pathlib import Path

import pytest

from bench import fp8_parity as P


def _curve(end: float, steps: int = 100) -> dict[int, float]:
    """A falling curve whose last 50 steps average exactly ``end``."""
    return {s: end + 0.01 * (steps - 24.5 - s) for s in range(1, steps + 1)}


def test_end_loss_is_the_mean_of_the_tail():
    curve = {s: float(s) for s in range(1, 101)}
    assert P.end_loss(curve) == pytest.approx(sum(range(51, 101)) / 50)
    assert P.end_loss(curve, tail=10) == pytest.approx(sum(range(91, 101)) / 10)
    assert P.end_loss({3: 2.0}) == 2.0  # fewer steps than the tail: all of them


def test_settings_spread_and_checks():
    curves = {("bf16", 0): _curve(3.00), ("bf16", 1): _curve(3.02), ("bf16", 2): _curve(3.01),
              ("mega_fp8", 0): _curve(3.005), ("mega_fp8", 1): _curve(3.025), ("mega_fp8", 2): _curve(3.015),
              ("gmm_fp8", 0): _curve(3.10), ("titan_bf16", 0): _curve(3.00),
              ("mega_fp8_all", 0): {s: v for s, v in _curve(3.0).items() if s <= 60},
              ("mega_fp8_all", 1): _curve(3.03)}
    r = P.summarize(curves, steps=100, tail=50)
    bf16 = r["settings"]["bf16"]
    assert bf16["mean"] == pytest.approx(3.01) and bf16["spread"] == pytest.approx(0.02)
    assert bf16["end_losses"] == pytest.approx([3.00, 3.02, 3.01]) and bf16["seeds"] == [0, 1, 2]
    assert r["settings"]["mega_fp8"]["paired_diff_vs_bf16"] == pytest.approx([0.005] * 3)
    # A run cut short is listed, not counted.
    assert r["settings"]["mega_fp8_all"]["seeds"] == [1] and "stopped at step 60" in r["runs"]["mega_fp8_all.s0"]["status"]
    got = {c["check"]: c["passed"] for c in r["checks"]}
    assert got == {"mega_fp8 within 1% of bf16": True, "mega_fp8 within the bf16 seed spread": True,
                   "gmm_fp8 within 1% of bf16": False, "gmm_fp8 within the bf16 seed spread": False,
                   "mega_fp8_all within 1% of bf16": True, "mega_fp8_all within the bf16 seed spread": True,
                   "bf16 within 1% of upstream (ours shuffled: other data at the end)": True}
    # Each check compares the seeds both sides ran: seed 1 against seed 1 (+0.33%), not against
    # the mean over bf16's three seeds (+0.66%).
    fp8_all = next(c for c in r["checks"] if c["check"] == "mega_fp8_all within 1% of bf16")
    assert fp8_all["seeds"] == [1] and fp8_all["value"] == pytest.approx(0.01 / 3.02)
    table = P.markdown({"command": "c", "date": "d", "setting": "s", "tail": 50, **r})
    assert "| bf16 | 3 | s0 3.0000, s1 3.0200, s2 3.0100 | 3.0100 | 0.0200 | reference |" in table
    assert "| gmm_fp8 | 1 | s0 3.1000 | 3.1000 | 0.0000 | +3.33% (s0) |" in table
    assert "| gmm_fp8 within 1% of bf16 | 0 | +3.33% | 1% | **no** |" in table
    assert "mega_fp8_all.s0: stopped at step 60 of 100: not counted" in table


def test_upstream_is_compared_with_ours_in_stream_order_when_it_ran():
    curves = {("bf16", 0): _curve(3.0), ("titan_bf16", 0): _curve(3.2), ("bf16_in_order", 0): _curve(3.19)}
    (check,) = P.summarize(curves, steps=100, tail=50)["checks"]
    assert check["check"] == "bf16 within 1% of upstream, same data order" and check["passed"]
    assert check["value"] == pytest.approx(-0.01 / 3.2)


def test_one_bf16_seed_has_no_spread_check():
    r = P.summarize({("bf16", 0): _curve(3.0), ("mega_fp8", 0): _curve(3.0)}, steps=100, tail=50)
    assert [c["check"] for c in r["checks"]] == ["mega_fp8 within 1% of bf16"]


def _write_log(path: Path, cmd: str, losses: dict[int, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"$ {cmd}\n" + "\n".join(f"step: {s:5d}  loss: {v:8.4f}  tps: 100" for s, v in losses.items()) + "\n")


def test_report_from_the_logs_of_several_calls(tmp_path):
    """--report: the logs of earlier calls, in several folders, make one report; nothing runs."""
    _write_log(tmp_path / "a" / "logs" / "bf16.s0.log", "python train.py a", _curve(3.0))
    _write_log(tmp_path / "a" / "logs" / "bf16.s1.log", "python train.py b", _curve(3.02))
    _write_log(tmp_path / "b" / "logs" / "mega_fp8.s0.log", "python train.py c", _curve(3.01))
    (tmp_path / "b" / "logs" / "pretokenize.txt").write_text("not a run")
    rc = P.main(["--report", str(tmp_path / "a"), str(tmp_path / "b"), "--steps", "100", "--out", str(tmp_path / "r")])
    report = json.loads((tmp_path / "r" / "parity.json").read_text())
    assert set(report["curves"]) == {"bf16.s0", "bf16.s1", "mega_fp8.s0"}
    assert report["commands"]["mega_fp8.s0"] == "python train.py c"
    assert rc == 0 and all(c["passed"] for c in report["checks"])
    assert (tmp_path / "r" / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_every_seed_and_upstream_with_its_own_trainer(tmp_path, monkeypatch):
    """Each (run, seed) is made once with the seed on its command line; titan_bf16 runs upstream's
    trainer from the TOML the script writes (without our overrides); ours read the data
    pre-tokenized once; without torchtitan upstream is reported as skipped and the script fails."""
    import bench.compare as C

    ran = {}

    def fake_run_one(run, log_path, timeout, env):
        ran[run.name] = run
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if run.name == "pretokenize":
            out = Path(run.cmd[run.cmd.index("--out") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "shard-00000.bin").write_bytes(b"")
        else:
            _write_log(log_path, " ".join(run.cmd), {s: 5.0 - s / 10 for s in range(1, 4)})
        return {"returncode": 0, "timed_out": False, "wall_s": 0.0}

    monkeypatch.setattr(P, "run_one", fake_run_one)
    monkeypatch.setattr(C, "_has", lambda package: True)
    args = ["--runs", "bf16,titan_bf16", "--seeds", "0,2", "--steps", "3", "--data", "stories", "--out",
            str(tmp_path), "--ours-args", "--model.flavor debug"]
    assert P.main(args) == 0
    assert sorted(ran) == ["bf16.s0", "bf16.s2", "pretokenize", "titan_bf16.s0", "titan_bf16.s2"]
    titan, ours = ran["titan_bf16.s2"], ran["bf16.s2"]
    assert titan.trainer == "torchtitan" and "--model.flavor" not in titan.cmd and titan.cmd[-2:] == ["--debug.seed", "2"]
    toml = titan.cmd[titan.cmd.index("--job.config_file") + 1]
    assert toml == str(tmp_path / "torchtitan.toml") and f'dataset_path = "{tmp_path / "data"}"' in Path(toml).read_text()
    assert ours.cmd[ours.cmd.index("--training.seed", ours.cmd.index("--moe.backend")) + 1] == "2"
    assert ours.cmd[ours.cmd.index("--training.dataset_path") + 1] == str(tmp_path / "tokens")
    ran.clear()
    assert P.main(args) == 0 and "pretokenize" not in ran  # the tokens are made once
    monkeypatch.setattr(C, "_has", lambda package: False)
    assert P.main(args) == 1
    assert json.loads((tmp_path / "parity.json").read_text())["runs"]["titan_bf16.s0"]["status"] == "no steps logged"


def test_bad_arguments(tmp_path, monkeypatch):
    for bad in (["--runs", "bf16,fp4"], ["--seeds", "a"], ["--seeds", ""], ["--tail", "0"]):
        with pytest.raises(SystemExit):
            P.parse_args(bad)
    monkeypatch.setattr(P, "CODE_CORPUS", tmp_path / "data" / "code" / "jsonl")  # the corpus not made yet
    with pytest.raises(SystemExit, match="make_code_corpus"):
        P.prepare_data(P.parse_args(["--data", str(P.CODE_CORPUS)]), tmp_path, {})
    with pytest.raises(SystemExit, match="not a folder of .jsonl files"):
        P.prepare_data(P.parse_args(["--data", str(tmp_path)]), tmp_path, {})


@pytest.mark.skipif(sys.platform != "linux", reason="spawns the trainer")
def test_runs_end_to_end_on_cpu(tmp_path):
    """Two tiny runs (debug model, bf16 and TorchTitan's rowwise FP8 emulated on CPU) through the
    script on the shipped corpus, pre-tokenized by it: each logs every step, the report compares them."""
    # --optimizer.implementation: on a GPU machine the script picks the triton AdamW, which needs CUDA.
    cpu = ("--training.device cpu --optimizer.implementation foreach --model.flavor debug --compile.enable false "
           "--moe.backend grouped_mm --training.mixed_precision_param float32 --metrics.summary_start_step 1 "
           "--metrics.summary_end_step 3")
    rc = P.main(["--runs", "bf16,gmm_fp8", "--seeds", "1", "--steps", "3", "--seq-len", "64", "--layers", "1",
                 "--tail", "2", "--data", "stories", "--out", str(tmp_path), "--ours-args", cpu])
    report = json.loads((tmp_path / "parity.json").read_text())
    assert set(report["curves"]) == {"bf16.s1", "gmm_fp8.s1"}
    assert all(len(c) == 3 for c in report["curves"].values()), report["curves"]
    assert "--precision.moe fp8_rowwise" in report["commands"]["gmm_fp8.s1"]
    assert report["checks"][0]["passed"] is True  # 3 steps from the same init: ~equal
    assert rc == 0
    assert (tmp_path / "parity.md").read_text().startswith("`python -m bench.fp8_parity")
    assert sorted(p.name for p in (tmp_path / "tokens").glob("*.bin")) == ["shard-00000.bin"]
