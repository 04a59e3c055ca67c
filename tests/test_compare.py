"""bench/compare.py and bench/torchtitan_flavors.py on CPU: log parsing, the summary math, the
configs both trainers get, the shared tokenizer, and that upstream's reduced-depth flavor is our
model. Tests that need upstream TorchTitan 0.2.2 skip without it (CI does not install it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import compare

ESC = "\x1b"
# Upstream 0.2.2's metrics line as its logger prints it under torchrun, colours included.
TITAN_LINE = (f"[rank0]:[titan] 2026-12-02 13:00:06,123 - root - INFO - {ESC}[31mstep: {{step:2}}  "
              f"{ESC}[32mloss: {{loss:8.5f}}  {ESC}[38;2;180;60;0mgrad_norm:  1.2345  "
              f"{ESC}[38;2;54;234;195mmemory: {{mem:5.2f}}GiB(40.63%)  {ESC}[34mtps: {{tps:,}}  "
              f"{ESC}[36mtflops: 324.00  {ESC}[35mmfu: {{mfu:.2f}}%{ESC}[39m")
OURS_LINE = ("step: {step:5d}  loss: {loss:8.4f}  aux_loss: 0.0000  grad_norm:  0.1234  lr: 3.00e-04  "
             "memory: {mem:6.2f}GiB  tps: {tps:,}  step_time: {dt:.3f}s  tflops: 394.00  mfu: {mfu:.1f}%")


def titan_log(n: int = 20) -> str:
    lines = ["[rank0]:[titan] ... - root - INFO - Training starts at step 1"]
    for s in range(1, n + 1):
        lines.append(TITAN_LINE.format(step=s, loss=10.0 - s / 10, mem=50.0 + s / 100,
                                       tps=1000 if s < 6 else 50000 + 100 * s, mfu=30.0 + s / 10))
    lines.append(f"{ESC}[33mvalidate step:  5  {ESC}[32mloss:  7.0000  memory: 99.00GiB(1.00%)  tps: 9,999{ESC}[39m")
    return "\n".join(lines)


def ours_log(n: int = 20) -> str:
    lines = ["Qwen3-MoE ..."]
    for s in range(1, n + 1):
        lines.append(OURS_LINE.format(step=s, loss=8.0 - s / 10, mem=60.0, tps=60000 + s, dt=0.27, mfu=39.8))
        lines.append(f"step: {s:5d}  expert load (tokens per expert min/max/mean, max/mean): L0: 1/2/1.5 (1.33x)")
    lines.append("summary: steps 6-20: mean tokens/s per device 60,013  mean step time 0.270s  tflops 394.00  "
                 "mfu 39.8%  peak memory 60.00GiB")
    return "\n".join(lines)


def test_parse_titan_log_with_colours():
    steps = compare.parse_step_lines(titan_log())
    assert sorted(steps) == list(range(1, 21))  # the validation line is not a step
    assert steps[6] == pytest.approx({"loss": 9.4, "grad_norm": 1.2345, "memory_gib": 50.06, "tps": 50600,
                                      "tflops": 324.0, "mfu": 30.6})


def test_parse_ours_log():
    steps = compare.parse_step_lines(ours_log())
    assert sorted(steps) == list(range(1, 21))  # expert-load and summary lines are skipped
    assert steps[20]["tps"] == 60020 and steps[20]["step_time"] == 0.27 and steps[20]["lr"] == 3e-4
    assert steps[20]["memory_gib"] == 60.0 and steps[20]["mfu"] == 39.8 and steps[20]["aux_loss"] == 0.0


def test_summary_math():
    s = compare.summarize(compare.parse_step_lines(titan_log()), tokens_per_step=16384)
    tps = [50000 + 100 * i for i in range(6, 21)]
    assert s["window"] == [6, 20] and s["steps_logged"] == 20
    assert s["tokens_per_s"] == pytest.approx(sum(tps) / 15)
    assert s["step_time_s"] == pytest.approx(sum(16384 / t for t in tps) / 15)  # upstream logs no step time
    assert s["peak_memory_gib"] == pytest.approx(50.2) and s["final_loss"] == pytest.approx(8.0)
    assert s["mfu_pct"] == pytest.approx(sum(30 + i / 10 for i in range(6, 21)) / 15)
    ours = compare.summarize(compare.parse_step_lines(ours_log()), tokens_per_step=16384)
    assert ours["step_time_s"] == pytest.approx(0.27)  # ours: as logged
    short = compare.summarize(compare.parse_step_lines(ours_log(4)), tokens_per_step=16384)
    assert short["window"] == [2, 4] and short["window_note"] == "window 6-20 not reached"
    assert compare.summarize({}, 16384) == {"steps_logged": 0}
    # Steps after the window (profiled ones) move neither the means nor the reported loss.
    steps = compare.parse_step_lines(titan_log())
    steps[24] = {**steps[20], "loss": 1.0, "tps": 1.0}
    longer = compare.summarize(steps, tokens_per_step=16384)
    assert (longer["final_step"], longer["final_loss"], longer["tokens_per_s"]) == (20, s["final_loss"], s["tokens_per_s"])


def test_ratios_against_upstream_best():
    results = [
        {"name": "titan_bf16", "trainer": "torchtitan", "precision": "bf16", "status": "ok", "tokens_per_s": 50000.0},
        {"name": "titan_fp8", "trainer": "torchtitan", "precision": "fp8", "status": "ok", "tokens_per_s": 46000.0},
        {"name": "ours_grouped_mm", "trainer": "ours", "precision": "bf16", "status": "ok", "tokens_per_s": 60000.0},
        {"name": "ours_mega", "trainer": "ours", "precision": "bf16", "status": "ok", "tokens_per_s": 75000.0},
        {"name": "ours_mega_fp8", "trainer": "ours", "precision": "fp8", "status": "not implemented"},
    ]
    ratios = compare.add_ratios(results)
    assert ratios["titan_best"] == "titan_bf16" and ratios["ours_best"] == "ours_mega"
    assert ratios["ours_best_vs_titan_best"] == pytest.approx(1.5)
    assert ratios["same_precision_bf16"] == pytest.approx(1.5)
    assert results[1]["vs_titan_best"] == pytest.approx(0.92)
    assert "vs_titan_best" not in results[4]
    results[1]["tokens_per_s"] = 62500.0  # FP8 now the faster baseline: ratios follow it
    ratios = compare.add_ratios(results)
    assert ratios["titan_best"] == "titan_fp8" and ratios["ours_best_vs_titan_best"] == pytest.approx(1.2)
    assert ratios["same_precision_bf16"] == pytest.approx(1.5)


def test_status_and_failure_reason():
    assert compare.status_of({"returncode": 0, "timed_out": False}, "", {"steps_logged": 3}) == "ok"
    assert compare.status_of({"returncode": -15, "timed_out": True}, "", {"steps_logged": 3}) == "timed out"
    text = "error: [quantize] moe = 'fp8_blockwise': FP8 expert GEMMs are not implemented yet"
    assert compare.status_of({"returncode": 2, "timed_out": False}, text, {"steps_logged": 0}) == "not implemented"
    log = "Traceback (most recent call last):\n  File \"x.py\", line 1\ntorch.OutOfMemoryError: CUDA out of memory\n"
    assert compare.status_of({"returncode": 1, "timed_out": False}, log, {"steps_logged": 0}) == "failed"
    assert compare.failure_reason(log) == "torch.OutOfMemoryError: CUDA out of memory"


def _plan(tmp_path: Path, model: str = "qwen3_30b_a3b", layers: int = 4):
    setting = compare.Setting(model, layers, 16384, 20, tmp_path)
    data_dir = compare.write_jsonl_data(tmp_path / "data")
    toml_path = tmp_path / "torchtitan.toml"
    toml_path.write_text(compare.torchtitan_toml(setting, data_dir=data_dir))
    return setting, data_dir, toml_path, compare.plan(setting, toml_path=toml_path, data_dir=data_dir)


def test_jsonl_data_is_the_corpus(tmp_path):
    data_dir = compare.write_jsonl_data(tmp_path / "data")
    rows = [json.loads(line)["text"] for line in (data_dir / "corpus.jsonl").read_text().splitlines()]
    corpus = [line for line in compare.CORPUS.read_text(encoding="utf-8").splitlines() if line]
    assert rows == corpus


def test_our_commands_parse(tmp_path):
    from components.config import parse_args

    _, data_dir, _, runs = _plan(tmp_path)
    for run in runs:
        if run.name in ("ours_grouped_mm", "ours_mega"):
            cfg = parse_args(run.cmd[2:])
            assert (cfg.model.flavor, cfg.model.n_layers, cfg.training.seq_len) == ("qwen3_30b_a3b", 4, 16384)
            assert (cfg.training.local_batch_size, cfg.activation_checkpoint.mode, cfg.compile.enable) == (1, "full", True)
            assert cfg.model.tokenizer_path.endswith("assets/tokenizer/tokenizer.json")
            assert cfg.training.dataset_path == str(data_dir) and cfg.moe.backend == run.name.split("_", 1)[1]
            assert (cfg.metrics.summary_start_step, cfg.metrics.summary_end_step) == (6, 20)


def test_report_files(tmp_path):
    report = {"date": "2026-12-02 00:00 UTC", "command": "python -m bench.compare", "out": "o",
              "setting": {"titan_flavor": "30B-A3B-4L", "layers": 4, "seq_len": 16384, "steps": 20, "window": [6, 20]},
              "params": {"total": 1, "active": 1}, "environment": {"gpu": "NVIDIA H200"},
              "results": [{"name": "titan_bf16", "label": "TorchTitan 0.2.2, bf16", "trainer": "torchtitan",
                           "precision": "bf16", "status": "ok", "tokens_per_s": 50000.0, "step_time_s": 0.33,
                           "simulated": "simulating rank 0 of 8 ranks in one process (upstream TorchTitan",
                           "command": "python -m bench.titan_simulated 8 ..."},
                          {"name": "ours_mega", "label": "ours, `mega` backend, bf16", "trainer": "ours",
                           "precision": "bf16", "status": "failed", "reason": "RuntimeError: x | y", "command": "python train.py"}]}
    chart = compare.write_report(report, tmp_path, chart=True)
    md = (tmp_path / "compare.md").read_text()
    assert "| TorchTitan 0.2.2, bf16 | 50,000 | 1.000x | 1.000x | 0.330 s |" in md
    assert "failed: RuntimeError: x / y |" in md  # a '|' in a reason cannot break the table
    assert "| ok (simulated rank 0: collectives excluded) |" in md
    assert json.loads((tmp_path / "compare.json").read_text())["ratios"]["titan_best"] == "titan_bf16"
    if chart in ("matplotlib", "PIL"):
        assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"


# ---- the shared tokenizer -------------------------------------------------------------------

def test_tokenizer_json_matches_sentencepiece_ids():
    pytest.importorskip("tokenizers")
    spm = pytest.importorskip("sentencepiece")
    from components.tokenizer import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(compare.SP_MODEL))
    hf = build_tokenizer(compare.TOKENIZER_DIR / "tokenizer.json")
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (sp.get_piece_size(), sp.bos_id(), sp.eos_id(), sp.pad_id())
    texts = compare.CORPUS.read_text(encoding="utf-8").splitlines()[:400] + [
        "", " ", "  two leading spaces", "trailing  ", "tabs\tand\nnewlines\r\n", "digits 0123456789",
        "ünïcödé ∑ 你好 🚀", "x" * 3000]
    for text in texts:
        assert hf.encode(text) == sp.encode(text, add_bos=True, add_eos=True), repr(text[:60])
        assert hf.decode(hf.encode(text)) == text


def test_tokenizer_assets_are_current(tmp_path):
    pytest.importorskip("tokenizers")
    pytest.importorskip("sentencepiece")
    for path in compare.write_tokenizer(tmp_path):
        assert path.read_bytes() == (compare.TOKENIZER_DIR / path.name).read_bytes(), (
            f"assets/tokenizer/{path.name} is stale: python -m bench.compare --write-tokenizer")


def test_upstream_tokenizer_gives_the_same_ids():
    pytest.importorskip("tokenizers")
    up_mod = pytest.importorskip("torchtitan.components.tokenizer")
    from components.tokenizer import build_tokenizer

    up = up_mod.HuggingFaceTokenizer(str(compare.TOKENIZER_DIR))
    ours = build_tokenizer(compare.TOKENIZER_DIR / "tokenizer.json")
    assert (up.bos_id, up.eos_id, up.get_vocab_size()) == (ours.bos_id, ours.eos_id, ours.vocab_size)
    for text in compare.CORPUS.read_text(encoding="utf-8").splitlines()[:200] + ["  Mia had a cat. 🚀"]:
        # upstream's text dataset calls encode(add_bos=True, add_eos=True) per document, as ours does
        assert up.encode(text, add_bos=True, add_eos=True) == ours.encode(text)


# ---- upstream TorchTitan: its config parser and the flavor -----------------------------------

def test_torchtitan_toml_parses_with_upstream_config_manager(tmp_path):
    config = pytest.importorskip("torchtitan.config")
    setting, data_dir, toml_path, runs = _plan(tmp_path)
    by_name = {r.name: r for r in runs}
    for name in ("titan_bf16", "titan_fp8"):
        cmd = by_name[name].cmd
        jc = config.ConfigManager().parse_args(cmd[cmd.index("--job.config_file"):])
        assert (jc.model.name, jc.model.flavor) == ("qwen3", "30B-A3B-4L")
        assert jc.model.hf_assets_path == str(compare.TOKENIZER_DIR)
        assert (jc.training.dataset, jc.training.dataset_path) == ("c4_test", str(data_dir))
        assert (jc.training.local_batch_size, jc.training.seq_len, jc.training.steps) == (1, 16384, 20)
        assert jc.activation_checkpoint.mode == "full" and jc.compile.enable
        assert jc.compile.components == ["model", "loss"] and jc.metrics.log_freq == 1
        assert jc.experimental.custom_import == "bench.torchtitan_flavors"
        assert jc.optimizer.lr == compare.LR and jc.lr_scheduler.warmup_steps == compare.WARMUP_STEPS
    fp8 = config.ConfigManager().parse_args(by_name["titan_fp8"].cmd[by_name["titan_fp8"].cmd.index("--job.config_file"):])
    assert fp8.model.converters == ["quantize.grouped_mm.float8"] and fp8.quantize.grouped_mm.float8.fqns == ["experts"]


@pytest.mark.parametrize("model,layers", [("qwen3_30b_a3b", 4), ("qwen3_235b_a22b", 1)])
def test_upstream_flavor_is_our_model(model, layers):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchtitan.models.qwen3")
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    import bench.torchtitan_flavors as flavors
    from models.qwen3.args import get_model_args
    from models.qwen3.model import count_params

    base, rope_theta = compare.MODELS[model]
    args = qwen3_args[flavors.flavor_name(base, layers)]
    assert args.n_layers == layers and args.max_seq_len >= 16384 and args.rope_theta == rope_theta
    assert qwen3_args[base].n_layers > layers  # upstream's own flavor is untouched
    with torch.device("meta"):
        upstream = Qwen3Model(args)
    total, _ = count_params(get_model_args(model, n_layers=layers, rope_theta=rope_theta))
    assert sum(p.numel() for p in upstream.parameters()) == total
    ours = get_model_args(model, n_layers=layers)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.head_dim, args.vocab_size) == (
        ours.dim, ours.n_heads, ours.n_kv_heads, ours.head_dim, ours.vocab_size)
    assert (args.moe_inter_dim, args.moe_args.num_experts, args.moe_args.top_k) == (
        ours.moe_inter_dim, ours.num_experts, ours.top_k)


def test_variants_are_ours_mega_plus_their_arguments(tmp_path):
    from components.config import parse_args

    setting, data_dir, toml_path, runs = _plan(tmp_path)
    name, args = compare.parse_variant("keep_attn=--activation_checkpoint.keep attention --compile.loss false")
    assert (name, args) == ("keep_attn", ["--activation_checkpoint.keep", "attention", "--compile.loss", "false"])
    planned = compare.plan(setting, toml_path=toml_path, data_dir=data_dir, variants=[(name, args)])
    assert [r.name for r in planned] == [r.name for r in runs] + ["keep_attn"]
    cfg = parse_args(planned[-1].cmd[2:])
    assert (cfg.moe.backend, cfg.activation_checkpoint.keep, cfg.compile.loss) == ("mega", "attention", False)
    assert planned[-1].label.startswith("ours, `mega` backend")
    other = compare.plan(setting, toml_path=toml_path, data_dir=data_dir,
                         variants=[compare.parse_variant("tt_flash=--moe.backend torchtitan --model.attention_backend flash")])
    assert other[-1].label.startswith("ours, `torchtitan` backend")
    assert parse_args(other[-1].cmd[2:]).moe.backend == "torchtitan"
    for bad in ("noequals", "bad name=--x 1", "empty="):
        with pytest.raises(ValueError, match="expected NAME=ARGS"):
            compare.parse_variant(bad)
    assert compare.main(["--variant", "ours_mega=--compile.loss false", "--dry-run", "--out", str(tmp_path / "o")]) == 2


def test_titan_variants_are_upstream_bf16_plus_their_arguments(tmp_path):
    """--titan-variant: upstream's own trainer with its arguments added (another activation
    checkpointing mode, say), run after upstream's runs; the best of them is upstream's best."""
    setting, data_dir, toml_path, runs = _plan(tmp_path)
    sac = compare.parse_variant("titan_sac_op=--activation_checkpoint.mode selective "
                                "--activation_checkpoint.selective_ac_option op", "--titan-variant")
    planned = compare.plan(setting, toml_path=toml_path, data_dir=data_dir, titan_variants=[sac])
    names = [r.name for r in planned]
    assert names == names[:2] + ["titan_sac_op"] + [r.name for r in runs[2:]]
    run = planned[2]
    assert run.trainer == "torchtitan" and run.precision == "bf16"
    assert run.cmd == planned[0].cmd + sac[1] and "selective_ac_option op" in run.label
    with pytest.raises(ValueError, match="--titan-variant 'x': expected NAME=ARGS.*upstream trainer's"):
        compare.parse_variant("x", "--titan-variant")
    results = [{"name": "titan_bf16", "trainer": "torchtitan", "precision": "bf16", "status": "ok", "tokens_per_s": 100.0},
               {"name": "titan_sac_op", "trainer": "torchtitan", "precision": "bf16", "status": "ok", "tokens_per_s": 125.0},
               {"name": "ours_mega", "trainer": "ours", "precision": "bf16", "status": "ok", "tokens_per_s": 250.0}]
    ratios = compare.add_ratios(results)
    assert ratios["titan_best"] == "titan_sac_op" and ratios["ours_best_vs_titan_best"] == pytest.approx(2.0)
    assert ratios["same_precision_bf16"] == pytest.approx(2.5)  # against upstream's bf16 in its full AC


def test_titan_variant_parses_with_upstream_config_manager(tmp_path):
    config = pytest.importorskip("torchtitan.config")
    setting, data_dir, toml_path, _ = _plan(tmp_path)
    planned = compare.plan(setting, toml_path=toml_path, data_dir=data_dir, titan_variants=[
        compare.parse_variant("sac=--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
                              "--titan-variant")])
    cmd = planned[2].cmd
    jc = config.ConfigManager().parse_args(cmd[cmd.index("--job.config_file"):])
    assert (jc.activation_checkpoint.mode, jc.activation_checkpoint.selective_ac_option) == ("selective", "op")


def test_several_gpus_run_under_torchrun_with_ep(tmp_path):
    """The multi-GPU setting: every run is torchrun with --gpus processes, EP --ep in both trainers."""
    from components.config import parse_args

    setting = compare.Setting("qwen3_30b_a3b", 48, 16384, 20, tmp_path, gpus=8, ep=8)
    data_dir = compare.write_jsonl_data(tmp_path / "data")
    toml = compare.torchtitan_toml(setting, data_dir=data_dir)
    assert "expert_parallel_degree = 8" in toml
    runs = {r.name: r for r in compare.plan(setting, toml_path=tmp_path / "t.toml", data_dir=data_dir)}
    titan = runs["titan_bf16"].cmd
    assert titan[titan.index("--nproc_per_node") + 1] == "8"
    ours = runs["ours_mega"].cmd
    assert ours[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8"]
    cfg = parse_args(ours[ours.index("train.py") + 1:])
    assert (cfg.parallelism.expert_parallel_degree, cfg.model.n_layers) == (8, 48)
    with pytest.raises(SystemExit):
        compare.parse_args(["--gpus", "8", "--ep", "3"])


def test_simulated_world_runs_both_trainers_as_rank_0_of_n(tmp_path):
    """--simulate-world N: one plain process per run, upstream through bench.titan_simulated and ours
    with [parallelism] simulate_world_size, FSDP over N and the same EP in both; the logs' simulation
    line marks the results as simulated."""
    from components.config import parse_args

    setting = compare.Setting("qwen3_30b_a3b", 48, 16384, 20, tmp_path, ep=8, simulate_world=8)
    data_dir = compare.write_jsonl_data(tmp_path / "data")
    toml = compare.torchtitan_toml(setting, data_dir=data_dir)
    assert "expert_parallel_degree = 8" in toml and "data_parallel_shard_degree = -1" in toml
    assert "rank 0 of 8 simulated" in toml
    runs = {r.name: r for r in compare.plan(setting, toml_path=tmp_path / "t.toml", data_dir=data_dir)}
    titan = runs["titan_bf16"].cmd
    assert titan[1:4] == ["-m", "bench.titan_simulated", "8"] and "torch.distributed.run" not in titan
    ours = runs["ours_mega"].cmd
    assert ours[1] == "train.py"
    cfg = parse_args(ours[2:])
    assert (cfg.parallelism.simulate_world_size, cfg.parallelism.expert_parallel_degree) == (8, 8)
    assert cfg.optimizer.implementation == "auto"  # DTensor parameters: no Triton shadows
    for line in ("simulating rank 0 of 8 ranks in one process: collectives are looped back",
                 "simulating rank 0 of 8 ranks in one process (upstream TorchTitan, loopback"):
        assert compare.summarize_log(line + "\n" + ours_log(), 16384, (6, 20))["simulated"] == line
    assert compare.summarize_log(ours_log(), 16384, (6, 20))["simulated"] is None
    for bad in (["--simulate-world", "8", "--gpus", "8", "--ep", "8"], ["--simulate-world", "8", "--ep", "3"],
                ["--simulate-world", "1"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)


def test_titan_simulated_starts_upstream_as_rank_0_of_a_loopback_world(tmp_path):
    """bench.titan_simulated joins the loopback group of N ranks, sets what torchrun would for rank 0
    and hands the remaining arguments to TorchTitan's entry point (here a stand-in: upstream needs CUDA)."""
    import subprocess
    import sys

    script = (
        "import os, sys, torch.distributed as dist\n"
        "from bench import titan_simulated\n"
        "def entry():\n"
        "    print('entry', dist.get_backend(), dist.get_world_size(), dist.get_rank(), os.environ['LOCAL_RANK'],\n"
        "          os.environ['WORLD_SIZE'], sys.argv[1:])\n"
        "sys.exit(titan_simulated.main(['4', '--job.config_file', 'x.toml'], entry=entry))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=compare.ROOT)
    assert out.returncode == 0, out.stderr
    assert "simulating rank 0 of 4 ranks in one process (upstream TorchTitan" in out.stdout
    assert "entry loopback 4 0 0 4 ['--job.config_file', 'x.toml']" in out.stdout, out.stdout
    from bench import titan_simulated

    assert titan_simulated.main(["1"]) == 2 and titan_simulated.main([]) == 2


_UPSTREAM_EP_IN_LOOPBACK = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.moe import GroupedExperts
from parallelisms.simulate import init_simulated_world

init_simulated_world(4)
E, D, F, n_local = 8, 32, 16, 2
seed = int.from_bytes(os.urandom(4), "little")
torch.manual_seed(seed)
experts = GroupedExperts(dim=D, hidden_dim=F, num_experts=E, use_grouped_mm=False)
with torch.no_grad():
    experts.init_weights(0.02)
w1, w2, w3 = (w.detach().clone() for w in (experts.w1, experts.w2, experts.w3))
parallelize_module(experts, init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), ExpertParallel())
worst, finite = 0.0, True
# Rows per global expert, in expert order: uneven with empty experts, then every row on one expert.
for counts in (torch.tensor([3, 0, 5, 2, 1, 4, 0, 2]), torch.tensor([0, 0, 0, 0, 0, 9, 0, 0])):
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    y = experts(x, counts)
    y.sum().backward()
    local = torch.repeat_interleave(torch.arange(E), counts) % n_local
    want = torch.stack([(torch.nn.functional.silu(r @ w1[j].T) * (r @ w3[j].T)) @ w2[j].T
                        for r, j in zip(x.detach(), local)])
    worst = max(worst, float((y - want).abs().max()))
    finite = finite and bool(torch.isfinite(x.grad).all())
