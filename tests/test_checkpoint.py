"""Checkpoints through the real training loop: resume equality, async saves (still atomic),
starting from given weights (HF safetensors or DCP), output folders checked at start and damaged
checkpoints found by their manifest."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import warnings

import pytest
import torch

import components.checkpoint as ckpt
from components.config import parse_args
from tests import utils
from tests.utils import DEBUG_CONFIG, load_script, logged_steps
from train import Trainer, main

SIX_STEPS = [*utils.SMALL, "--training.steps", "6"]
SMALL = [*DEBUG_CONFIG, *SIX_STEPS]


def run_main(capsys, *args) -> tuple[int, str]:
    rc = main([*SMALL, *args])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize("async_mode,optimizer", [("async", "auto"), ("disabled", "triton")])
def test_resumed_run_logs_the_same_losses(tmp_path, capsys, monkeypatch, async_mode, optimizer):
    """4 steps straight vs a run killed during step 4 (after its step-2 checkpoint) and resumed;
    with an async save (written while step 3 runs) and with a synchronous one and the Triton AdamW
    (kernels/adamw.py; the interpreter on CPU), whose state goes through DCP as torch's AdamW's
    does. (A synchronous save with torch's AdamW resumes bitwise in
    test_train.py::test_checkpoint_resume_gives_same_losses.)"""
    exact: dict[str, list[float]] = {"straight": [], "resumed": []}
    real_step = Trainer.train_step
    run = ["straight"]

    def recording_step(self, data_iter):
        if run[0] == "killed" and self.step == 4:
            self.checkpoint.wait()  # an async write finishes in the background while step 3 runs
            raise KeyboardInterrupt  # a kill in the middle of training, after a save
        out = real_step(self, data_iter)
        exact.setdefault(run[0], []).append(out[0])
        return out

    monkeypatch.setattr(Trainer, "train_step", recording_step)
    # Small steps (2 x 32 tokens): what is checked is equality, at any size.
    common = ["--training.steps", "4", "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", async_mode,
              "--optimizer.implementation", optimizer] + (["--model.n_layers", "1"] if optimizer == "triton" else [])
    rc, straight = run_main(capsys, "--job.dump_folder", str(tmp_path / "a"), *common)
    assert rc == 0, straight
    run[0] = "killed"
    with pytest.raises(KeyboardInterrupt):
        main([*SMALL, "--job.dump_folder", str(tmp_path / "b"), *common])
    capsys.readouterr()
    assert sorted(ckpt.complete_checkpoints(tmp_path / "b" / "checkpoint")) == [2]
    run[0] = "resumed"
    rc, resumed = run_main(capsys, "--job.dump_folder", str(tmp_path / "b"), *common)
    assert rc == 0, resumed
    assert "resumed from the checkpoint of step 2" in resumed
    want, got = logged_steps(straight), logged_steps(resumed)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4]
    assert [got[s]["loss"] for s in (3, 4)] == [want[s]["loss"] for s in (3, 4)]
    # The logged losses are the values train_step returned (printed with 4 decimals), and the
    # resumed run's are bit for bit the straight run's, not just in the printed digits.
    assert [want[s]["loss"] for s in range(1, 5)] == pytest.approx(exact["straight"], abs=5.1e-5)
    assert exact["resumed"] == exact["straight"][2:]
    assert sorted(ckpt.complete_checkpoints(tmp_path / "b" / "checkpoint")) == [2, 4]


def make_trainer(tmp_path, *extra) -> Trainer:
    return utils.make_trainer(tmp_path, *extra, base=SIX_STEPS)


def test_async_save_is_renamed_only_after_the_write(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--checkpoint.async_mode", "async")
    data_iter = iter(trainer.dataloader)
    trainer.step = 1
    trainer.train_step(data_iter)
    gate = concurrent.futures.Future()  # the background write, finished when the test says so
    real_async_save = ckpt.dcp.async_save

    def held_async_save(state, **kwargs):
        written = real_async_save(state, **kwargs)
        held = concurrent.futures.Future()
        gate.add_done_callback(lambda _: held.set_result(written.result()))
        return held

    monkeypatch.setattr(ckpt.dcp, "async_save", held_async_save)
    w_before = trainer.model.layers["0"].attention.wq.weight.detach().clone()
    trainer.checkpoint.save(1)
    assert ckpt.complete_checkpoints(tmp_path / "checkpoint") == {}  # written, not yet visible
    assert (tmp_path / "checkpoint" / "step-1.tmp").is_dir()
    with torch.no_grad():  # training goes on and changes the weights during the write
        trainer.model.layers["0"].attention.wq.weight.add_(1.0)
    gate.set_result(None)
    assert trainer.checkpoint.wait() == tmp_path / "checkpoint" / "step-1"
    assert sorted(ckpt.complete_checkpoints(tmp_path / "checkpoint")) == [1]
    resumed = make_trainer(tmp_path, "--checkpoint.enable")
    assert resumed.checkpoint.maybe_load() == 1
    assert torch.equal(resumed.model.layers["0"].attention.wq.weight, w_before)  # the state at save time


def test_failed_async_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--checkpoint.async_mode", "async")
    trainer.checkpoint.save(1)
    trainer.checkpoint.wait()

    def failing_async_save(state, **kwargs):
        future = concurrent.futures.Future()
        future.set_exception(OSError("disk full"))
        return future

    monkeypatch.setattr(ckpt.dcp, "async_save", failing_async_save)
    trainer.checkpoint.save(2)
    with pytest.raises(ckpt.CheckpointError, match="async save of step 2 .* failed .*disk full"):
        trainer.checkpoint.wait()
    assert sorted(ckpt.complete_checkpoints(tmp_path / "checkpoint")) == [1]
    monkeypatch.undo()
    assert make_trainer(tmp_path, "--checkpoint.enable").checkpoint.maybe_load() == 1


def test_initial_load_from_hf_folder(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from components.hf_checkpoint import save_hf_weights

    source = make_trainer(tmp_path / "src", "--training.seed", "7")
    save_hf_weights(source.model, tmp_path / "hf", dtype=torch.float32)
    want = {k: v.clone() for k, v in source.model.state_dict().items()}
    args = ["--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_format", "hf"]
    fresh = make_trainer(tmp_path / "run", *args)
    assert not torch.equal(fresh.model.output.weight, want["output.weight"])  # seed 0 differs
    assert fresh.checkpoint.maybe_load() == 0  # no checkpointing at all: still starts from the weights
    for k, v in fresh.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    # A checkpoint to resume wins over the initial weights.
    run = make_trainer(tmp_path / "run2", "--checkpoint.enable", *args)
    run.checkpoint.save(2)
    with torch.no_grad():
        saved_out = run.model.output.weight.clone()
    again = make_trainer(tmp_path / "run2", "--checkpoint.enable", *args)
    assert again.checkpoint.maybe_load() == 2
    assert torch.equal(again.model.output.weight, saved_out)
    # Another depth than the HF folder's: refused at start, naming the field.
    rc, out = run_main(capsys, "--job.dump_folder", str(tmp_path / "run3"), *args, "--model.n_layers", "3")
    assert rc == 2 and "num_hidden_layers = 2 vs n_layers = 3" in out


def test_initial_load_from_dcp_checkpoint(tmp_path, capsys):
    source = make_trainer(tmp_path / "src", "--training.seed", "3", "--checkpoint.enable")
    source.checkpoint.save(4)  # a full training checkpoint: only its model part is used
    step_dir = tmp_path / "src" / "checkpoint" / "step-4"
    fresh = make_trainer(tmp_path / "run", "--checkpoint.enable", "--checkpoint.initial_load_path", str(step_dir),
                         "--checkpoint.initial_load_format", "dcp")
    assert fresh.checkpoint.maybe_load() == 0
    assert torch.equal(fresh.model.output.weight, source.model.output.weight)
    assert fresh.lr_scheduler.last_epoch == 0
    rc, out = run_main(capsys, "--job.dump_folder", str(tmp_path / "r2"), "--checkpoint.initial_load_path",
                       str(step_dir), "--checkpoint.initial_load_format", "dcp", "--model.n_layers", "3")
    assert rc == 2 and "is of another model: n_layers saved 2 vs configured 3" in out
    rc, out = run_main(capsys, "--job.dump_folder", str(tmp_path / "r3"), "--checkpoint.initial_load_path",
                       str(tmp_path), "--checkpoint.initial_load_format", "dcp")
    assert rc == 2 and "is not a DCP checkpoint folder" in out


def test_export_script_writes_what_was_trained(tmp_path):
    pytest.importorskip("safetensors")
    from components.hf_checkpoint import load_hf_weights

    trainer = make_trainer(tmp_path, "--checkpoint.enable", "--training.steps", "2")
    trainer.train()
    export_hf = load_script("export_hf")
    config = ["--config", "train_configs/debug_model.toml", "--model.n_layers", "2"]
    export_hf.main(["--checkpoint", str(tmp_path / "checkpoint" / "step-2"), "--out", str(tmp_path / "hf"),
                    "--dtype", "float32", *config])
    back = make_trainer(tmp_path / "other", "--training.seed", "5")
    load_hf_weights(back.model, tmp_path / "hf")
    for (k, v), (_, w) in zip(trainer.model.state_dict().items(), back.model.state_dict().items()):
        assert torch.equal(v, w), k
    with pytest.raises(SystemExit, match="is of another model: n_layers saved 2 vs configured 3"):
        export_hf.main(["--checkpoint", str(tmp_path / "checkpoint" / "step-2"), "--out", str(tmp_path / "x"),
                        "--config", "train_configs/debug_model.toml", "--model.n_layers", "3"])


@pytest.mark.unit
def test_checkpoint_of_a_one_rank_ep_proxy_is_refused(tmp_path):
    """A checkpoint whose model.json names ``simulate_expert_parallel_degree`` (written by one-rank
    proxies of expert parallelism: E/P experts per layer) is refused by name, before DCP reads it,
    by resume, by initial_load_path and by the HF export."""
    step_dir = make_trainer(tmp_path, "--checkpoint.enable").checkpoint.save(1)
    identity = json.loads((step_dir / "model.json").read_text())
    (step_dir / "model.json").write_text(json.dumps({**identity, ckpt.RETIRED_PROXY_KEY: 2}))
    ckpt.write_manifest(step_dir)  # intact, so resume does not fall back past it
    want = (r"was saved by a one-rank proxy of expert parallelism \(\[experimental\] simulate_expert_parallel_degree "
            r"= 2, a mode this trainer no longer has\): it holds 1/2 of each layer's experts, not a whole model")
    with pytest.raises(ckpt.CheckpointError, match=want):
        make_trainer(tmp_path, "--checkpoint.enable").checkpoint.maybe_load()
    with pytest.raises(ckpt.CheckpointError, match=want):
        make_trainer(tmp_path / "fresh", "--checkpoint.initial_load_path", str(step_dir),
                     "--checkpoint.initial_load_format", "dcp").checkpoint.maybe_load()
    with pytest.raises(SystemExit, match=want):
        load_script("export_hf").main(["--checkpoint", str(step_dir), "--out", str(tmp_path / "hf"),
                                       "--config", "train_configs/debug_model.toml", "--model.n_layers", "2"])


# --------------------------------------------------------------------------------------------------
# Output folders checked at start; damaged checkpoints (manifest); DCP's single-process warnings
# --------------------------------------------------------------------------------------------------

# 2 x 32 tokens a step of the 1-layer debug model, a checkpoint at every step.
TINY = [*DEBUG_CONFIG, *utils.SMALL, "--model.n_layers", "1", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "1"]


def run_tiny(capsys, dump, *args) -> tuple[int, str, list[str]]:
    """``train.main`` on :data:`TINY`: (exit code, stdout, the trainer's stderr lines about
    checkpoints: ``error: `` and ``warning: checkpoint`` ones, and DCP's UserWarnings, recorded
    over pytest's own filters, which hide them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main([*TINY, "--job.dump_folder", str(dump), *args])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines()
             if line.startswith(("error: ", "warning: checkpoint", "warning: " + str(dump)))]
    dcp_warnings = [f"UserWarning: {w.message}" for w in caught if "torch.distributed" in str(w.message)]
    return rc, captured.out, lines + dcp_warnings


