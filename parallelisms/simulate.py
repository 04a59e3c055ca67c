"""A simulated world: one process acts as rank 0 of an N-rank job (``[parallelism] simulate_world_size``).

The process joins a process group of N ranks whose backend, ``loopback``, is :class:`LoopbackGroup`:
every collective completes at once, locally, with no peer. The device mesh, FSDP2's sharding, the
expert-parallel layout and the compiled graphs are those of one rank of the real job; the
collectives' outputs are built from this rank's own tensors so that they are finite and of the
magnitude a real run would see:

- **all-gather** (FSDP's parameter all-gather, the expert shards' all-gather): every rank's shard is
  this rank's, so the output is the input repeated N times.
- **reduce-scatter** and **all-reduce**: every rank contributed this rank's tensor, so the result is
  the reduction of N identical copies: SUM gives N x (this rank's chunk of) the input, AVG, MAX and
  MIN give it unchanged. With FSDP's averaging this keeps a gradient at the size of one rank's; a
  gradient norm summed over shards counts N shards of this rank's size, as a real job's does; a
  loss summed and then divided by the data-parallel degree is this rank's loss.
- **all-to-all**: loopback, the output is the input. It assumes a symmetric traffic pattern: what
  rank r sends this rank is what this rank sends rank r. Expert parallelism sends each peer the same
  static capacity C (parallelisms/expert_parallel.py), so each C-row block comes back in place: the
  rows this rank routed to rank r's experts are computed by this rank's experts of the same local
  index (valid local ids), every slot is computed exactly once, by the experts and with the row counts
  of one rank of the real job, and each slot's output returns to its own row in the combine.
  Split sizes that are not symmetric (what this rank receives from r differs from what it sends r)
  have no such loopback and are refused.
- **broadcast**, **barrier**: identity, no-op (rank 0 is the source of every broadcast it joins).

Step times therefore exclude communication, but not the local copies that stand in for it. Each
group times the copies it makes on the compute stream (the device's default stream, where they
delay compute as no real collective of an overlapped job would; copies on FSDP2's side streams
overlap compute and are left in): :func:`loopback_copy_seconds` gives the trainer the time to
subtract for a compute-only step. The weights after an update are this rank's view of a job in
which every rank saw this rank's data.
Point-to-point messages and a scatter from another rank have no local counterpart and raise.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.futures import Future

from components.config import ConfigError

BACKEND = "loopback"


def _done() -> dist.Work:
    """A work object that is already complete: the collective ran synchronously on the current stream."""
    from torch._C._distributed_c10d import _create_work_from_future

    future = Future()
    future.set_result(None)
    return _create_work_from_future(future)


def _reduce_op(opts):
    """The reduce op of a collective's options (SUM, torch's default, when called without them)."""
    return opts.reduceOp if opts is not None else ReduceOp.SUM


def reduce_identical(t: torch.Tensor, op, n: int) -> None:
    """``t`` becomes, in place, the reduction ``op`` of ``n`` copies of itself."""
    kind = getattr(op, "op", op)  # a ReduceOp carries its RedOpType (and PREMUL_SUM its factor)
    if kind == ReduceOp.SUM:
        t.mul_(n)
    elif kind == ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise NotImplementedError("the loopback process group cannot read this torch's PREMUL_SUM factor; "
                                      "a simulated world supports SUM, AVG, MAX, MIN, PRODUCT and bitwise ops")
        t.mul_(factor * n)
    elif kind == ReduceOp.PRODUCT:
        t.pow_(n)
    elif kind == ReduceOp.BXOR:
        if n % 2 == 0:
            t.zero_()
    elif kind not in (ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.BAND, ReduceOp.BOR):
        raise NotImplementedError(f"the loopback process group has no rule for reduce op {kind}")


def _rows(t: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """``t`` as ``n`` equal contiguous rows (a view: writing it writes ``t``)."""
    if not t.is_contiguous() or t.numel() % n:
        raise ValueError(f"loopback {what}: a contiguous tensor of a multiple of {n} elements is needed, got "
                         f"shape {tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t.view(n, t.numel() // n)


class LoopbackGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks in which only this process exists: each collective's output
    is what it would be if every rank held this rank's tensors (the module docstring gives the rule
    per collective). Methods carry torch's newer and older names (torch 2.11 and 2.13 call different
    ones from C++ and from ``torch.distributed``)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name, self._desc = "", ""
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA copies on the compute stream
        self._host_seconds = 0.0  # CPU copies (synchronous)

    @contextlib.contextmanager
    def _clocked(self, t: torch.Tensor):
        """Time the copies made inside: CUDA events where ``t`` is on the device's default stream,
        the host clock on CPU; copies on a side stream are not timed."""
        if not t.is_cuda:
            start = time.perf_counter()
            yield
            self._host_seconds += time.perf_counter() - start
        elif torch.cuda.current_stream(t.device) != torch.cuda.default_stream(t.device):
            yield
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._spans.append((start, end))

    def take_copy_seconds(self) -> float:
        """Seconds of timed copies since the last call (waits for the last one to finish)."""
        if self._spans:
            self._spans[-1][1].synchronize()
        seconds = self._host_seconds + sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
        self._spans, self._host_seconds = [], 0.0
        return seconds

    def getBackendName(self) -> str:
        return BACKEND

    # The base class keeps the name on its backends, and a Python group has none.
    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return f"LoopbackGroup(rank {self._rank} of {self._size})"

    def allreduce(self, tensors, opts=None):
        for t in tensors:
            with self._clocked(t):
                reduce_identical(t, _reduce_op(opts), self._size)
        return _done()

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        return _done()

    def barrier(self, opts=None):
        return _done()

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, t in zip(output_lists, inputs):
            with self._clocked(t):
                for out in outputs:
                    out.copy_(t)
        return _done()

    def all_gather_single(self, output, input, opts=None):
        with self._clocked(output):
            _rows(output, self._size, "all-gather").copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done()

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input)
        return _done()

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, chunks in zip(outputs, input_lists):
            with self._clocked(out):
                out.copy_(chunks[self._rank])
                reduce_identical(out, _reduce_op(opts), self._size)
        return _done()

    def reduce_scatter_single(self, output, input, opts=None):
        with self._clocked(output):
            output.view(-1).copy_(_rows(input, self._size, "reduce-scatter")[self._rank])
            reduce_identical(output, _reduce_op(opts), self._size)
        return _done()

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _done()

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if list(output_split_sizes or []) != list(input_split_sizes or []):
            raise NotImplementedError(
                f"loopback all-to-all: receiving {list(output_split_sizes or [])} rows from the ranks while "
                f"sending {list(input_split_sizes or [])} is not a symmetric exchange, which a simulated world "
                f"cannot represent (expert parallelism's static-capacity exchange is symmetric)")
        with self._clocked(output):
            output.copy_(input)
        return _done()

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        for out, t in zip(outputs, inputs):
            with self._clocked(out):
                out.copy_(t)
        return _done()

    def scatter(self, outputs, input_lists, opts=None):
        if opts is not None and opts.rootRank != self._rank:
            raise NotImplementedError("loopback scatter from another rank: its data does not exist in a "
                                      "simulated world")
        for out, chunks in zip(outputs, input_lists):
            with self._clocked(out):
                out.copy_(chunks[self._rank])
        return _done()

    def send(self, tensors, dst, tag):
        raise NotImplementedError("point-to-point send in a simulated world: the peer does not exist")

    def recv(self, tensors, src, tag):
        raise NotImplementedError("point-to-point recv in a simulated world: the peer does not exist")


def _create_loopback_group(store, rank: int, size: int, timeout) -> LoopbackGroup:
    return LoopbackGroup(rank, size)


def register_backend() -> None:
    """Make ``loopback`` a torch.distributed backend (once per process: torch keeps a registry)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create_loopback_group, devices=["cpu", "cuda"])


