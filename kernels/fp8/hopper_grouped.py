"""M-grouped block-scaled FP8 GEMM for Hopper (sm_90a), on the warp-specialized engine of
:mod:`kernels.fp8.gluon_base`.

    out[r] = sum over 128-wide K blocks kb of (a_q[r, kb] @ b_q[e(r), :, kb].T) * a_s[r, kb] * b_s[e(r), :, kb]

for the expert-sorted rows r (expert e(r)), the operands and result of
:func:`kernels.fp8.grouped_gemm.fp8_grouped_gemm` without its row gather: a (Nr, K) e4m3 with 1 x 128
scales, b (E, N, K) e4m3 with 128 x 128 block scales. It runs the MoE op's down GEMM (combine
epilogue: row r is stored at output row ``out_slot[r]``, scaled by that slot's routing weight), the
dX GEMM (the same scatter, unweighted) and dA' (plain rows, fp32, A gathered beforehand).

The partitions are the engine's: a one-warp producer streams each 128-row tile's A tile and
its expert's B tile (TMA) with their scales (cp.async) through a ring of stages, and two consumer
warpgroups, each owning 64 rows of the 128 x 128 output tile, run wgmma -> wait -> promote
independently. The M tiles come from the static tile table of :mod:`kernels.common.routing` (device
side, no host sync), which also holds the number of real tiles: the persistent loop visits only
those, N tile fastest, so the programs running at once share a few A tiles and one expert's B.
A tile's TMA box may reach into the next expert's rows or past the last row (zero-filled): those
rows are computed and not stored. Rows are stored from registers with pointer stores (a scatter
cannot go through TMA), after a layout change that makes each warp's store cover whole rows.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.common.routing import max_tiles
from kernels.fp8.blockwise import TILE
from kernels.fp8.gluon_base import (BLOCK_K, CONSUMER_REGS, GROUPED_BLOCK_M, MAXNREG, PRODUCER_REGS, STAGES,
                                    allocate_ring, checked_tile_table, descriptor, grouped_producer, table_tile)
from kernels.fp8.grouped_gemm import check_grouped_operands


@gluon.jit
def _store_rows(acc, out_ptr, slot_ptr, w_ptr, row0, end, col0, N, LDO, rows_layout: gl.constexpr,
                store_layout: gl.constexpr, SCATTER: gl.constexpr, WEIGHTED: gl.constexpr):
    """Rows [row0, row0 + 64) of ``acc`` that lie before ``end`` stored at their output rows (r, or
    ``slot[r]`` with SCATTER), scaled by ``w[slot[r]]`` in fp32 first with WEIGHTED."""
    R: gl.constexpr = acc.type.shape[0]
    C: gl.constexpr = acc.type.shape[1]
    if WEIGHTED:
        rows = row0 + gl.arange(0, R, rows_layout)
        rmask = rows < end
        slot = gl.load(slot_ptr + rows, mask=rmask, other=0)
        acc = acc * gl.load(w_ptr + slot, mask=rmask, other=0.0)[:, None]
    v = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
    rows = row0 + gl.arange(0, R, gl.SliceLayout(1, store_layout))
    cols = col0 + gl.arange(0, C, gl.SliceLayout(0, store_layout))
    rmask = rows < end
    if SCATTER:
        dst = gl.load(slot_ptr + rows, mask=rmask, other=0)
    else:
        dst = rows
    ptrs = out_ptr + dst.to(gl.int64)[:, None] * LDO + cols[None, :]
    gl.store(ptrs, v, mask=rmask[:, None] & (cols < N)[None, :])


@gluon.jit
def _grouped_consumer(out_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready,
                      empty, num_tiles, N, K, LDO, WG: gl.constexpr, SCATTER: gl.constexpr,
                      WEIGHTED: gl.constexpr):
    """Warpgroup WG's 64 rows of every tile of this program: per K block a fresh partial sum,
    promoted into the fp32 sum with its row and block scales while the other warpgroup's wgmmas run;
    then the rows of the tile's expert are stored."""
    TM: gl.constexpr = a_bufs.type.shape[1]
    TN: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW0: gl.constexpr = WG * 64
    gl.static_assert(TM == 128 and TN == 128, "128 x 128 tiles")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    # Each warp stores whole rows: 16 bytes per thread, consecutive threads along a row.
    VEC: gl.constexpr = 128 // out_ptr.dtype.element_ty.primitive_bitwidth
    store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // TN, TN // VEC], [4, 1], [1, 0])
    num_n = (N + TN - 1) // TN
    kb_count = (K + BLOCK_K - 1) // BLOCK_K
    real = gl.load(table_ptr + 2 * num_tiles)
    part = gl.zeros([64, TN], gl.float32, mma)
    it = 0
    for tile in range(gl.program_id(0), real * num_n, gl.num_programs(0)):
        expert, row0, pid_n = table_tile(tile, num_n, num_tiles, table_ptr)
        acc = gl.zeros([64, TN], gl.float32, mma)
        for kb in range(kb_count):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(s).slice(ROW0, 64), b_bufs.index(s).permute((1, 0)), part,
                                 use_acc=False, is_async=True)
            sc = as_bufs.index(s).slice(ROW0, 64).load(rows_layout) * bs_bufs.index(s).slice(0, 1).load(rows_layout)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + part * sc[:, None]
            it += 1
        _store_rows(acc, out_ptr, slot_ptr, w_ptr, row0 + ROW0, gl.load(offsets_ptr + expert + 1), pid_n * TN, N,
                    LDO, rows_layout, store_layout, SCATTER, WEIGHTED)


