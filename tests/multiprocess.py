"""Gloo worker processes for the multi-process tests: a pool that is spawned once per world size and
runs every test's job in the same process group, and the teardown of those processes.

Spawning is what the multi-process tests used to spend their time on: each case started ``world``
fresh interpreters (import torch, the trainer, Triton; a gloo rendezvous) for a few seconds of
training. :func:`run_job` sends a job (a module-level function, picklable by reference) to a pool
of ``world`` processes that stay up for the session; every rank runs ``fn(rank, world, **kwargs)``
in the same gloo world group, and rank 0's return value comes back. Trainers build their own device
meshes (new subgroups) per job, so layouts that differ in meshes share the one pool.

A job that raises on every rank is reported and the pool goes on; a job that fails on some ranks
only (the others may wait in a collective for a peer that left it) or a worker that dies makes the
pool be killed and respawned for the next job, so one bad case cannot hang or poison the rest.

Teardown: a worker that simply returns can die of SIGABRT ("terminate called without an active
exception") after its work is done: ``destroy_process_group`` drops the process groups from
c10d's registries, but FSDP's and the device meshes' Python objects still hold them, so the gloo
groups are really destroyed during interpreter finalization, racing the peer process that is still
tearing down its own (pytorch/pytorch PR 179291 describes the same crash). Seen in CI at commit
af7da7b (three EP tests in one run, 2026-12-02 22:19 UTC, loaded 2-core machine); not reproduced in
24 local runs, so this is a mitigation by construction: the processes meet at a barrier and leave
with ``os._exit`` after the groups are destroyed, so there is no finalization left to race.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import io
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A job that runs longer than this is taken as hung (its pool is killed); the slowest job, an
# inductor compile of the chunked EP trainer, takes about 2 minutes on a loaded 2-core machine.
JOB_TIMEOUT_S = 900
# After one rank reported a failure, how long the others get to report theirs.
PEER_GRACE_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_worker() -> NoReturn:
    """Call at the end of a worker that succeeded: wait for every rank, destroy the process
    groups, and exit with status 0 without running interpreter finalization (whatever the worker
    had to write is already written and closed)."""
    # A rank that never arrives (a test bug) fails the barrier in 2 minutes instead of hanging CI.
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def abandon_worker() -> None:
    """Call when a worker failed, before re-raising: destroys the process groups without waiting
    for the other ranks (they may never arrive)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _reset_between_jobs() -> None:
    """What one job may leave behind that would change the next one's numbers or compile."""
    torch._dynamo.reset()
    torch.use_deterministic_algorithms(False)
    gc.collect()


def _pool_worker(rank: int, world: int, port: int, jobs, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
    while True:
        job = jobs.get()
        if job is None:
            finish_worker()
        fn, kwargs = job
        try:
            value = fn(rank, world, **kwargs)
            buf = io.BytesIO()
            torch.save(value if rank == 0 else None, buf)
            results.put((rank, True, buf.getvalue()))
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            results.put((rank, False, traceback.format_exc()))
        finally:
            _reset_between_jobs()


class JobError(RuntimeError):
    pass


class GlooPool:
    def __init__(self, world: int):
        self.world = world
        # Not daemonic: inductor's compile workers are child processes of the rank that compiles.
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, args=(r, world, port, self.jobs[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], **kwargs) -> Any:
        for q in self.jobs:
            q.put((fn, kwargs))
        got: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(got) < self.world:
            if any(not ok for ok, _ in got.values()):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
            try:
                rank, ok, payload = self.results.get(timeout=5)
                got[rank] = (ok, payload)
                continue
            except queue.Empty:
                pass
            if not self.alive():
                self.kill()
                raise JobError(f"a gloo worker of the {self.world}-rank pool died running {fn.__name__}: "
                               f"exit codes {[p.exitcode for p in self.procs]}")
            if time.monotonic() > deadline:
                self.kill()
                failed = {r: p for r, (ok, p) in got.items() if not ok}
                raise JobError(f"{fn.__name__} on {self.world} ranks: ranks {sorted(set(range(self.world)) - set(got))} "
                               f"did not finish" + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in failed.items()))
        failed = {r: p for r, (ok, p) in got.items() if not ok}
        if failed:
            if len(failed) < self.world:  # the others went on: no longer in step with the failed ranks
                self.kill()
            raise JobError(f"{fn.__name__} failed on {self.world} ranks:" +
                           "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
        return torch.load(io.BytesIO(got[0][1]), weights_only=False)

    def close(self) -> None:
        if self.alive():
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=150)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if _POOLS.get(self.world) is self:
            del _POOLS[self.world]


_POOLS: dict[int, GlooPool] = {}


def run_job(world: int, fn: Callable[..., Any], **kwargs) -> Any:
    """Run ``fn(rank, world, **kwargs)`` on every rank of the session's gloo pool of ``world``
    processes (spawned on first use); returns rank 0's value. ``fn`` must be a module-level function
    (workers import it by name) and must not destroy the process group."""
    pool = _POOLS.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _POOLS[world] = GlooPool(world)
    return pool.run(fn, **kwargs)


def close_pools() -> None:
    """End every pool's workers (the session's end: tests/conftest.py)."""
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


# Before multiprocessing's own exit handler joins the (non-daemonic) workers, which would wait forever.
atexit.register(close_pools)