def refused_at_start(capsys, *args) -> str:
    rc, out, err = run_tiny(capsys, *args)
    # Nothing printed: refused before the run's header, which comes before tokenizing and the model
    # build (how long that took depends on the machine's load; what was done does not).
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err) == 1, err  # one line
    return err[0]


@pytest.mark.unit
def test_unwritable_dump_folder_is_refused_at_start(tmp_path, capsys):
    err = refused_at_start(capsys, "/dev/null/out")
    assert err.startswith("error: [job] dump_folder = '/dev/null/out' cannot be written (NotADirectoryError")
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    if os.geteuid() != 0:
        read_only.chmod(0o500)
    elif subprocess.run(["chattr", "+i", str(read_only)], capture_output=True).returncode != 0:
        pytest.skip("running as root, where mode 0500 does not stop writes, and chattr +i is unavailable")
    try:
        err = refused_at_start(capsys, read_only / "out")
        assert "[job] dump_folder" in err and "cannot be written" in err and str(read_only / "out") in err
        err = refused_at_start(capsys, tmp_path, "--checkpoint.folder", str(read_only / "ckpt"))
        assert f"[checkpoint] folder = '{read_only / 'ckpt'}' cannot be written" in err
    finally:
        if os.geteuid() != 0:
            read_only.chmod(0o700)
        else:
            subprocess.run(["chattr", "-i", str(read_only)], check=True)


