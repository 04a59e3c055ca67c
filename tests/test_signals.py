"""SIGTERM and SIGINT sent to real training processes: the step finishes, a checkpoint is saved, the
run exits with 128 + the signal and resumes from it; under two gloo ranks a signal to one rank
stops both after the same step; a second signal exits at once."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from components.checkpoint import complete_checkpoints
from components.signals import REPEAT_GRACE_S, Interrupted, interruptible
from tests.utils import DEBUG_CONFIG, ROOT, free_port, logged_steps, write_file

# The 1-layer debug model on 2 x 32 tokens a step, every step logged, on a corpus of 6 batches an
# epoch (3 per rank on two), so a few steps already repeat the data.
TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--training.device", "cpu"]
WORDS = "the cat sat on a mat and ran to see a big red dog who was happy with its ball".split()
# A hang guard, not a bound: a run of seconds alone can take minutes on a loaded 2-core machine.
TIMEOUT_S = 600


def tiny_run(tmp_path: Path, *extra: str) -> list[str]:
    corpus = "\n".join(" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)) for i in range(30))
    data = write_file(tmp_path, "corpus.txt", corpus + "\n")
    return [sys.executable, "train.py", *DEBUG_CONFIG, *TINY, "--training.dataset_path", data,
            "--job.dump_folder", str(tmp_path / "out"), "--checkpoint.enable", "--checkpoint.interval", "1000",
            *extra]


def signal_after_first_step(procs: list[subprocess.Popen], target: subprocess.Popen, signum: int) -> str:
    """Read rank 0's (``procs[0]``) output until its first step line, send ``signum`` to ``target``,
    wait for every process; rank 0's whole output. Processes still running after TIMEOUT_S (a hang)
    are killed."""
    watchdog = threading.Timer(TIMEOUT_S, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        lines = []
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("step:"):
                target.send_signal(signum)
                break
        lines.append(procs[0].stdout.read())
        for p in procs:
            p.wait()
    finally:
        watchdog.cancel()
    return "".join(lines)


def stop_line(out: str, name: str) -> tuple[int, Path]:
    m = re.search(rf"^stopped by {name} after step (\d+) in [\d.]+s \(startup [\d.]+s, training [\d.]+s, of which "
                  rf"checkpoint saves [\d.]+s\): checkpoint (\S+) saved; run the same command to resume "
                  rf"\(exit code {128 + signal.Signals[name]}\)$", out, re.M)
    assert m, out
    return int(m.group(1)), Path(m.group(2))


def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    cmd = tiny_run(tmp_path, "--training.steps", "100000")
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        out = signal_after_first_step([proc], proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, (out, (tmp_path / "err.txt").read_text())
    step, path = stop_line(out, "SIGTERM")
    assert "SIGTERM received: finishing the current step, then saving a checkpoint and exiting" in out
    assert max(logged_steps(out)) == step  # the step it stopped after is logged, and none later
    assert f"saving checkpoint to {path} ...\ncheckpoint {path} saved in " in out
    assert complete_checkpoints(tmp_path / "out" / "checkpoint") == {step: path}

    # The same command with more steps to go resumes from it. The schedule of a 100000-step run
    # moves to that of this one, whose warmup is longer than the run; the 6-batch corpus repeats.
    more = step + 8
    res = subprocess.run(tiny_run(tmp_path, "--training.steps", str(more), "--lr_scheduler.warmup_steps",
                                  str(more + 1)), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"resumed from the checkpoint of step {step}\n" in out
    assert (f"note: the checkpoint of step {step} was saved by a run of 100000 steps and this run has "
            f"[training] steps = {more}: the lr schedule moves to the {more}-step curve") in out
    assert f"note: [lr_scheduler] warmup_steps = {more + 1} is more than [training] steps = {more}" in out
    assert re.search(r"^note: the dataset was used up by step \d+: the data repeats from here \(epoch \d+\)$", out, re.M)
    steps = logged_steps(out)
    assert sorted(steps) == list(range(step + 1, more + 1))
    final = tmp_path / "out" / "checkpoint" / f"step-{more}"
    assert re.search(rf"^summary: steps {step + 5}-{more} \(of {step + 1}-{more}; run shorter than the window 6-20\): "
                     rf".* final loss {steps[more]['loss']:.4f} \(step {more}\)\noutputs: checkpoint {re.escape(str(final))}; "
                     rf"metrics {re.escape(str(tmp_path / 'out' / 'metrics.jsonl'))} \(loss curve: python -m "
                     rf"bench.loss_curves {re.escape(str(tmp_path / 'out'))}\)$", out, re.M)
    # The metrics file holds both runs; the resumed one's steps replace what the first logged after its checkpoint.
    from bench.loss_curves import read_losses

    curve = read_losses(tmp_path / "out")
    assert max(curve) == more and all(curve[s] == pytest.approx(v["loss"], abs=1e-4) for s, v in steps.items())
    assert re.search(r"^done in [\d.]+s \(startup [\d.]+s, training [\d.]+s, of which checkpoint saves [\d.]+s\)$",
                     out, re.M), out


def test_sigint_to_one_of_two_ranks_stops_both_after_the_same_step(tmp_path):
    """Two gloo ranks; Ctrl-C's signal reaches rank 1 only. Both stop after the same step (the
    save is collective: a rank that went on would hang it) and save one complete checkpoint."""
    cmd = tiny_run(tmp_path, "--training.steps", "100000")
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE if rank == 0 else
                                      subprocess.DEVNULL, stderr=open(tmp_path / f"err{rank}.txt", "w")))
    out = signal_after_first_step(procs, procs[1], signal.SIGINT)
    errors = [(tmp_path / f"err{r}.txt").read_text()[-2000:] for r in range(2)]
    assert [p.returncode for p in procs] == [128 + signal.SIGINT] * 2, (out, errors)
    assert "SIGINT received by another rank: stopping after this step" in out
    step, path = stop_line(out, "SIGINT")
    assert complete_checkpoints(tmp_path / "out" / "checkpoint") == {step: path}
    for rank in range(2):
        assert torch.load(path / f"trainer_rank{rank}.pt", weights_only=False)["step"] == step

    # It loads (in one process here: the model and optimizer are resharded).
    from components.config import parse_args
    from train import Trainer

    trainer = Trainer(parse_args(cmd[2:]))
    assert trainer.checkpoint.maybe_load() == step


@pytest.mark.unit
def test_a_second_signal_exits_at_once_and_a_quick_copy_does_not():
    """A copy of the signal within REPEAT_GRACE_S (a scheduler and torchrun both sending it) is the
    same request; one after it exits at once, though the main thread is blocked. The grace is read
    off a clock the script steps by hand, and the script waits for each signal to be taken in (the
    watcher thread reads the clock once per signal), so no outcome depends on how fast the machine is."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from components.signals import REPEAT_GRACE_S, GracefulStop
        now, reads = [0.0], []

        def clock():
            reads.append(now[0])
            return now[0]

        def taken_in(n):
            deadline = time.monotonic() + 240  # a hang, not a slow machine
            while len(reads) < n:
                if time.monotonic() > deadline:
                    print("signal", n, "never taken in", flush=True)
                    os._exit(1)
                time.sleep(0.01)

        with GracefulStop(lambda msg: print(msg, flush=True), clock=clock) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            taken_in(1)
            now[0] += 0.9 * REPEAT_GRACE_S
            os.kill(os.getpid(), signal.SIGTERM)
            taken_in(2)
            print("still running, stopping for", stop.signum, flush=True)
            now[0] += 0.2 * REPEAT_GRACE_S
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(120)
        print("not reached")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 128 + signal.SIGINT, (res.stdout, res.stderr)
    assert res.stdout.count("SIGTERM received:") == 1, res.stdout
    assert f"still running, stopping for {int(signal.SIGTERM)}" in res.stdout and "not reached" not in res.stdout
    assert "SIGINT received again: exiting at once, without saving (exit code 130)" in res.stderr


@pytest.mark.unit
def test_signals_before_the_train_loop_raise_interrupted():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for signum in before:
        with pytest.raises(Interrupted) as caught, interruptible():
            os.kill(os.getpid(), signum)  # the handler runs before the next line
        assert caught.value.signum == signum
    assert {s: signal.getsignal(s) for s in before} == before
