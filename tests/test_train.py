"""The training loop end to end on the shipped corpus, on CPU."""

import functools
import json
import math
import subprocess
import sys

import pytest
import torch

from components.config import ConfigError
from tests.utils import ROOT, logged_steps, make_trainer, run_losses
from train import NonFiniteLossError, main


@pytest.fixture(scope="module")
def losses_of(tmp_path_factory):
    """Losses of ``[training] steps`` steps of ``make_trainer(*args)``, run once per distinct args
    in this module: tests that compare against the same reference run (plain, full AC, compiled
    full AC) share it."""
    root = tmp_path_factory.mktemp("runs")

    @functools.cache
    def losses(*args: str) -> tuple[float, ...]:
        return tuple(run_losses(make_trainer(root / str(abs(hash(args))), *args)))

    return lambda *args: list(losses(*args))


def test_readme_command_runs_and_prints_summary(tmp_path):
    """``python train.py`` as the README runs it, started from another folder (the config's assets/
    paths are found in the project folder): the header comes first, then tokenizing and the model
    build with their times; the logged losses are those of the same steps taken in this process, and
    the summary's means are the means of the logged per-step numbers."""
    args = ["--training.steps", "5", "--training.seq_len", "64", "--model.n_layers", "2",
            "--training.local_batch_size", "2"]
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config",
                          str(ROOT / "train_configs" / "debug_model.toml"), *args, "--job.dump_folder", "cli"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    order = ["Qwen3-MoE debug model: Qwen3-MoE debug (2 layers", f"tokenizing {ROOT / 'assets/data/stories'} (",
             f"tokenized {ROOT / 'assets/data/stories'}: 474,266 tokens in ", "built the model in ", "step:     1",
             "summary:", "done in "]
    at = [next(i for i, line in enumerate(lines) if line.startswith(start)) for start in order]
    assert at == sorted(at) and at[0] == 0, out.stdout
    assert lines[-1].startswith("done in ") and "s (startup " in lines[-1], lines[-1]
    args = ["--config", "train_configs/debug_model.toml", *args]
    steps = logged_steps(out.stdout)
    # debug_model.toml logs every 10 steps: the first and the last.
    assert sorted(steps) == [1, 5], out.stdout
    from components.config import parse_args
    from train import Trainer

    trainer = Trainer(parse_args([*args, "--job.dump_folder", str(tmp_path / "here")]))
    data_iter = iter(trainer.dataloader)
    trainer.step = 1
    loss, aux, grad_norm = trainer.train_step(data_iter)
    assert steps[1]["loss"] == pytest.approx(loss, abs=1e-4)  # printed with 4 decimals
    assert steps[1]["aux_loss"] == pytest.approx(aux, abs=1e-4)
    assert steps[1]["grad_norm"] == pytest.approx(grad_norm, abs=1e-4)
    tokens = trainer.cfg.training.local_batch_size * trainer.cfg.training.seq_len
    for s in steps.values():
        # tokens/s is the step's tokens over its time, both printed rounded (to 1 token/s, to 1 ms): the
        # times within 0.5 ms of the printed one give tokens/s in [lo, hi], and the printed figure is
        # within 0.5 of one of them, whatever the step took.
        lo, hi = tokens / (s["step_time"] + 5e-4), tokens / max(s["step_time"] - 5e-4, 1e-9)
        assert lo - 0.5 - 1e-6 <= s["tps"] <= hi + 0.5 + 1e-6, (s, lo, hi)
    summary = next(line for line in out.stdout.splitlines() if line.startswith("summary:"))
    assert summary.startswith("summary: steps 3-5 (of 1-5; run shorter than the window 6-20): mean tokens/s per "
                              "device"), summary
    assert summary.endswith(f"final loss {steps[5]['loss']:.4f} (step 5)"), summary
    assert "\noutputs: no checkpoint ([checkpoint] enable = false); metrics cli/metrics.jsonl (loss curve: " \
           "python -m bench.loss_curves cli)\ndone in " in out.stdout
    records = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["start"] == 1 and [r["step"] for r in records[1:]] == [1, 5]
    assert records[-1]["loss"] == pytest.approx(steps[5]["loss"], abs=1e-4)
    mean_tps = float(summary.split("mean tokens/s per device ")[1].split()[0].replace(",", ""))
    mean_dt = float(summary.split("mean step time ")[1].split("s")[0])
    # Only step 5 of steps 3-5 is logged: its time is at most the sum of the three.
    assert steps[5]["step_time"] <= 3 * mean_dt + 0.002
    # mean of 1/t >= 1/mean of t (Jensen); the printed mean step time is rounded to the ms.
    assert tokens / (mean_dt + 0.0005) <= mean_tps * (1 + 1e-3) + 1


