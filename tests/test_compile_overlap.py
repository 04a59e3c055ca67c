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
from parallelisms.compile import COMM_REORDER_PASSES, apply_compile
from tests.test_distributed import free_port


@pytest.fixture
def inductor_config():
    """Restores the process-wide inductor settings the test changes."""
    import torch._inductor.config as ic

    saved = (ic.reorder_for_compute_comm_overlap, list(ic.reorder_for_compute_comm_overlap_passes))
    yield ic
    ic.reorder_for_compute_comm_overlap, ic.reorder_for_compute_comm_overlap_passes = saved


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
    assert list(inductor_config.reorder_for_compute_comm_overlap_passes) == list(COMM_REORDER_PASSES)


def _chunked(x0, x1, w, group):
    """Two chunks: dispatch both, then each chunk's GEMM and its combine (the EP layer's shape)."""
    sizes = [x0.shape[0]]
    a0 = funcol.all_to_all_single(x0, sizes, sizes, group)
    a1 = funcol.all_to_all_single(x1, sizes, sizes, group)
    b0 = funcol.all_to_all_single(torch.relu(a0 @ w), sizes, sizes, group)
    b1 = funcol.all_to_all_single(torch.relu(a1 @ w), sizes, sizes, group)
    return b0 + b1


def _wait_follows_compute(code: str) -> bool:
    """Some all-to-all's wait comes after a GEMM issued once the all-to-all was in flight."""
    lines = [ln.strip() for ln in code.splitlines()]
    for i, ln in enumerate(lines):
        if "all_to_all_single.default(" in ln and "=" in ln:
            buf = ln.split("=")[0].strip()
            for later in lines[i + 1:]:
                if "extern_kernels.mm" in later:
                    return True
                if f"wait_tensor.default({buf})" in later:
                    break
    return False


def test_inductor_reordering_overlaps_chunked_all_to_alls(inductor_config, tmp_path):
    """One gloo rank is enough to see the schedule: with inductor's defaults every wait sits right
    after its all-to-all; with the trainer's passes a combine's wait moves below the next chunk's GEMM."""
    from torch._inductor.utils import run_and_get_code

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        x0, x1, w = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 16)
        want = _chunked(x0, x1, w, group)
        codes = {}
        for reorder in (False, True):
            torch._dynamo.reset()
            inductor_config.reorder_for_compute_comm_overlap = reorder
            inductor_config.reorder_for_compute_comm_overlap_passes = list(COMM_REORDER_PASSES) if reorder else []
            fn = torch.compile(lambda a, b, c: _chunked(a, b, c, group), fullgraph=True)
            got, (code, *_) = run_and_get_code(fn, x0, x1, w)
            torch.testing.assert_close(got, want)
            codes[reorder] = code
        assert not _wait_follows_compute(codes[False]), "inductor's defaults overlapped already: revisit compile.py"
        assert _wait_follows_compute(codes[True]), "the reordering passes left every wait right after its all-to-all"
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
