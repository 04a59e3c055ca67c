"""Teardown for the gloo worker processes of the multi-process tests.

A worker that simply returns can die of SIGABRT ("terminate called without an active
exception") after its work is done: ``destroy_process_group`` drops the process groups from
c10d's registries, but FSDP's and the device meshes' Python objects still hold them, so the gloo
groups are really destroyed during interpreter finalization, racing the peer process that is still
tearing down its own (pytorch/pytorch PR 179291 describes the same crash). Seen in CI at commit
af7da7b (three EP tests in one run, 2026-12-02 22:19 UTC, loaded 2-core machine); not reproduced in
24 local runs, so this is a mitigation by construction: the processes meet at a barrier and leave
with ``os._exit`` after the groups are destroyed, so there is no finalization left to race.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import NoReturn

import torch.distributed as dist


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