@pytest.mark.unit
def test_disk_space_for_checkpoints_is_checked_at_start(tmp_path, capsys):
    free = shutil.disk_usage(tmp_path).free
    if free > 2.5e12:
        pytest.skip("this disk holds a 235B model's checkpoint")
    # The full 235B model's checkpoint (about 2.8 TB) cannot fit: refused before anything is built.
    err = refused_at_start(capsys, tmp_path, "--model.flavor", "qwen3_235b_a22b", "--model.n_layers", "0")
    assert "less than one checkpoint of this model (about 2,821.1 GB: 235.09B parameters" in err
    # One checkpoint fits, the three this run keeps do not: a warning, and the run goes on.
    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path), "--training.steps", "3"])
    ckpt.check_output_folders(cfg, n_params=free // ckpt.CHECKPOINT_BYTES_PER_PARAM // 2)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "this run keeps up to 3 checkpoints" in err, err


def test_damaged_checkpoints_on_resume(tmp_path, capsys):
    """Really truncated and deleted files of real checkpoints: the newest damaged falls back to the
    newest intact one (the run then logs what the straight run did), a damaged ``load_step`` and a
    checkpoint DCP cannot load are one-line errors naming the folder and ``--checkpoint.load_step``,
    a checkpoint of an older version (no manifest) still loads, and no save or load prints DCP's
    single-process UserWarning."""
    folder = tmp_path / "checkpoint"
    rc, straight, err = run_tiny(capsys, tmp_path, "--training.steps", "3")
    assert rc == 0 and err == [], err
    manifest = json.loads((folder / "step-3" / ckpt.MANIFEST).read_text())["files"]
    assert {".metadata", "__0_0.distcp", "model.json", "trainer_rank0.pt"} == set(manifest)
    assert manifest["__0_0.distcp"] == (folder / "step-3" / "__0_0.distcp").stat().st_size

    with open(folder / "step-3" / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    rc, out, err = run_tiny(capsys, tmp_path, "--training.steps", "4")
    assert rc == 0 and err == [
        f"warning: checkpoint {folder / 'step-3'} is damaged (__0_0.distcp has 1,000 bytes, the manifest says "
        f"{manifest['__0_0.distcp']:,}); resuming from the newest intact one, {folder / 'step-2'}, and training the "
        f"steps since again (--checkpoint.load_step picks another)"], err
    assert "resumed from the checkpoint of step 2" in out
    assert logged_steps(out)[3]["loss"] == logged_steps(straight)[3]["loss"]
    assert all(ckpt.checkpoint_damage(folder / f"step-{s}") is None for s in (1, 2, 3, 4))

    (folder / "step-4" / "trainer_rank0.pt").unlink()
    rc, _, err = run_tiny(capsys, tmp_path, "--training.steps", "5", "--checkpoint.load_step", "4")
    assert rc == 2 and err == [f"error: checkpoint {folder / 'step-4'} is damaged (trainer_rank0.pt is missing); "
                               f"pick another with --checkpoint.load_step (intact: [1, 2, 3])"], err

    # Without its manifest (as an older version wrote it) the damage is found by the loader itself.
    (folder / "step-4" / ckpt.MANIFEST).unlink()
    rc, _, err = run_tiny(capsys, tmp_path, "--training.steps", "5")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {folder / 'step-4'} could not be loaded (FileNotFoundError")
    assert err[0].endswith("; if it is damaged, resume from the one before with --checkpoint.load_step 3"), err

    shutil.rmtree(folder / "step-4")
    (folder / "step-3" / ckpt.MANIFEST).unlink()
    rc, out, err = run_tiny(capsys, tmp_path, "--training.steps", "4")
    assert rc == 0 and err == [] and "resumed from the checkpoint of step 3" in out, err


def test_keep_latest_k_counts_intact_checkpoints(tmp_path, capsys):
    """After falling back from damaged newer checkpoints, pruning keeps the intact ones just saved;
    with no intact checkpoint left, resume stops."""
    folder = tmp_path / "checkpoint"
    assert run_tiny(capsys, tmp_path, "--training.steps", "3")[0] == 0
    for step in (2, 3):
        with open(folder / f"step-{step}" / "__0_0.distcp", "r+b") as f:
            f.truncate(10)
    rc, out, err = run_tiny(capsys, tmp_path, "--training.steps", "2", "--checkpoint.keep_latest_k", "1")
    assert rc == 0 and "resumed from the checkpoint of step 1" in out, err
    assert [line.split()[2] for line in err] == [str(folder / "step-3"), str(folder / "step-2")]
    # step-2 is the new intact one, step-1 pruned; the damaged step-3 stays for the user to look at.
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]
    assert ckpt.checkpoint_damage(folder / "step-2") is None

    # No intact checkpoint left: an error, not a silent fresh start that would overwrite them.
    with open(folder / "step-2" / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    rc, _, err = run_tiny(capsys, tmp_path, "--training.steps", "4")
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"error: checkpoint {folder / 'step-3'} is damaged"), err
    assert "no older one in" in err[0] and "move them away to start afresh" in err[0], err
