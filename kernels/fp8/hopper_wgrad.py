"""K-grouped block-scaled FP8 weight-gradient GEMM for Hopper (sm_90a), on the warp-specialized engine
of :mod:`kernels.fp8.gluon_base`.

    dW[e] (M, Ncol) = sum over expert e's 128-token tiles t of (at_q[:, t] @ bt_q[:, t].T) * at_s[:, t] x bt_s[:, t]

The operands are those of :func:`kernels.fp8.grouped_gemm.fp8_wgrad`: both quantized in 128 x 1
tiles along each expert's tokens and stored transposed, tile t of the expert-sorted rows at its own
aligned 128 columns (:func:`kernels.fp8.blockwise.quantize_cols_grouped`). Every row of either
operand has its own scale per token tile, so each tile's partial sum is promoted with the outer
product of a row-scale and a column-scale vector.

The partitions are the engine's: a one-warp producer streams each token tile's A and B tiles
(TMA) and both scale vectors (cp.async) through a ring of stages, and two consumer warpgroups, each
owning 64 rows of the 128 x 128 output tile, run wgmma -> wait -> promote independently. A tile's
K range is its expert's token tiles, read from device-side offsets (no host sync); an expert with
no tokens stores zeros. Output tiles are ordered by expert, so the tiles running at once share
their experts' operands in L2.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.fp8.blockwise import TILE, group_tile_offsets
from kernels.fp8.gluon_base import (CONSUMER_REGS, MAXNREG, PRODUCER_REGS, STAGES, allocate_ring, descriptor,
                                    load_stage, tile_coords)
from kernels.fp8.grouped_gemm import check_wgrad_operands


@gluon.jit
def _expert_tile(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """Output tile -> (expert, row tile, column tile): an expert's tiles are consecutive."""
    per_expert = num_m * num_n
    pid_m, pid_n = tile_coords(tile % per_expert, num_m, num_n, GROUP_M)
    return tile // per_expert, pid_m, pid_n


@gluon.jit
def _wgrad_producer(a_desc, b_desc, as_ptr, bs_ptr, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, E,
                    M, NCOL, SA_R, SA_T, SB_R, SB_T, GROUP_M: gl.constexpr):
    """Streams each token tile's operand tiles (TMA) and the row and column scales of that token tile
    (cp.async; contiguous when the scales are stored tile-major, as quantize_cols_grouped does)
    into the ring of stages."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(BLOCK_M == BLOCK_N, "one scale-vector layout serves rows and columns")
    vec: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (NCOL + BLOCK_N - 1) // BLOCK_N
    offs = gl.arange(0, BLOCK_M, vec)
    it = 0
    for tile in range(gl.program_id(0), E * num_m * num_n, gl.num_programs(0)):
        e, pid_m, pid_n = _expert_tile(tile, num_m, num_n, GROUP_M)
        t0 = gl.load(tile_offs_ptr + e)
        t1 = gl.load(tile_offs_ptr + e + 1)
        rows = pid_m * BLOCK_M + offs
        cols = pid_n * BLOCK_N + offs
        for t in range(t0, t1):
            load_stage(a_desc, b_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, it, pid_m * BLOCK_M,
                       pid_n * BLOCK_N, t * BLOCK_M, as_ptr + rows * SA_R + t * SA_T, rows < M,
                       bs_ptr + cols * SB_R + t * SB_T, cols < NCOL)
            it += 1


@gluon.jit
def _wgrad_consumer(c_desc, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem, E, M, NCOL,
                    GROUP_M: gl.constexpr, WG: gl.constexpr):
    """Warpgroup WG's 64 rows of every output tile of this program: per token tile a fresh partial
    sum, promoted into the fp32 sum with its row and column scales while the other warpgroup's
    wgmmas run."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW0: gl.constexpr = WG * 64
    gl.static_assert(BLOCK_M == 128 and BLOCK_N == 128, "128 x 128 tiles")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (NCOL + BLOCK_N - 1) // BLOCK_N
    part = gl.zeros([64, BLOCK_N], gl.float32, mma)
    it = 0
    for tile in range(gl.program_id(0), E * num_m * num_n, gl.num_programs(0)):
        e, pid_m, pid_n = _expert_tile(tile, num_m, num_n, GROUP_M)
        t0 = gl.load(tile_offs_ptr + e)
        t1 = gl.load(tile_offs_ptr + e + 1)
        acc = gl.zeros([64, BLOCK_N], gl.float32, mma)
        for t in range(t0, t1):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(s).slice(ROW0, 64), b_bufs.index(s).permute((1, 0)), part,
                                 use_acc=False, is_async=True)
            sa = as_bufs.index(s).slice(ROW0, 64).load(rows_layout)
            sb = bs_bufs.index(s).load(cols_layout)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + part * (sa[:, None] * sb[None, :])
            it += 1
        tma.store_wait(pendings=0)  # the previous tile's store must have left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [e * M + pid_m * BLOCK_M + ROW0, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _wgrad_worker(a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready,
                  empty, c_smem, E, M, NCOL, SA_R, SA_T, SB_R, SB_T, GROUP_M: gl.constexpr, ROLE: gl.constexpr):
    # Worker partitions share one signature: ROLE 0 loads, ROLE 1 is the second consumer warpgroup.
    if ROLE == 0:
        _wgrad_producer(a_desc, b_desc, as_ptr, bs_ptr, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty,
                        E, M, NCOL, SA_R, SA_T, SB_R, SB_T, GROUP_M)
    else:
        _wgrad_consumer(c_desc, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem.index(1), E, M,
                        NCOL, GROUP_M, 1)


