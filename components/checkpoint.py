"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save every ``interval`` steps and at the
end, resume from the newest complete one.

Layout: ``<dump_folder>/<folder>/step-<N>/`` holds the DCP files of the model, optimizer and LR
schedule, plus ``trainer_rank<r>.pt`` (step, dataloader state, RNG) and ``model.json`` (the model's
shape, so a checkpoint of another model is refused with a message). A save goes to
``step-<N>.tmp`` and is renamed only when complete, so a crash or kill during a save leaves the
previous checkpoint as the newest loadable one.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from components.config import Checkpoint as CheckpointConfig

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


def _is_main() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> folder of every finished checkpoint (``.tmp`` folders are unfinished saves)."""
    out = {}
    if folder.is_dir():
        for child in folder.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / ".metadata").is_file() and (child / "model.json").is_file():
                out[int(m.group(1))] = child
    return out


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, dump_folder: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, model_identity: dict[str, Any], run_steps: int | None = None):
        self.cfg = cfg
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
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        future = None
        if self.cfg.async_mode == "async":
            # Returns once the state is copied to CPU memory; training may change the weights after.
            future = dcp.async_save(self._dcp_state(), checkpoint_id=str(tmp), process_group=self._async_group)
        else:
            dcp.save(self._dcp_state(), checkpoint_id=str(tmp))
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
        except Exception as e:
            raise CheckpointError(f"the async save of step {step} to {tmp} failed ({type(e).__name__}: {e}); "
                                  f"the newest complete checkpoint is still the previous one") from e
        self._finish(tmp, final)
        return final

    def _finish(self, tmp: Path, final: Path) -> None:
        _barrier()
        if _is_main():
            (tmp / "model.json").write_text(json.dumps(self.identity, indent=1, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: the checkpoint exists whole or not at all
            self._purge_old()
        _barrier()

    def _purge_old(self) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        steps = sorted(complete_checkpoints(self.folder))
        for s in steps[: -self.cfg.keep_latest_k]:
            shutil.rmtree(self.folder / f"step-{s}", ignore_errors=True)

    def maybe_load(self) -> int:
        """Loads the checkpoint to resume from, if any; returns its step (0 when starting fresh, from
        ``initial_load_path``'s weights if set). The compute copies of the weights are marked stale
        after it (components/compute_weights.py: copies the optimizer wrote would otherwise count as
        current)."""
        from components.compute_weights import invalidate_compute_weights

        try:
            return self._maybe_load()
        finally:
            invalidate_compute_weights(self.model)

    def _maybe_load(self) -> int:
        if not self.cfg.enable:
            if self.cfg.initial_load_path:
                self.load_initial_weights()
            return 0
        found = complete_checkpoints(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in found:
                raise CheckpointError(f"[checkpoint] load_step = {self.cfg.load_step}: no complete checkpoint "
                                      f"for that step in {self.folder} (found: {sorted(found) or 'none'})")
            step = self.cfg.load_step
        elif not found:
            if self.cfg.initial_load_path:
                self.load_initial_weights()
            return 0
        else:
            step = max(found)
        path = found[step]
        self._check_identity(path)
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        extra = torch.load(path / "trainer_rank0.pt", weights_only=False)
        if extra["world_size"] == _world_size():
            # Same layout: every rank continues its own data stream and random state exactly.
            extra = torch.load(path / f"trainer_rank{rank}.pt", weights_only=False)
            self.dataloader.load_state_dict(extra["dataloader"])
            torch.set_rng_state(extra["rng"])
            if extra["cuda_rng"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(extra["cuda_rng"])
        elif _is_main():
            # DCP reshards the model and optimizer to the new layout; the per-rank data streams
            # cannot be, so the data order restarts.
            print(f"note: checkpoint {path} was saved by {extra['world_size']} ranks, this run has {_world_size()}: "
                  "model and optimizer state are resharded, the data order starts afresh", flush=True)
        self.resumed_run_steps = extra.get("run_steps")
        return int(extra["step"])


    def load_initial_weights(self) -> None:
        """``[checkpoint] initial_load_path``: model weights to start from (a fresh run only)."""
        path = Path(self.cfg.initial_load_path)
        if self.cfg.initial_load_format == "hf":
            from components.hf_checkpoint import HFCheckpointError, load_hf_weights

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
        saved = json.loads((path / "model.json").read_text())
        if saved != self.identity:
            diff = {k: (saved.get(k), self.identity.get(k)) for k in set(saved) | set(self.identity)
                    if saved.get(k) != self.identity.get(k)}
            raise CheckpointError(
                f"checkpoint {path} is of another model: " +
                ", ".join(f"{k} saved {a!r} vs configured {b!r}" for k, (a, b) in sorted(diff.items())) +
                "; point [checkpoint] folder elsewhere or fix the [model] section")


def model_identity(args: Any, flavor: str) -> dict[str, Any]:
    return {"flavor": flavor, **dataclasses.asdict(args)}