def test_loss_falls_on_shipped_corpus(tmp_path):
    # 25 steps reach a mean of 3.84 over the last 5 (40 steps: 3.38); the start is ln(vocab) ~ 7.9.
    trainer = make_trainer(tmp_path, "--training.steps", "25", "--training.seq_len", "128",
                           "--lr_scheduler.warmup_steps", "3")
    losses = run_losses(trainer)
    assert losses[0] > 7.0, losses[0]
    assert sum(losses[-5:]) / 5 < 4.5, losses


@pytest.mark.parametrize("backend", ["grouped_mm", "mega"])
def test_backends_train_like_the_reference(tmp_path, backend, narrow_debug_model):
    """Two steps of the debug model (the second's loss follows the first's backward and update):
    each backend's losses follow the torch reference's. (Small and narrow: the mega kernels run in
    Triton's interpreter on CPU.)"""
    small = ["--training.steps", "2", "--model.n_layers", "1", "--training.seq_len", "32",
             "--training.local_batch_size", "2"]
    ref = run_losses(make_trainer(tmp_path, *small, "--moe.backend", "torch"))
    got = run_losses(make_trainer(tmp_path, *small, "--moe.backend", backend))
    assert got == pytest.approx(ref, rel=1e-4)


def test_chunked_loss_trains_like_full_logits(losses_of):
    ref = losses_of("--training.steps", "3")
    got = losses_of("--training.steps", "3", "--training.loss_chunk_size", "48")
    assert got == pytest.approx(ref, rel=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("first, last, window", [
    (1, 1, (1, 1)), (1, 2, (2, 2)), (1, 5, (3, 5)), (1, 12, (6, 12)),  # shorter than 6-20: its second half at most
    (1, 20, (6, 20)), (1, 24, (6, 20)), (1, 100, (6, 20)),  # the benchmark window
    (1, 101, (6, 101)), (1, 1000, (6, 1000)),  # longer than 5 x 20: to its end
    (51, 100, (56, 70)), (51, 54, (53, 54)),  # a resumed run counts from its first step
])
def test_summary_window_follows_the_run_length(first, last, window):
    from components.metrics import summary_window

    lo, hi, note = summary_window(first, last, 6, 20)
    assert (lo, hi) == window
    assert bool(note) == ((last - first + 1) not in range(20, 101))


@pytest.mark.unit
def test_step_line_and_summary_figures_from_given_step_times():
    """The figures of the README run's lines from given step times, not measured ones: a step's
    tokens/s is its tokens over its time; the summary's are the means over its window (steps 3-5 of
    1-5) of the steps' tokens/s and of their times."""
    from components.config import Metrics
    from components.metrics import MetricsLogger

    logger = MetricsLogger(Metrics(peak_tflops=2.048), torch.device("cpu"), flops_per_token=10**9,
                           tokens_per_step=128)
    logger.step_times = {1: 3.0, 2: 1.0, 3: 0.5, 4: 0.25, 5: 0.125}
    logger.final_loss = (5, 7.25)
    assert "  tps: 1,024  step_time: 0.125s  tflops: 1.02  mfu: 50.0%" in logger.log(5, 7.25, 0.0, 1.0, 1e-3)
    # tokens/s 256, 512 and 1,024: their mean 597.3; the times' mean 0.2917s.
    summary = logger.summary([])
    assert summary.startswith("summary: steps 3-5 (of 1-5; run shorter than the window 6-20): mean tokens/s per "
                              "device 597  mean step time 0.292s  tflops 0.60  mfu 29.2%  peak memory "), summary
    assert "final loss 7.2500 (step 5)\noutputs: none" in summary, summary


def test_config_error_exits_before_model_is_built(capsys):
    assert main(["--config", "train_configs/debug_model.toml", "--training.stepz", "3"]) == 2
    assert "unknown key 'stepz' in [training]" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("override,pattern", [
    (["--moe.backend", "torch", "--precision.moe", "fp8_blockwise"], "not available for \\[moe\\] backend = 'torch'"),
    (["--parallelism.expert_parallel_degree", "2"], "larger than the data-parallel shard degree"),
    (["--parallelism.tensor_parallel_degree", "2"], "tensor_parallel_degree is no longer a setting: tensor "
                                                    "parallelism is not implemented"),
    (["--training.seq_len", "5000"], "exceeds the model's max_seq_len"),
    (["--training.global_batch_size", "10"], "must be a multiple of local_batch_size"),
])
def test_unsupported_settings_stop_at_start(tmp_path, override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_trainer(tmp_path, *override)


@pytest.mark.unit
def test_reference_configs_fail_clearly(capsys):
    """The 32/128-GPU reference setups on one CPU process: a clear stop before any work (expert
    parallelism larger than one process allows, or a part that has not landed)."""
    for name in ("qwen3_30b_a3b", "qwen3_235b_a22b"):
        assert main(["--config", f"train_configs/{name}.toml"]) == 2
        err = capsys.readouterr().err
        assert "not implemented yet" in err or "expert_parallel_degree" in err, err


@pytest.mark.unit
def test_missing_dataset_is_reported(tmp_path, capsys):
    assert main(["--config", "train_configs/debug_model.toml", "--training.dataset_path", str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_non_finite_loss_stops_without_update(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "1")
    with torch.no_grad():
        trainer.model.output.weight.fill_(float("nan"))
    before = trainer.model.layers["0"].attention.wq.weight.detach().clone()
    with pytest.raises(NonFiniteLossError, match="step 1: the loss is nan"):
        run_losses(trainer)
    assert torch.equal(before, trainer.model.layers["0"].attention.wq.weight)


def test_gradient_accumulation_matches_large_batch(tmp_path):
    """Two micro-batches of 4 give the gradient of one batch of the same 8 samples. (The aux loss is
    a product of batch means, so it is switched off: it is not additive over micro-batches.)"""
    big = make_trainer(tmp_path, "--training.steps", "1", "--training.local_batch_size", "8",
                       "--moe.load_balance", "none")
    acc = make_trainer(tmp_path, "--training.steps", "1", "--training.local_batch_size", "4",
                       "--training.global_batch_size", "8", "--moe.load_balance", "none")
    assert acc.grad_accum_steps == 2
    grads = []
    for trainer in (big, acc):
        recorded = {}
        trainer.optimizer.step = lambda t=trainer, r=recorded: r.update(
            {n: p.grad.clone() for n, p in t.model.named_parameters()})
        loss = run_losses(trainer)[0]
        grads.append((loss, recorded))
    assert math.isclose(grads[0][0], grads[1][0], rel_tol=1e-5)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("extra", [["--activation_checkpoint.mode", "full"],
                                   ["--activation_checkpoint.mode", "selective"],
                                   ["--compile.enable", "--compile.backend", "aot_eager"],
                                   ["--activation_checkpoint.mode", "full", "--compile.enable",
                                    "--compile.backend", "aot_eager"]])
def test_ac_and_compile_do_not_change_training(losses_of, extra):
    plain = losses_of("--training.steps", "3")
    other = losses_of("--training.steps", "3", *extra)
    for a, b in zip(plain, other):
        assert math.isclose(a, b, rel_tol=1e-4), (plain, other)


def test_expert_bias_is_updated(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "3", "--moe.load_balance", "expert_bias")
    biases = trainer.model.expert_biases()
    assert len(biases) == 2 and all(torch.count_nonzero(b) == 0 for b in biases)
    run_losses(trainer)
    assert all(torch.count_nonzero(b) > 0 for b in biases)
    assert all(b.abs().max() <= 3 * trainer.cfg.moe.bias_update_rate + 1e-9 for b in biases)


def test_checkpoint_resume_gives_same_losses(tmp_path):
    common = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]
    ref = run_losses(make_trainer(tmp_path / "ref", "--training.steps", "4"))

    # A run interrupted after its step-2 checkpoint, then resumed by a new trainer.
    first = make_trainer(tmp_path / "run", *common)
    data_iter = iter(first.dataloader)
    for first.step in (1, 2):
        first.train_step(data_iter)
    first.checkpoint.save(2)
    resumed = make_trainer(tmp_path / "run", *common)
    resumed.step = resumed.checkpoint.maybe_load()
    assert resumed.step == 2
    data_iter = iter(resumed.dataloader)
    losses = []
    for resumed.step in (3, 4):
        losses.append(resumed.train_step(data_iter)[0])
    assert losses == pytest.approx(ref[2:], rel=1e-6)


def test_checkpoint_interval_and_keep_latest(tmp_path):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "5",
                           "--checkpoint.keep_latest_k", "2")
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4", "step-5"]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import components.checkpoint as ckpt

    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--training.steps", "4")
    data_iter = iter(trainer.dataloader)
    trainer.step = 1
    trainer.train_step(data_iter)
    trainer.checkpoint.save(1)

    def exploding_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", exploding_save)
    with pytest.raises(ckpt.CheckpointError, match="save of step 2 .* failed .*disk full"):
        trainer.checkpoint.save(2)
    assert sorted(ckpt.complete_checkpoints(tmp_path / "checkpoint")) == [1]
    monkeypatch.undo()
    resumed = make_trainer(tmp_path, "--checkpoint.enable", "--training.steps", "4")
    assert resumed.checkpoint.maybe_load() == 1


def test_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--training.steps", "1")
    trainer.checkpoint.save(1)
    other = make_trainer(tmp_path, "--checkpoint.enable", "--training.steps", "2", "--model.n_layers", "3")
    with pytest.raises(Exception, match="is of another model: n_layers saved 2 vs configured 3"):
        other.checkpoint.maybe_load()


def test_tensorboard_scalars_are_written(tmp_path):
    trainer = make_trainer(tmp_path, "--training.steps", "2", "--metrics.enable_tensorboard")
    trainer.train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"loss", "grad_norm", "lr", "tokens_per_second", "tflops"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]


@pytest.mark.unit
def test_torchtitan_backend_without_its_package(capsys):
    import importlib.util

    if importlib.util.find_spec("torchtitan") is not None:
        pytest.skip("torchtitan is installed")
    assert main(["--config", "train_configs/debug_model.toml", "--moe.backend", "torchtitan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'not installed: pip install ".[baseline]"' in err, err


@pytest.mark.parametrize("keep", ["attention", "attention_and_moe"])
@pytest.mark.parametrize("extra", [[], ["--compile.enable", "--compile.backend", "aot_eager"]],
                         ids=["eager", "compiled"])
def test_ac_keep_trains_like_full_ac(losses_of, keep, extra):
    """Keeping the attention core's (and the experts') outputs changes what is recomputed, not the
    numbers: float32 on CPU, bitwise the losses of full activation checkpointing, also (compiled)
    where only the first block keeps them. (The debug config's MoE backend is grouped_mm, the one that compiles.)"""
    common = ["--training.steps", "3", "--activation_checkpoint.mode", "full", *extra]
    full = losses_of(*common)
    kept = losses_of(*common, "--activation_checkpoint.keep", keep)
    assert kept == full
    if extra:  # compiled: kept and recomputed-whole blocks in one compiled model
        first_kept = losses_of(*common, "--activation_checkpoint.keep", keep, "--activation_checkpoint.keep_layers",
                               "1")
        assert first_kept == full
        if keep == "attention_and_moe":  # a block keeping the experts beside one keeping attention only
            first_moe = losses_of(*common, "--activation_checkpoint.keep", keep,
                                  "--activation_checkpoint.keep_moe_layers", "1")
            assert first_moe == full


@pytest.mark.parametrize("keep,keep_layers,keep_moe_layers,attend_calls,expert_calls",
                         [("none", 0, 0, [2, 2], [2, 2]), ("attention", 0, 0, [1, 1], [2, 2]),
                          ("attention_and_moe", 0, 0, [1, 1], [1, 1]), ("attention", 1, 0, [1, 2], [2, 2]),
                          ("attention_and_moe", 1, 0, [1, 2], [1, 2]), ("attention", 5, 0, [1, 1], [2, 2]),
                          ("attention_and_moe", 0, 1, [1, 1], [1, 2]), ("attention_and_moe", 2, 1, [1, 1], [1, 2])])
def test_ac_keep_skips_the_kept_ops_in_recomputation(tmp_path, monkeypatch, keep, keep_layers, keep_moe_layers,
                                                     attend_calls, expert_calls):
    """Per layer and step (eager): full AC runs the attention core and the experts twice (forward and
    recomputation); each kept op runs once, in the first ``keep_layers`` blocks where that is not 0
    (more than the model has keeps all), the experts in the first ``keep_moe_layers`` of those where
    that is not 0."""
    from models.moe.moe import GroupedExperts
    from models.qwen3.model import Attention

    calls = {"attend": 0, "experts": 0}
    attend, experts_forward = Attention.attend, GroupedExperts.forward

    def counting_attend(self, *a, **k):
        calls["attend"] += 1
        return attend(self, *a, **k)

    def counting_experts(self, *a, **k):
        calls["experts"] += 1
        return experts_forward(self, *a, **k)

    monkeypatch.setattr(Attention, "attend", counting_attend)
    monkeypatch.setattr(GroupedExperts, "forward", counting_experts)
    trainer = make_trainer(tmp_path, "--training.steps", "1", "--activation_checkpoint.mode", "full",
                           "--activation_checkpoint.keep", keep, "--activation_checkpoint.keep_layers", str(keep_layers),
                           "--activation_checkpoint.keep_moe_layers", str(keep_moe_layers))
    assert trainer.model_args.n_layers == len(attend_calls)
    run_losses(trainer)
    assert calls == {"attend": sum(attend_calls), "experts": sum(expert_calls)}


@pytest.mark.unit
def test_ac_keep_needs_checkpointing(tmp_path):
    with pytest.raises(ConfigError, match="keep = 'attention' keeps ops of checkpointed blocks"):
        make_trainer(tmp_path, "--activation_checkpoint.keep", "attention")
    with pytest.raises(ConfigError, match="keep_layers = 2 limits the blocks that keep ops, but keep = \"none\""):
        make_trainer(tmp_path, "--activation_checkpoint.mode", "full", "--activation_checkpoint.keep_layers", "2")
    with pytest.raises(ConfigError, match=r"command line: \[activation_checkpoint\] keep_moe_layers = 1 says how many "
                       r"blocks keep the routed experts, but keep = 'attention' keeps no experts; set keep = "
                       r"\"attention_and_moe\" \(--activation_checkpoint.keep attention_and_moe\)"):
        make_trainer(tmp_path, "--activation_checkpoint.mode", "full", "--activation_checkpoint.keep", "attention",
                     "--activation_checkpoint.keep_moe_layers", "1")
    with pytest.raises(ConfigError, match="keep_moe_layers = 3 is more than keep_layers = 2: the experts are kept "
                                          "only in blocks that keep the attention core"):
        make_trainer(tmp_path, "--activation_checkpoint.mode", "full", "--activation_checkpoint.keep",
                     "attention_and_moe", "--activation_checkpoint.keep_layers", "2",
                     "--activation_checkpoint.keep_moe_layers", "3")


def test_fused_adamw_clips_inside_its_kernel(tmp_path, monkeypatch):
    """With fused AdamW the clip coefficient becomes its grad_scale (no in-place pass over the
    gradients); training matches foreach AdamW clipping in place. max_norm is set low so that every
    step clips."""
    common = ["--training.steps", "3", "--training.max_norm", "0.05"]
    foreach = make_trainer(tmp_path, *common, "--optimizer.implementation", "foreach")
    want = run_losses(foreach)

    def no_inplace_clip(*a, **k):
        raise AssertionError("fused AdamW should clip through grad_scale, not in place")

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", no_inplace_clip)
    fused = make_trainer(tmp_path, *common, "--optimizer.implementation", "fused")
    got = run_losses(fused)
    assert fused.optimizer.grad_scale > 1  # clipping was active
    assert got == pytest.approx(want, rel=1e-5)
    for (name, a), b in zip(fused.model.named_parameters(), foreach.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("freq, collected_at", [(3, [2, 3, 6]), (0, [])])
def test_garbage_collection_runs_on_the_trainers_schedule(tmp_path, monkeypatch, freq, collected_at):
    """With ``gc_freq`` > 0 Python's automatic collection is off during the steps, the trainer
    collects the young generations at the start of step 2 and of every gc_freq-th, and automatic
    collection is back on after training; 0 changes nothing."""
    import gc

    trainer = make_trainer(tmp_path, "--training.steps", "7", "--training.gc_freq", str(freq))
    events, enabled = [], []
    real_collect, real_step = gc.collect, trainer.train_step

    def collect(generation=2):
        events.append((trainer.step, generation))
        return real_collect(generation)

    def train_step(data_iter):
        enabled.append(gc.isenabled())
        return real_step(data_iter)

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(trainer, "train_step", train_step)
    assert gc.isenabled()
    trainer.train()
    assert gc.isenabled()
    assert enabled == [freq == 0] * 7
    assert [step for step, generation in events if generation == 1] == collected_at
