"""Stop training cleanly on SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C).

    with GracefulStop(log) as stop:
        for step in ...:
            ...                                   # the training step
            if signum := stop.agreed(device):     # every rank, every step: they stop after the same step
                save a checkpoint; break
    exit code 128 + signum

While active, the two signals only record themselves; the train loop asks once per step and saves
before leaving. Under torch.distributed the question is one all-reduce of one int (MAX over ranks), so
a signal that reached one rank stops them all after the same step instead of leaving the others
waiting in a collective. A second signal ends the process at once (exit 128 + signal, no save): a
background thread reads the signals from Python's wakeup fd, so this works while the main thread is
blocked in a collective or a write. Copies arriving within ``REPEAT_GRACE_S`` of the first are the
same request delivered twice (a scheduler signals every process of a job and torchrun forwards the
signal again), not a second one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_GRACE_S = 1.0


class GracefulStop:
    def __init__(self, log: Callable[[str], None] = lambda msg: None, clock: Callable[[], float] = time.monotonic):
        self.log = log  # the acknowledgement line (rank 0's logger under torch.distributed)
        self._clock = clock  # read once per signal taken in, against REPEAT_GRACE_S (a test steps it by hand)
        self.signum = 0  # the signal this process stops for; 0 = none yet
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._active = False

    def __enter__(self) -> GracefulStop:
        # Signal handlers can only be set from the main thread; elsewhere (a test's worker thread) the
        # process keeps its default behaviour.
        if threading.current_thread() is not threading.main_thread():
            return self
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        # The Python-level handler does nothing: the C-level one has already written the signal's
        # number to the wakeup fd, which the watcher thread reads as it arrives.
        self._old_handlers = {s: signal.signal(s, lambda *_: None) for s in SIGNALS}
        self._watcher = threading.Thread(target=self._watch, name="signal-watcher", daemon=True)
        self._watcher.start()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        self._writer.close()  # the watcher's recv returns b"" and it ends
        self._watcher.join(timeout=5)
        self._reader.close()
        self._active = False

    def _watch(self) -> None:
        while data := self._reader.recv(64):
            for signum in data:
                if signum in SIGNALS:
                    self._received(signum)

    def _received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            now = self._clock()
            if not self.signum:
                self.signum, self._first_at = signum, now
                self.log(f"{name} received: finishing the current step, then saving a checkpoint and exiting "
                         f"(send it again to exit at once without saving)")
                return
            if now - self._first_at < REPEAT_GRACE_S:
                return
        sys.stderr.write(f"\n{name} received again: exiting at once, without saving (exit code {128 + signum})\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    def agreed(self, device=None) -> int:
        """The signal every rank stops for after this step (0: go on). Collective under
        torch.distributed: one all-reduce (MAX) of one int, on ``device`` (NCCL needs a CUDA tensor)."""
        import torch
        import torch.distributed as dist

        signum = self.signum
        if dist.is_initialized():
            flag = torch.tensor([signum], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
            with self._lock:
                adopted = signum and not self.signum
                if adopted:
                    # Stopping for another rank's signal: the copy this rank may receive next is no second signal.
                    self.signum, self._first_at = signum, self._clock()
            if adopted:
                self.log(f"{signal.Signals(signum).name} received by another rank: stopping after this step")
        return signum


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT outside the train loop (nothing to save): ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`Interrupted` inside (SIGTERM would otherwise end the process
    silently, SIGINT with a traceback). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum, frame):
        raise Interrupted(signum)

    old = {s: signal.signal(s, interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
