"""Chunked expert parallelism's all-to-alls overlap compute only with inductor's comm reordering
(parallelisms/compile.py): the trainer turns it on, and it does reorder a chunked graph."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from components.config import Compile
from parallelisms.compile import COMM_REORDER_PASSES, _sink_after_waits, apply_compile, unchained_reorder
from tests.utils import free_port


@pytest.fixture
def inductor_config():
    """Restores the process-wide inductor settings the test changes."""
    import torch._inductor.config as ic

    saved = (ic.reorder_for_compute_comm_overlap, list(ic.reorder_for_compute_comm_overlap_passes))
    yield ic
    ic.reorder_for_compute_comm_overlap, ic.reorder_for_compute_comm_overlap_passes = saved


@pytest.mark.unit
def test_apply_compile_turns_reordering_on_only_when_asked(inductor_config):
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(4, 4)])
    apply_compile(model, Compile(enable=True, backend="aot_eager"), comm_reordering=True)
    assert not inductor_config.reorder_for_compute_comm_overlap, "aot_eager has no inductor passes to turn on"
    apply_compile(model, Compile(enable=True), comm_reordering=False)
    assert not inductor_config.reorder_for_compute_comm_overlap
    apply_compile(model, Compile(enable=True), comm_reordering=True)
    # Every pass must exist in this torch: a torch that renamed one would silently overlap less.
    assert inductor_config.reorder_for_compute_comm_overlap
    assert list(inductor_config.reorder_for_compute_comm_overlap_passes) == [unchained_reorder]


@pytest.fixture
def gloo_world():
    """A one-rank gloo group: enough to compile collectives and read the schedule inductor picks."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _expert_math(x, ids, w):
    return torch.relu(x @ w) * (ids.view(-1, 1) >= 0)


