"""The warp-specialized engine the Gluon FP8 GEMMs for Hopper (sm_90a) are built on
(``hopper_grouped.py``, ``hopper_gate_up.py``, ``hopper_wgrad.py``; the dense benchmark kernel
``bench/hopper_dense_gemm.py``).

Every kernel computes block-scaled products: each 128-wide K block's partial product is scaled
before it joins the fp32 sum ("promotion"). Plain Triton issues that from one instruction stream
that also loads the scales and waits for the tensor cores, block after block. Here the work is split
over partitions: a one-warp producer streams A/B tiles (TMA) and their scales (cp.async) through a
ring of shared-memory stages (:func:`allocate_ring`, :func:`load_stage`), and two consumer
warpgroups, each owning 64 rows of the 128 x 128 tile, run their wgmma -> wait -> promote chains
independently, so one promotes while the other's wgmma runs. The register file is re-split between
the partitions (:data:`PRODUCER_REGS`, :data:`CONSUMER_REGS`). BENCHMARKS.md has the measurements
behind these choices (scales through shared memory rather than loaded by the consumers; 128 x 128
tiles).

The M-grouped kernels (rows of many experts, expert-sorted) share their producer
(:func:`grouped_producer`) and their walk over the static tile table of
:mod:`kernels.common.routing` (:func:`table_tile`, :func:`checked_tile_table`).

It imports ``triton.experimental.gluon`` (Triton >= 3.6): ``kernels/fp8/engine.py`` imports the
kernels built on it only where they run.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.common.routing import tile_table

BLOCK_K = gl.constexpr(128)  # one scale block along K per pipeline stage
STAGES = 4
MAXNREG = 168  # 3 warpgroups x 128 threads x 168 = the 64K registers; re-split per partition below
PRODUCER_REGS = gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)
GROUPED_BLOCK_M = 128  # rows per tile of the M-grouped kernels: their tile table must be built for it


def descriptor(t: torch.Tensor, block: list[int], dtype) -> TensorDescriptor:
    """A TMA descriptor of 2-D ``t`` in ``block`` boxes, with the default swizzled shared layout."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


@gluon.jit
def tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Grouped rasterization: GROUP_M row tiles share each column tile while it is in L2."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows = gl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@gluon.jit
def load_stage(a_desc, b_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, it, a_row, b_row, k, as_src, as_mask,
               bs_src, bs_mask, b2_desc=None, b2_bufs=None):
    """Producer step ``it``: once its ring stage is free, copy the scales (cp.async from the
    pointer tensors ``as_src`` / ``bs_src``) and the A and B tiles at (a_row, k), (b_row, k) (TMA);
    with ``b2_desc`` also a second B tile at (b_row, k) into ``b2_bufs`` (gate/up's w3)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    bar = ready.index(s)
    # The scale copies' arrivals are registered before the TMA's, so the stage cannot complete
    # without them.
    async_copy.async_copy_global_to_shared(as_bufs.index(s), as_src, mask=as_mask)
    async_copy.async_copy_global_to_shared(bs_bufs.index(s), bs_src, mask=bs_mask)
    async_copy.mbarrier_arrive(bar)
    if b2_desc is None:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    else:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes + b2_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_row, k], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_bufs.index(s))
    if b2_desc is not None:
        tma.async_copy_global_to_shared(b2_desc, [b_row, k], bar, b2_bufs.index(s))


@gluon.jit
def allocate_ring(a_desc, b_desc, STAGES: gl.constexpr, B_SCALES: gl.constexpr):
    """The ring of stages the producer fills and the two consumer warpgroups drain: A and B tiles,
    A's row scales and ``B_SCALES`` B scales per stage, and the barriers (``ready``: the stage's
    copies landed; ``empty``: both consumer warpgroups are done with it)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    as_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, a_desc.block_type.shape[0]], flat)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, B_SCALES], flat)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty


def checked_tile_table(tiles: torch.Tensor | None, offsets_E1: torch.Tensor, Nr: int, n_tiles: int) -> torch.Tensor:
    """The 128-row tile table a grouped launcher reads: built from ``offsets_E1`` when ``tiles`` is
    None, else the caller's, checked to be one of ``n_tiles`` (``max_tiles(Nr, E, 128)``) entries."""
    if tiles is None:
        return tile_table(offsets_E1, Nr, GROUPED_BLOCK_M)
    if (tuple(tiles.shape) != (2, n_tiles) or not tiles.is_contiguous()
            or tiles.untyped_storage().nbytes() < (tiles.storage_offset() + 2 * n_tiles + 1) * 4):
        # The kernel also reads the real tile count stored right after the table.
        raise ValueError(f"tiles (shape {tuple(tiles.shape)}) is not a table of 128-row tiles over {Nr} rows; "
                         f"pass tile_table(offsets_E1, {Nr}, 128), which also stores the tile count after it")
    return tiles


@gluon.jit
def table_tile(tile, num_n, num_tiles, table_ptr):
    """Persistent-loop index -> (expert, first row, N tile): M tile ``tile // num_n`` of the table."""
    mt = tile // num_n
    return gl.load(table_ptr + mt), gl.load(table_ptr + num_tiles + mt), tile % num_n


@gluon.jit
def grouped_producer(a_desc, b_desc, as_ptr, bs_ptr, table_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty,
                     num_tiles, NR, N, K, SA_R, SA_K, b2_desc=None, b2s_ptr=None, b2_bufs=None):
    """Streams each K block of every (M tile, N tile) of this program: A and B tiles by TMA, the
    tile's 128 row scales (strided rows of a_s) and its expert's one block scale by cp.async. With
    ``b2_desc``, also a second B operand of the same shape (gate/up's w3) and its block scale (lane 1
    of the scale copy; ``bs_bufs`` holds two scales a stage then)."""
    TM: gl.constexpr = a_desc.block_type.shape[0]
    TN: gl.constexpr = b_desc.block_type.shape[0]
    vec: gl.constexpr = gl.BlockedLayout([TM // 32], [32], [1], [0])
    num_n = (N + TN - 1) // TN
    kb_count = (K + BLOCK_K - 1) // BLOCK_K
    real = gl.load(table_ptr + 2 * num_tiles)
    offs = gl.arange(0, TM, vec)
    lane = gl.arange(0, 4, gl.BlockedLayout([1], [32], [1], [0]))
    it = 0
    for tile in range(gl.program_id(0), real * num_n, gl.num_programs(0)):
        expert, row0, pid_n = table_tile(tile, num_n, num_tiles, table_ptr)
        rows = row0 + offs
        for kb in range(kb_count):
            if b2_desc is None:
                bs_src, bs_mask = bs_ptr + (expert * num_n + pid_n) * kb_count + kb + lane, lane == 0
            else:
                scale = (expert * num_n + pid_n) * kb_count + kb
                bs_src, bs_mask = gl.where(lane == 0, bs_ptr + scale, b2s_ptr + scale), lane < 2
            load_stage(a_desc, b_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, it, row0,
                       expert * N + pid_n * TN, kb * BLOCK_K, as_ptr + rows * SA_R + kb * SA_K, rows < NR,
                       bs_src, bs_mask, b2_desc, b2_bufs)
            it += 1
