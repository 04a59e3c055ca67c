"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save every ``interval`` steps and at the
end, resume from the newest complete one.

Layout: ``<dump_folder>/<folder>/step-<N>/`` holds the DCP files of the model, optimizer and LR
schedule, plus ``trainer_rank<r>.pt`` (step, dataloader state, RNG) and ``model.json`` (the model's
shape, so a checkpoint of another model is refused with a message). A save goes to
``step-<N>.tmp`` and is renamed only when complete, so a crash or kill during a save leaves the
previous checkpoint as the newest loadable one. ``manifest.json``, written last (after every rank's
files exist), lists every file of the folder with its size: resume checks the sizes (a stat per
file) and falls back from a damaged newest checkpoint to the newest intact one, with a warning
naming the damaged folder. Sizes and not checksums: the damage a kill, a full disk or an
interrupted copy does changes sizes, while a checksum would read every byte back after each save
and again before each resume (a 30B model's checkpoint is about 370 GB). Checkpoints of earlier
versions (no manifest) still load, unverified.

With ``async_mode = "async"``, ``dcp.async_save`` stages the state in CPU memory and writes it in a
background thread while training goes on; the rename that makes the checkpoint visible happens only
after that write has finished (polled after every step, awaited at the next save and at the end of
the run, on every rank at the same point), so atomicity holds the same way.

When there is no checkpoint to resume, ``initial_load_path`` (model weights only: HF safetensors or
a DCP checkpoint) gives the starting weights; the optimizer and schedule start fresh at step 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from components.config import Checkpoint as CheckpointConfig
from components.config import ConfigError, JobConfig
from components.dcp_utils import is_main, quiet_single_process_dcp
from components.hf_checkpoint import HFCheckpointError, load_hf_weights

_STEP_DIR = re.compile(r"^step-(\d+)$")
MANIFEST = "manifest.json"
# Model weights and AdamW's two moments, all float32: the bulk of a checkpoint.
CHECKPOINT_BYTES_PER_PARAM = 12


class CheckpointError(RuntimeError):
    pass


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank, so all ranks act on one decision."""
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _one_line(e: BaseException) -> str:
    """``Type: first line`` of an exception; for DCP's CheckpointException (whose text holds every
    rank's traceback) that of the first failing rank's exception."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def check_output_folders(cfg: JobConfig, n_params: int) -> None:
    """At start, before the model is built: every output folder the run will write (checkpoints,
    TensorBoard, traces under ``[job] dump_folder``) can be created and written, and the
    checkpoint folder's disk holds one checkpoint of ``n_params`` parameters (weights and AdamW
    state in float32; with several ranks on one shared filesystem the whole checkpoint, since every
    rank writes its share there). Raises ConfigError on every rank if any rank fails; warns (rank 0)
    when the disk holds one checkpoint but not the ones this run keeps."""
    dump = Path(cfg.job.dump_folder)
    folders = {}
    if cfg.checkpoint.enable:
        folders[dump / cfg.checkpoint.folder] = f"[checkpoint] folder = {cfg.checkpoint.folder!r}"
    if cfg.metrics.enable_tensorboard:
        folders[dump / cfg.metrics.save_tb_folder] = f"[metrics] save_tb_folder = {cfg.metrics.save_tb_folder!r}"
    if cfg.profiling.enable_profiling:
        folders[dump / cfg.profiling.save_traces_folder] = (f"[profiling] save_traces_folder = "
                                                            f"{cfg.profiling.save_traces_folder!r}")
    if any(f.is_relative_to(dump) for f in folders):
        folders = {dump: f"[job] dump_folder = {cfg.job.dump_folder!r}", **folders}
    problem = None
    for folder, name in folders.items():
        probe = folder / f".write_test.{socket.gethostname()}.{os.getpid()}"
        # A trace folder the check creates is removed again: a profiling window past the run's last
        # step writes nothing, and leaves nothing behind.
        traces = cfg.profiling.enable_profiling and folder == dump / cfg.profiling.save_traces_folder
        created = [p for p in (folder, *folder.parents) if not p.exists()][:1] if traces else []
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(probe, "x") as f:
                f.write("x")
            probe.unlink()
        except OSError as e:
            problem = (f"{name} cannot be written ({type(e).__name__}: {e.strerror or e}: {folder}); choose a "
                       f"folder this user can write")
            break
        finally:
            for p in created:
                try:
                    p.rmdir()
                except OSError:
                    break
    warning = None
    if problem is None and cfg.checkpoint.enable:
        ckpt = dump / cfg.checkpoint.folder
        usage = shutil.disk_usage(ckpt)
        one = n_params * CHECKPOINT_BYTES_PER_PARAM
        c = cfg.checkpoint
        saves = -(-cfg.training.steps // c.interval)
        # A new checkpoint is written whole before the oldest is pruned: keep_latest_k + 1 at once.
        kept = min(saves, c.keep_latest_k + 1) if c.keep_latest_k else saves
        gb = lambda b: f"{b / 1e9:,.1f} GB"  # noqa: E731
        if usage.total and usage.free < one:
            problem = (f"{ckpt} has {gb(usage.free)} free on its disk, less than one checkpoint of this model "
                       f"(about {gb(one)}: {n_params / 1e9:,.2f}B parameters with AdamW state in float32); free "
                       f"space or point --job.dump_folder elsewhere")
        elif usage.total and usage.free < kept * one:
            warning = (f"warning: {ckpt} has {gb(usage.free)} free on its disk; this run keeps up to {kept} "
                       f"checkpoints of about {gb(one)} each ({gb(kept * one)}): saves will fail once it is full "
                       f"(free space, or set [checkpoint] keep_latest_k)")
    if torch.distributed.is_initialized():
        problems = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(problems, problem)
        failed = [(r, p) for r, p in enumerate(problems) if p is not None]
        if failed:
            rank, problem = failed[0]
            raise ConfigError(problem if rank == 0 else f"rank {rank}: {problem}")
    elif problem is not None:
        raise ConfigError(problem)
    if warning and is_main():
        print(warning, file=sys.stderr, flush=True)


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> folder of every finished checkpoint: one with a manifest, or one written before
    manifests existed (``.metadata`` and ``model.json``). ``.tmp`` folders are unfinished saves."""
    out = {}
    if folder.is_dir():
        for child in folder.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and ((child / MANIFEST).is_file()
                      or (child / ".metadata").is_file() and (child / "model.json").is_file()):
                out[int(m.group(1))] = child
    return out


def write_manifest(folder: Path) -> None:
    """``manifest.json``: every file of the checkpoint in ``folder`` with its size."""
    files = {p.relative_to(folder).as_posix(): p.stat().st_size
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_damage(folder: Path) -> str | None:
    """What is wrong with the checkpoint in ``folder`` against its manifest (a file missing or of
    another size), or None when it matches; None too for a checkpoint without a manifest (written
    before manifests existed), which cannot be checked."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
        files = {str(name): int(size) for name, size in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} is unreadable ({type(e).__name__})"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual:,} bytes, the manifest says {size:,}"
    return None


def intact_steps(found: dict[int, Path]) -> list[int]:
    """The steps of ``found`` (:func:`complete_checkpoints`) whose files match their manifest, in order."""
    return [s for s in sorted(found) if checkpoint_damage(found[s]) is None]


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, dump_folder: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, model_identity: dict[str, Any], run_steps: int | None = None,
                 on_load: Callable[[], None] | None = None):
        """``on_load``: called after every load attempt, which may have written the weights in place
        (the precision step's compute copies are then stale)."""
        self.cfg = cfg
        self.on_load = on_load
        # [training] steps, saved with each checkpoint: a resumed run with other steps follows another lr curve.
        self.run_steps = run_steps
        self.resumed_run_steps: int | None = None  # that of the checkpoint loaded (None: older checkpoint, none)
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.identity = model_identity
        self._pending: tuple[int, Path, Path, Any] | None = None  # (step, tmp, final, future) of an async save
        self._async_group = None
        if cfg.enable and cfg.async_mode == "async" and torch.distributed.is_initialized():
            # The background write talks over a CPU group: NCCL cannot carry it off the main thread.
            self._async_group = torch.distributed.new_group(backend="gloo")

    def _dcp_state(self) -> dict[str, Any]:
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def should_save(self, step: int, last_step: int) -> bool:
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == last_step)

    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step``; with async_mode = "async" only start writing it (it
        becomes visible once written: see :meth:`wait`). Returns its final folder."""
        self.wait()  # the previous async save first: saves are renamed in step order
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        future = None
        try:
            with quiet_single_process_dcp():
                if self.cfg.async_mode == "async":
                    # Returns once the state is copied to CPU memory; training may change the weights after.
                    future = dcp.async_save(self._dcp_state(), checkpoint_id=str(tmp),
                                            process_group=self._async_group)
                else:
                    dcp.save(self._dcp_state(), checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"the save of step {step} to {tmp} failed ({_one_line(e)}); the newest complete "
                                  f"checkpoint is still the previous one") from e
        torch.save({"step": step, "world_size": _world_size(), "dataloader": self.dataloader.state_dict(),
                    "run_steps": self.run_steps, "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / f"trainer_rank{rank}.pt")
        if future is not None:
            self._pending = (step, tmp, final, future)
        else:
            self._finish(tmp, final)
        return final

    def poll(self) -> Path | None:
        """Make an async save visible as soon as its write is done (called after every step), so a
        kill soon after loses as little as possible. Collective when distributed: ranks agree that
        every rank's write is done before any renames."""
        if self._pending is None:
            return None
        done = torch.tensor([int(self._pending[3].done())])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN, group=self._async_group)
        return self.wait() if done.item() else None

    def wait(self) -> Path | None:
        """Finish an async save in flight: wait for its write, then make it visible. Collective
        when distributed. Raises CheckpointError if the write failed (the ``.tmp`` folder stays
        unfinished and the previous checkpoint remains the newest). Returns the folder saved."""
        if self._pending is None:
            return None
        step, tmp, final, future = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:
            raise CheckpointError(f"the async save of step {step} to {tmp} failed ({_one_line(e)}); "
                                  f"the newest complete checkpoint is still the previous one") from e
        self._finish(tmp, final)
        return final

    def _finish(self, tmp: Path, final: Path) -> None:
        _barrier()
        if is_main():
            (tmp / "model.json").write_text(json.dumps(self.identity, indent=1, sort_keys=True))
            write_manifest(tmp)  # last: a folder with a manifest is whole
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: the checkpoint exists whole or not at all
            self._purge_old()
        _barrier()

    def _purge_old(self) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        # Counted in intact checkpoints: a damaged newer one (left by a run that fell back from it)
        # must not push out the intact ones. Everything older than the k kept goes.
        found = complete_checkpoints(self.folder)
        intact = intact_steps(found)
        if len(intact) > self.cfg.keep_latest_k:
            oldest_kept = intact[-self.cfg.keep_latest_k]
            for s in found:
                if s < oldest_kept:
                    shutil.rmtree(found[s], ignore_errors=True)

    def maybe_load(self) -> int:
        """Loads the checkpoint to resume from, if any; returns its step (0 when starting fresh, from
        ``initial_load_path``'s weights if set), then calls ``on_load``."""
        try:
            return self._maybe_load()
        finally:
            if self.on_load is not None:
                self.on_load()

    def _maybe_load(self) -> int:
        if not self.cfg.enable:
            if self.cfg.initial_load_path:
                self.load_initial_weights()
            return 0
        # Rank 0 picks the checkpoint so that every rank loads the same one.
        step, problem = _broadcast(self._choose() if is_main() else None)
        if problem is not None:
            raise CheckpointError(problem)
        if step is None:
            if self.cfg.initial_load_path:
                self.load_initial_weights()
            return 0
        path = self.folder / f"step-{step}"
        self._check_identity(path)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        try:
            state = self._dcp_state()
            with quiet_single_process_dcp():
                dcp.load(state, checkpoint_id=str(path))
            extra = torch.load(path / "trainer_rank0.pt", weights_only=False)
            if extra["world_size"] == _world_size():
                extra = torch.load(path / f"trainer_rank{rank}.pt", weights_only=False)
        except (Exception, CheckpointException) as e:
            older = [s for s in reversed(intact_steps(complete_checkpoints(self.folder))) if s < step]
            way = (f"resume from the one before with --checkpoint.load_step {older[0]}" if older else
                   "move it away to start afresh")
            raise CheckpointError(f"checkpoint {path} could not be loaded ({_one_line(e)}); if it is damaged, "
                                  f"{way}") from None
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if extra["world_size"] == _world_size():
            # Same layout: every rank continues its own data stream and random state exactly.
            self.dataloader.load_state_dict(extra["dataloader"])
            torch.set_rng_state(extra["rng"])
            if extra["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(extra["cuda_rng"])
        elif is_main():
            # DCP reshards the model and optimizer to the new layout; the per-rank data streams
            # cannot be, so the data order restarts.
            print(f"note: checkpoint {path} was saved by {extra['world_size']} ranks, this run has {_world_size()}: "
                  "model and optimizer state are resharded, the data order starts afresh", flush=True)
        self.resumed_run_steps = extra.get("run_steps")
        return int(extra["step"])

    def _choose(self) -> tuple[int | None, str | None]:
        """(step to resume from or None to start fresh, or the one-line error). A damaged newest
        checkpoint falls back to the newest intact one, with a warning: everything the run resumes
        (weights, optimizer, LR schedule, data position, RNG) comes from that one checkpoint, so the
        run goes on as if it had stopped there, and a requeued cluster job keeps training instead of
        failing. A damaged ``load_step`` (asked for by name) is an error."""
        found = complete_checkpoints(self.folder)
        if self.cfg.load_step >= 0:
            step = self.cfg.load_step
            if step not in found:
                return None, (f"[checkpoint] load_step = {step}: no complete checkpoint for that step in "
                              f"{self.folder} (found: {sorted(found) or 'none'})")
            damage = checkpoint_damage(found[step])
            if damage is not None:
                intact = intact_steps(found)
                return None, (f"checkpoint {found[step]} is damaged ({damage}); pick another with "
                              f"--checkpoint.load_step (intact: {intact or 'none'})")
            return step, None
        damaged = []
        for step in sorted(found, reverse=True):
            damage = checkpoint_damage(found[step])
            if damage is None:
                for path, why in damaged:
                    print(f"warning: checkpoint {path} is damaged ({why}); resuming from the newest intact one, "
                          f"{found[step]}, and training the steps since again (--checkpoint.load_step picks "
                          f"another)", file=sys.stderr, flush=True)
                return step, None
            damaged.append((found[step], damage))
        if damaged:
            path, why = damaged[0]
            return None, (f"checkpoint {path} is damaged ({why}) and no older one in {self.folder} is intact; "
                          f"repair the checkpoints or move them away to start afresh")
        return None, None

    def load_initial_weights(self) -> None:
        """``[checkpoint] initial_load_path``: model weights to start from (a fresh run only)."""
        path = Path(self.cfg.initial_load_path)
        if self.cfg.initial_load_format == "hf":
            try:
                load_hf_weights(self.model, path)
            except HFCheckpointError as e:
                raise CheckpointError(f"[checkpoint] initial_load_path: {e}") from None
            return
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"[checkpoint] initial_load_path = {str(path)!r} is not a DCP checkpoint folder "
                                  f"(no .metadata); for Hugging Face safetensors set initial_load_format = \"hf\"")
        if (path / "model.json").is_file():
            self._check_identity(path)
        # Only the model's entries are read: a full training checkpoint works as well as weights alone.
        state = {"model": get_model_state_dict(self.model)}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:
            raise CheckpointError(f"[checkpoint] initial_load_path = {str(path)!r}: could not load the model "
                                  f"weights ({type(e).__name__}: {e})") from e
        set_model_state_dict(self.model, state["model"])

    def _check_identity(self, path: Path) -> None:
        check_identity(path, self.identity, "point [checkpoint] folder elsewhere or fix the [model] section")