@gluon.jit
def _grouped_worker(a_desc, b_desc, out_ptr, as_ptr, bs_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs, b_bufs,
                    as_bufs, bs_bufs, ready, empty, num_tiles, NR, N, K, LDO, SA_R, SA_K, SCATTER: gl.constexpr,
                    WEIGHTED: gl.constexpr, ROLE: gl.constexpr):
    # Worker partitions share one signature: ROLE 0 loads, ROLE 1 is the second consumer warpgroup.
    if ROLE == 0:
        grouped_producer(a_desc, b_desc, as_ptr, bs_ptr, table_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty,
                         num_tiles, NR, N, K, SA_R, SA_K)
    else:
        _grouped_consumer(out_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready,
                          empty, num_tiles, N, K, LDO, 1, SCATTER, WEIGHTED)


@gluon.jit
def _fp8_grouped_kernel(a_desc, b_desc, out_ptr, as_ptr, bs_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, num_tiles,
                        NR, N, K, LDO, SA_R, SA_K, STAGES: gl.constexpr, SCATTER: gl.constexpr,
                        WEIGHTED: gl.constexpr):
    a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES, 4)
    gl.warp_specialize([
        (_grouped_consumer, (out_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready,
                             empty, num_tiles, N, K, LDO, 0, SCATTER, WEIGHTED)),
        (_grouped_worker, (a_desc, b_desc, out_ptr, as_ptr, bs_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs,
                           b_bufs, as_bufs, bs_bufs, ready, empty, num_tiles, NR, N, K, LDO, SA_R, SA_K, SCATTER,
                           WEIGHTED, 0)),
        (_grouped_worker, (a_desc, b_desc, out_ptr, as_ptr, bs_ptr, slot_ptr, w_ptr, offsets_ptr, table_ptr, a_bufs,
                           b_bufs, as_bufs, bs_bufs, ready, empty, num_tiles, NR, N, K, LDO, SA_R, SA_K, SCATTER,
                           WEIGHTED, 1)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def grouped_supported(K: int) -> bool:
    """Whether :func:`fp8_grouped_gemm_ws` takes this reduction size: TMA rows of A and B (K bytes
    of e4m3) must be 16-byte aligned."""
    return K % 16 == 0


def fp8_grouped_gemm_ws(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                        offsets_E1: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                        tiles: torch.Tensor | None = None, out_slot_N: torch.Tensor | None = None,
                        slot_weights_N: torch.Tensor | None = None, *, stages: int = STAGES) -> torch.Tensor:
    """:func:`kernels.fp8.grouped_gemm.fp8_grouped_gemm` with A's rows already expert-sorted (no
    ``sorted_slot_N``), on the warp-specialized engine (sm_90 GPU): the same operands and result.
    ``tiles`` is the tile table for 128-row tiles (``tile_table(offsets_E1, Nr, 128)``; built when
    None). K must be a multiple of 16 (:func:`grouped_supported`)."""
    E, N, K, Nr = check_grouped_operands(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, None, out_slot_N, slot_weights_N)
    if not grouped_supported(K):
        raise ValueError(f"fp8_grouped_gemm_ws needs K (={K}) a multiple of 16 (TMA rows); "
                         "kernels.fp8.grouped_gemm.fp8_grouped_gemm takes any K")
    out = torch.empty((Nr, N), device=a_q.device, dtype=out_dtype)
    n_tiles = max_tiles(Nr, E, GROUPED_BLOCK_M)
    if Nr == 0 or N == 0 or n_tiles == 0:
        return out
    if K == 0:
        return out.zero_()
    tiles = checked_tile_table(tiles, offsets_E1, Nr, n_tiles)
    a_desc = descriptor(a_q, [GROUPED_BLOCK_M, TILE], gl.float8e4nv)
    b_desc = descriptor(b_q.view(E * N, K), [128, TILE], gl.float8e4nv)
    sms = torch.cuda.get_device_properties(a_q.device).multi_processor_count
    programs = min(sms, n_tiles * triton.cdiv(N, 128))
    slot = out_slot_N if out_slot_N is not None else offsets_E1
    weights = slot_weights_N if slot_weights_N is not None else a_s
    _fp8_grouped_kernel[(programs, )](a_desc, b_desc, out, a_s, b_s, slot, weights, offsets_E1, tiles, n_tiles, Nr, N,
                                      K, out.stride(0), *a_s.stride(), stages, out_slot_N is not None,
                                      slot_weights_N is not None, num_warps=4, maxnreg=MAXNREG)
    return out