print("maxdiff", worst, "grad_finite", finite, "seed", seed)
"""


def test_upstream_expert_parallel_runs_in_a_loopback_world():
    """What bench.titan_simulated relies on: upstream's own ExpertParallel (its dropless all-to-all
    with split sizes exchanged first) runs in the loopback world of 4 ranks, and each row routed to
    global expert e is computed by this rank's local expert e mod (E/ep), the semantics of ours."""
    import subprocess
    import sys

    pytest.importorskip("torchtitan.distributed.expert_parallel")
    out = subprocess.run([sys.executable, "-c", _UPSTREAM_EP_IN_LOOPBACK], capture_output=True, text=True,
                         timeout=600, cwd=compare.ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    _, maxdiff, _, finite, _, _ = out.stdout.split()
    assert float(maxdiff) < 1e-6 and finite == "True", out.stdout


def test_profile_runs_after_the_window_and_breakdowns(tmp_path):
    """--profile: both trainers profile steps after --steps (the timed window is untouched), both
    run the same number of steps (equal cosine schedules); the
    trace of each run becomes <out>/breakdown/<run>.md/.json and a column of breakdown.md, and is
    removed so the next run cannot read it."""
    from components.config import parse_args
    from tests.test_step_breakdown import _trace

    setting = compare.Setting("qwen3_30b_a3b", 4, 16384, 20, tmp_path, profile=True)
    data_dir = compare.write_jsonl_data(tmp_path / "data")
    runs = {r.name: r for r in compare.plan(setting, toml_path=tmp_path / "t.toml", data_dir=data_dir)}
    cfg = parse_args(runs["ours_mega"].cmd[2:])
    assert (cfg.training.steps, cfg.profiling.enable_profiling, cfg.profiling.profile_start_step,
            cfg.profiling.profile_steps) == (24, True, 23, 2)
    titan = runs["titan_bf16"].cmd
    assert titan[-5:] == ["--training.steps", "24", "--profiling.enable_profiling", "--profiling.profile_freq", "24"]

    trace_dir = tmp_path / "ours" / "profile_traces" / "step-23-24"
    trace_dir.mkdir(parents=True)
    (trace_dir / "rank0_trace.json").write_text(json.dumps(_trace()))
    entry = compare.profile_breakdown(setting, runs["ours_mega"], tmp_path)
    assert not (tmp_path / "ours" / "profile_traces").exists()
    assert (tmp_path / "breakdown" / "ours_mega.md").read_text().startswith("# ours, `mega` backend")
    assert entry["breakdown"]["parts_ms"]["moe"] == pytest.approx(0.053 / 2)
    table = compare.breakdown_table([{"name": "ours_mega", **entry}, {"name": "titan_bf16", "status": "ok"}])
    assert table.splitlines()[0] == "| ms / step | ours_mega |" and "| moe | 0.0 |" in table
    assert compare.profile_breakdown(setting, runs["titan_bf16"], tmp_path) == {"breakdown_error": "no trace written"}


def test_repeat_interleaves_runs_and_reports_means(tmp_path, monkeypatch):
    """--repeat 2: the runs go a, b, a, b (each repetition its own log); the report gives each run's
    mean tokens/s with its min-max and the best-vs-best ratio per round; a repetition that fails
    makes the run's row say which."""
    order, tps = [], {"titan_bf16": iter([50_000, 54_000]), "ours_mega": iter([80_000, 81_000])}

    def fake_run(run, log_path, timeout_s, env):
        order.append((run.name, log_path.name))
        t = next(tps[run.name])
        if run.trainer == "torchtitan":
            text = "\n".join(TITAN_LINE.format(step=s, loss=3.0, mem=50.0, tps=t, mfu=30.0) for s in range(1, 21))
        else:
            text = "\n".join(OURS_LINE.format(step=s, loss=3.0, mem=60.0, tps=t, dt=0.2, mfu=50.0) for s in range(1, 21))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("$ x\n" + text + "\n", encoding="utf-8")
        return {"returncode": 0, "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(compare, "run_one", fake_run)
    monkeypatch.setattr(compare, "preflight", lambda env, python=None: {"titan": "", "titan_fp8": ""})
    monkeypatch.setattr(compare, "_has", lambda package: True)  # upstream "installed": the runs are fakes
    out = tmp_path / "o"
    assert compare.main(["--only", "titan_bf16,ours_mega", "--repeat", "2", "--out", str(out)]) == 0
    assert order == [("titan_bf16", "titan_bf16.log"), ("ours_mega", "ours_mega.log"),
                     ("titan_bf16", "titan_bf16.rep2.log"), ("ours_mega", "ours_mega.rep2.log")]
    report = json.loads((out / "compare.json").read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert rows["titan_bf16"]["tokens_per_s"] == pytest.approx(52_000)
    assert rows["ours_mega"]["tokens_per_s_each"] == pytest.approx([80_000, 81_000])
    assert report["ratios"]["ours_best_vs_titan_best"] == pytest.approx(80_500 / 52_000)
    assert report["ratios"]["ours_best_vs_titan_best_each"] == pytest.approx([1.6, 81 / 54])
    md = (out / "compare.md").read_text()
    assert "| 52,000 (50,000-54,000) |" in md and "best against best per round: 1.600x, 1.500x." in md

    failed = compare.combine_repeats([{"status": "ok", "tokens_per_s": 1.0}, {"status": "failed", "reason": "oom"}])
    assert failed["status"] == "failed (repetition 2 of 2)" and failed["reason"] == "oom"
    cut = compare.combine_repeats([{"status": "ok", "tokens_per_s": 5.0}, {"status": "not run", "skip": "--budget spent"}])
    assert cut["status"] == "ok" and cut["tokens_per_s"] == 5.0  # a repetition the budget cut is left out
    with pytest.raises(SystemExit):
        compare.parse_args(["--repeat", "0"])