@gluon.jit
def _fp8_wgrad_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_offs_ptr, E, M, NCOL, SA_R, SA_T, SB_R, SB_T,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES, b_desc.block_type.shape[0])
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    gl.warp_specialize([
        (_wgrad_consumer, (c_desc, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem.index(0), E,
                           M, NCOL, GROUP_M, 0)),
        (_wgrad_worker, (a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs,
                         ready, empty, c_smem, E, M, NCOL, SA_R, SA_T, SB_R, SB_T, GROUP_M, 0)),
        (_wgrad_worker, (a_desc, b_desc, c_desc, as_ptr, bs_ptr, tile_offs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs,
                         ready, empty, c_smem, E, M, NCOL, SA_R, SA_T, SB_R, SB_T, GROUP_M, 1)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


_GL_DTYPES = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16}


def wgrad_supported(M: int, NCOL: int, out_dtype: torch.dtype) -> bool:
    """Whether :func:`fp8_wgrad_ws` takes these sizes: each expert's output rows whole 128-row tiles
    (the output is stored by TMA into the (E*M, Ncol) view) and output rows 16-byte aligned."""
    return M % TILE == 0 and NCOL * torch.empty((), dtype=out_dtype).element_size() % 16 == 0


def fp8_wgrad_ws(at_q: torch.Tensor, at_s: torch.Tensor, bt_q: torch.Tensor, bt_s: torch.Tensor,
                 offsets_E1: torch.Tensor, out_dtype: torch.dtype = torch.float32, *, stages: int = STAGES,
                 group_m: int = 8) -> torch.Tensor:
    """:func:`kernels.fp8.grouped_gemm.fp8_wgrad` on the warp-specialized engine (sm_90 GPU): the same
    operands and result, (E, M, Ncol) ``out_dtype`` with zeros for an expert with no rows. M must be
    a multiple of 128 (:func:`wgrad_supported`)."""
    M, NCOL, E, n_tiles = check_wgrad_operands(at_q, at_s, bt_q, bt_s, offsets_E1, out_dtype)
    if not wgrad_supported(M, NCOL, out_dtype):
        raise ValueError(f"fp8_wgrad_ws needs M (={M}) a multiple of 128 and Ncol (={NCOL}) rows of {out_dtype} "
                         "16-byte aligned; kernels.fp8.grouped_gemm.fp8_wgrad takes any size")
    out = torch.empty((E, M, NCOL), device=at_q.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    a_desc = descriptor(at_q, [128, TILE], gl.float8e4nv)
    b_desc = descriptor(bt_q, [128, TILE], gl.float8e4nv)
    c_desc = descriptor(out.view(E * M, NCOL), [64, 128], _GL_DTYPES[out_dtype])
    tiles = E * triton.cdiv(M, 128) * triton.cdiv(NCOL, 128)
    sms = torch.cuda.get_device_properties(at_q.device).multi_processor_count
    _fp8_wgrad_kernel[(min(sms, tiles), )](a_desc, b_desc, c_desc, at_s, bt_s, group_tile_offsets(offsets_E1), E, M,
                                           NCOL, *at_s.stride(), *bt_s.stride(), stages, group_m, num_warps=4,
                                           maxnreg=MAXNREG)
    return out