# A stand-in for the mega op: an opaque custom op with its own backward, as the trainer's graph has.
@torch.library.custom_op("test_overlap::expert", mutates_args=())
def _expert(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _expert_math(x, ids, w)


@_expert.register_fake
def _(x, ids, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _expert_backward(ctx, grad):
    x, ids, w = ctx.saved_tensors
    with torch.enable_grad():
        xx, ww = x.detach().requires_grad_(), w.detach().requires_grad_()
        gx, gw = torch.autograd.grad(_expert_math(xx, ids, ww), (xx, ww), grad)
    return gx, None, gw


_expert.register_autograd(_expert_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def _chunked_training(x, ids, w, group, chunks):
    """The chunked EP layer's shape with autograd: each chunk sorts its rows by expert and dispatches
    rows and ids; every chunk's experts run, then its combine; the rows return to their order."""
    sent = []
    for xc, idc in zip(x.chunk(chunks), ids.chunk(chunks)):
        order = torch.argsort(idc, stable=True)
        rx = funcol.all_to_all_single_autograd(xc[order], None, None, group)
        rid = funcol.all_to_all_single(idc[order], None, None, group)
        sent.append((rx, rid, order))
    backs = [funcol.all_to_all_single_autograd(_expert(rx, rid, w), None, None, group) for rx, rid, _ in sent]
    return torch.cat([yb[torch.argsort(order)] for yb, (_, _, order) in zip(backs, sent)])


def _issued_before_first_wait(code: str) -> int:
    """All-to-alls a forward graph has in flight together before it first waits on one."""
    issued = 0
    for ln in code.split("def call(")[1].splitlines():
        if ln.strip().startswith("#"):
            continue
        if "wait_tensor.default(" in ln:
            return issued
        if "all_to_all_single.default(" in ln:
            issued += 1
    raise AssertionError("no wait in the generated forward")


def _combine_waits_under_next_experts(code: str) -> bool:
    """The first chunk's combine (the first all-to-all after an expert op) is awaited only after the
    second chunk's expert op."""
    lines = [ln.strip() for ln in code.split("def call(")[1].splitlines() if not ln.strip().startswith("#")]
    experts = [i for i, ln in enumerate(lines) if "test_overlap.expert" in ln]
    combine = next(ln for ln in lines[experts[0]:] if "all_to_all_single.default(" in ln).split("=")[0].strip()
    wait = next(i for i, ln in enumerate(lines) if f"wait_tensor.default({combine})" in ln)
    return wait > experts[1]


def test_unchained_reorder_issues_every_dispatch_before_the_experts(inductor_config, gloo_world):
    """In a training graph inductor chains each collective after the previous one's wait; with the
    builtin passes each dispatch (rows, then ids, of each chunk) waits for the one before it to land.
    unchained_reorder issues both chunks' dispatches (4 all-to-alls) before the first wait, and awaits
    chunk 0's combine only after chunk 1's experts.
    Values and gradients stay those of eager. (This also covers what a forward-only test of
    chunked all-to-alls checked before: that the builtin schedule does not overlap by itself, and
    that unchained_reorder moves a combine's wait below the next chunk's compute.)"""
    from torch._inductor.utils import run_and_get_code

    group = gloo_world
    x, ids, w = torch.randn(64, 16), torch.randint(0, 4, (64,)), torch.randn(16, 16)
    grad = torch.randn(64, 16)

    def grads(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xx, ids, ww)
        out.backward(grad)
        return out.detach(), xx.grad, ww.grad

    want = grads(lambda a, b, c: _chunked_training(a, b, c, group, 2))
    issued = {}
    for name, passes in (("builtin", list(COMM_REORDER_PASSES)), ("unchained", [unchained_reorder])):
        torch._dynamo.reset()
        inductor_config.reorder_for_compute_comm_overlap = True
        inductor_config.reorder_for_compute_comm_overlap_passes = passes
        fn = torch.compile(lambda a, b, c: _chunked_training(a, b, c, group, 2), fullgraph=True)
        got, (forward_code, *_) = run_and_get_code(grads, fn)
        for g, wnt in zip(got, want):
            torch.testing.assert_close(g, wnt)
        issued[name] = _issued_before_first_wait(forward_code)
        if name == "unchained":
            assert _combine_waits_under_next_experts(forward_code), "chunk 0's combine no longer overlaps chunk 1's experts"
    assert issued["builtin"] == 1, f"the builtin passes had {issued['builtin']} all-to-alls in flight: revisit compile.py"
    assert issued["unchained"] == 4, f"unchained_reorder had {issued['unchained']} of 4 dispatches in flight at the first wait"


class _Node:
    """A stand-in for an inductor scheduler node: a name, the buffer it makes, the buffers it reads."""

    def __init__(self, name, *reads):
        self.name = name
        self.unmet_dependencies = {type("Dep", (), {"name": r})() for r in reads}

    def get_buffer_names(self):
        return {self.name}

    def __repr__(self):
        return self.name


@pytest.mark.unit
def test_sink_after_waits_puts_each_chunks_combine_under_the_next_chunks_experts():
    """The order sink_waits gave the trainer's forward (2 chunks): chunk 0's combine was
    awaited and reduced before chunk 1's experts. _sink_after_waits keeps the collectives' places and
    moves each wait and its readers down to their first anchored reader."""
    nodes = [_Node("d0", "x"), _Node("d1", "x"), _Node("wd0", "d0"), _Node("e0", "wd0", "w"), _Node("c0", "e0"),
             _Node("wc0", "c0"), _Node("r0", "wc0"), _Node("wd1", "d1"), _Node("e1", "wd1", "w"),
             _Node("c1", "e1"), _Node("wc1", "c1"), _Node("r1", "wc1"), _Node("out", "r0", "r1")]
    got = _sink_after_waits(nodes, is_collective=lambda n: n.name[0] in "dc",
                            is_wait=lambda n: n.name[0] == "w")
    assert [n.name for n in got] == ["d0", "d1", "wd0", "e0", "c0", "wd1", "e1", "c1", "wc0", "r0", "wc1", "r1", "out"]


@pytest.mark.unit
def test_sink_after_waits_runs_independent_compute_while_a_dispatch_travels():
    """Compute that reads no wait keeps its place; a wait and its readers go below it, so it runs
    while the dispatch travels, and an unread wait goes to the end."""
    nodes = [_Node("d0", "x"), _Node("a", "x"), _Node("wd0", "d0"), _Node("e0", "wd0"), _Node("b", "x"),
             _Node("c0", "e0"), _Node("wc0", "c0")]
    got = _sink_after_waits(nodes, is_collective=lambda n: n.name[0] in "dc", is_wait=lambda n: n.name[0] == "w")
    assert [n.name for n in got] == ["d0", "a", "b", "wd0", "e0", "c0", "wc0"]