def model_identity(args: Any, flavor: str) -> dict[str, Any]:
    """What ``model.json`` records of the model: its flavor and every model argument."""
    return {"flavor": flavor, **dataclasses.asdict(args)}


# In the model.json of checkpoints written by a one-rank proxy of expert parallelism, a mode this
# trainer no longer runs: they hold E/P experts per layer, a model no run here builds.
RETIRED_PROXY_KEY = "simulate_expert_parallel_degree"


def check_identity(path: Path, configured: dict[str, Any], fix: str) -> None:
    """Refuse the checkpoint in ``path`` unless its ``model.json`` describes the ``configured`` model
    (:func:`model_identity`), before DCP reads anything; ``fix`` ends the message of another model's."""
    try:
        saved = json.loads((path / "model.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: model.json is unreadable ({_one_line(e)}); pick another "
                              f"checkpoint") from None
    if RETIRED_PROXY_KEY in saved:
        p = saved[RETIRED_PROXY_KEY]
        raise CheckpointError(f"checkpoint {path} was saved by a one-rank proxy of expert parallelism ([experimental] "
                              f"{RETIRED_PROXY_KEY} = {p}, a mode this trainer no longer has): it holds 1/{p} of each "
                              f"layer's experts, not a whole model, so no run can resume, load or export it")
    if saved != configured:
        diffs = ", ".join(f"{k} saved {saved.get(k)!r} vs configured {configured.get(k)!r}"
                          for k in sorted(set(saved) | set(configured)) if saved.get(k) != configured.get(k))
        raise CheckpointError(f"checkpoint {path} is of another model: {diffs}; {fix}")