def _fsdp_divides_after_the_sum() -> None:
    """Make FSDP2 reduce-scatter gradients with SUM and divide afterwards where it would pass
    PREMUL_SUM(1 / factor) (its choice when a gradient divide factor is set, as upstream TorchTitan
    sets one under expert parallelism). torch 2.11's ReduceOp does not expose the factor to Python, so
    the loopback group could not apply it; SUM then divide is FSDP2's own path for fp16 gradients and
    gives the same result. Idempotent; only this process's simulated run is affected."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    chooser = collectives._get_gradient_divide_factors
    if getattr(chooser, "_loopback_sum_then_divide", False):
        return
    factor_of = inspect.signature(chooser)

    def sum_then_divide(*args, **kwargs):
        pre, post, reduce_scatter_op, all_reduce_op = chooser(*args, **kwargs)
        if getattr(reduce_scatter_op, "op", reduce_scatter_op) == ReduceOp.PREMUL_SUM:
            factor = factor_of.bind(*args, **kwargs).arguments["factor"]
            return pre, factor, ReduceOp.SUM, ReduceOp.SUM
        return pre, post, reduce_scatter_op, all_reduce_op

    sum_then_divide._loopback_sum_then_divide = True
    collectives._get_gradient_divide_factors = sum_then_divide


def init_simulated_world(world_size: int) -> int:
    """Join a ``world_size``-rank loopback process group as rank 0 (no launcher, no peers); returns
    the world size."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:
        raise ConfigError(f"[parallelism] simulate_world_size = {world_size} runs one process as rank 0 of a "
                          f"simulated world, but this process was launched as one of {launched} ranks "
                          f"(WORLD_SIZE={launched}, e.g. by torchrun): run it with plain python, or drop "
                          f"simulate_world_size to train on the real ranks")
    if dist.is_initialized():
        raise ConfigError(f"[parallelism] simulate_world_size = {world_size}: this process already has a "
                          f"process group ({dist.get_backend()}, {dist.get_world_size()} ranks); destroy it first")
    register_backend()
    _fsdp_divides_after_the_sum()
    # A HashStore lives in this process: the group has no peers to rendezvous with.
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=world_size)
    return world_size


def loopback_copy_seconds() -> float:
    """Seconds this process's loopback groups spent copying on the compute stream since the last
    call: the part of a simulated step that stands in for communication (0 outside a simulated world)."""
    groups = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    return sum(g.take_copy_seconds() for g in groups if isinstance(g, LoopbackGroup))


def simulation_line(world_size: int) -> str:
    """What the trainer prints at start of a simulated run."""
    return (f"simulating rank 0 of {world_size} ranks in one process: collectives are looped back (no "
            f"communication, but the local copies standing in for it are in the step times; each line gives "
            f"them and the compute-only time without them), memory and compute are one rank's")
