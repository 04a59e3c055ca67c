"""Process-group setup and the few collective helpers the trainer needs."""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def init_distributed(device_type: str, simulate_world_size: int = 0) -> int:
    """Join the process group when launched by torchrun (WORLD_SIZE set), or, with
    ``simulate_world_size`` N >= 2, a loopback group in which this process is rank 0 of N
    (parallelisms/simulate.py); returns the world size."""
    if simulate_world_size > 1:
        from parallelisms.simulate import init_simulated_world

        return init_simulated_world(simulate_world_size)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return dist.get_world_size() if dist.is_initialized() else world_size
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return dist.get_world_size()


# How long a rank other than 0 waits for rank 0's error line before it prints its own.
ERROR_WAIT_S = 10.0


def _job_store(timeout_s: float) -> dist.Store | None:
    """The job's key-value store: the process group's, or before the group exists torchrun's."""
    if dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
        try:  # torchrun's agent hosts this store, so it outlives any worker
            return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError):
            return None
    return None


def report_error(message: str, wait_s: float = ERROR_WAIT_S, key: str = "train_error") -> None:
    """Print ``error: <message>`` to stderr once for the whole job, not once per rank.

    Rank 0 prints it and leaves it in the job's store under ``key``. Another rank prints its own
    message, as ``error: rank <r>: ...``, only when rank 0 has not left the same one within
    ``wait_s`` seconds (an error of that rank alone). It waits in any case: torchrun stops every
    worker as soon as one exits, which could cut rank 0 off before its line. Without a store (a
    launcher other than torchrun, before the process group exists) only rank 0 prints: errors
    raised before the group exists come from the config, the same on every rank."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    key = f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    multi = dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1
    store = _job_store(wait_s) if multi else None
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
        if store is not None:
            try:
                store.set(key, message)
            except RuntimeError:  # the store is gone: the other ranks print their own
                pass
        return
    if store is None:
        return
    try:
        store.wait([key], timedelta(seconds=wait_s))
        same = store.get(key).decode() == message
    except RuntimeError:  # rank 0 has not failed (or not yet): this error is this rank's
        same = False
    if not same:
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, foreach: bool, apply: bool = True) -> torch.Tensor:
    """Global gradient norm over parameters that live on different meshes (experts on the EP x
    expert-FSDP mesh, the rest on the FSDP mesh), then clip (unless ``apply`` is False: the caller
    folds the coefficient into the optimizer, :func:`clip_scale`); returns the norm as a plain tensor."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            if isinstance(p.grad, DTensor):
                groups[p.grad.device_mesh].append(p)
            else:
                groups[p.grad.dtype].append(p)
    norms = []
    for key, group in groups.items():
        grads = [p.grad for p in group]
        if isinstance(key, torch.dtype) and key != torch.float32:
            # bf16 gradients (compute copies that carry the gradients, components/precision/copies.py):
            # each norm accumulated and returned in float32, as for float32 copies of them.
            per = (torch._foreach_norm(grads, 2.0, dtype=torch.float32) if foreach
                   else [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads])
            norm = torch.linalg.vector_norm(torch.stack(list(per)), 2.0)
        else:
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm.float())
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if apply and max_norm != float("inf"):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total


def clip_scale(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The divisor that clips gradients of norm ``total_norm`` to ``max_norm``: 1 / the coefficient
    ``clip_grads_with_norm_`` multiplies them by (``min(max_norm / (norm + 1e-6), 1)``), float32.
    Fused AdamW divides every gradient by its ``grad_scale`` inside its kernel, so setting this
    there clips for free instead of a pass over all gradients."""
    return torch.clamp((total_norm.float() + 1e-6) / max_norm, min=1.0)
