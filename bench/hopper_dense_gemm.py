"""The dense block-scaled FP8 GEMM on the warp-specialized Gluon engine (sm_90a): a benchmark
kernel, the engine's first step, timed against cuBLAS by ``bench/hopper_gemm.py``. The MoE op runs
its grouped siblings (``kernels/fp8/hopper_*.py``), built on the same engine
(:mod:`kernels.fp8.gluon_base`).

    out (M, N) bf16 = sum over 128-wide K blocks kb of (a_q[:, kb] @ b_q[:, kb].T) * a_s[:, kb] * b_s[:, kb]

a: e4m3 (M, K) with 1 x 128 scales; b: e4m3 (N, K) with 128 x 128 block scales (N/128, K/128): the
DeepSeek-V3 recipe of kernels/fp8/blockwise.py. The activation scales are read transposed,
(K/128, M) contiguous, so a K block's scales for a row tile are one contiguous copy.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kernels.fp8.blockwise import TILE, dequantize_rowwise_ref, dequantize_weight_ref
from kernels.fp8.gluon_base import (BLOCK_K, CONSUMER_REGS, MAXNREG, PRODUCER_REGS, STAGES, allocate_ring, descriptor,
                                    load_stage, tile_coords)

FP8 = torch.float8_e4m3fn


@gluon.jit
def _producer(a_desc, b_desc, as_ptr, bs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, M, N, K,
              GROUP_M: gl.constexpr):
    """Streams each K block's A and B tiles (TMA) and their scales (cp.async: the row tile's
    activation scales, contiguous in the transposed (K/128, M) layout, and the column tile's weight
    scale) into the ring of stages. A stage is ready when both kinds of copy have landed."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    vec: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    kb_count = (K + BLOCK_K - 1) // BLOCK_K
    offs = gl.arange(0, BLOCK_M, vec)
    lane = gl.arange(0, 4, gl.BlockedLayout([1], [32], [1], [0]))
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        rows = pid_m * BLOCK_M + offs
        for kb in range(kb_count):
            load_stage(a_desc, b_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, it, pid_m * BLOCK_M,
                       pid_n * BLOCK_N, kb * BLOCK_K, as_ptr + kb * M + rows, rows < M,
                       bs_ptr + pid_n * kb_count + kb + lane, lane == 0)
            it += 1


@gluon.jit
def _stage_scales(as_bufs, bs_bufs, s, ROW0: gl.constexpr, rows_layout: gl.constexpr):
    """a_s[row, kb] * b_s[col tile, kb] for this warpgroup's 64 rows, from stage s."""
    sa = as_bufs.index(s).slice(ROW0, 64).load(rows_layout)
    return sa * bs_bufs.index(s).slice(0, 1).load(rows_layout)


@gluon.jit
def _consume_tiles(c_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem, M, N, K, GROUP_M: gl.constexpr,
                   WG: gl.constexpr):
    """Warpgroup WG's 64 rows of every 128 x 128 tile of this program. Per K block the wgmma lands in
    a fresh partial sum that is scaled into the tile's fp32 sum while the other warpgroup's wgmmas
    keep the tensor cores busy."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW0: gl.constexpr = WG * 64
    gl.static_assert(BLOCK_M == 128 and BLOCK_N == 128, "128 x 128 tiles")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    kb_count = (K + BLOCK_K - 1) // BLOCK_K
    # A K block's partial sum reuses the previous one's registers (use_acc=False ignores their
    # values): a separate zero tensor would hold 64 more registers per thread.
    t = gl.zeros([64, BLOCK_N], gl.float32, mma)
    it = 0
    for tile in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = gl.zeros([64, BLOCK_N], gl.float32, mma)
        for kb in range(kb_count):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s).slice(ROW0, 64)
            b = b_bufs.index(s).permute((1, 0))
            t = warpgroup_mma(a, b, t, use_acc=False, is_async=True)
            sc = _stage_scales(as_bufs, bs_bufs, s, ROW0, rows_layout)
            t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc = acc + t * sc[:, None]
            it += 1
        tma.store_wait(pendings=0)  # the previous tile's store must have left c_smem before it is rewritten
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M + ROW0, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _worker(a_desc, b_desc, c_desc, as_ptr, bs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem, M, N,
            K, GROUP_M: gl.constexpr, ROLE: gl.constexpr):
    # Worker partitions share one signature: ROLE 0 loads, ROLE 1 is the second consumer warpgroup.
    if ROLE == 0:
        _producer(a_desc, b_desc, as_ptr, bs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, M, N, K, GROUP_M)
    else:
        _consume_tiles(c_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem.index(1), M, N, K, GROUP_M, 1)


@gluon.jit
def _fp8_gemm_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, M, N, K, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Three partitions: a one-warp TMA producer and two 4-warp consumer warpgroups, each owning half
    of every tile's rows; only a partition's own warps synchronize with each other."""
    a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty = allocate_ring(a_desc, b_desc, STAGES, 4)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    gl.warp_specialize([
        (_consume_tiles, (c_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem.index(0), M, N, K, GROUP_M,
                          0)),
        (_worker, (a_desc, b_desc, c_desc, as_ptr, bs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem, M,
                   N, K, GROUP_M, 0)),
        (_worker, (a_desc, b_desc, c_desc, as_ptr, bs_ptr, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_smem, M,
                   N, K, GROUP_M, 1)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def fp8_gemm(a_q: torch.Tensor, a_s_t: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor, *,
             stages: int = STAGES, group_m: int = 8) -> torch.Tensor:
    """out (M, N) bf16 = dequant(a) @ dequant(b).T on an sm_90 GPU.

    a_q (M, K) e4m3 with a_s_t (K/128, M) fp32 (the 1 x 128 scales, transposed and contiguous);
    b_q (N, K) e4m3 with b_s (N/128, K/128) fp32. K a multiple of 16 and N of 8 (TMA row alignment)."""
    if a_q.dtype != FP8 or b_q.dtype != FP8:
        raise ValueError(f"a_q and b_q must be float8_e4m3fn, got {a_q.dtype} and {b_q.dtype}")
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(f"a_q (M, K) and b_q (N, K) must share K, got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    M, K = a_q.shape
    N = b_q.shape[0]
    kb = triton.cdiv(K, TILE)
    if K % 16 or N % 8 or not (a_q.is_contiguous() and b_q.is_contiguous()):
        raise ValueError(f"K ({K}) must be a multiple of 16, N ({N}) of 8, and a_q, b_q contiguous (TMA rows "
                         "are 16-byte aligned)")
    if a_s_t.shape != (kb, M) or not a_s_t.is_contiguous() or a_s_t.dtype != torch.float32:
        raise ValueError(f"a_s_t must be contiguous float32 ({kb}, {M}) (the scales transposed), got "
                         f"{a_s_t.dtype} {tuple(a_s_t.shape)}")
    if b_s.shape != (triton.cdiv(N, TILE), kb) or not b_s.is_contiguous() or b_s.dtype != torch.float32:
        raise ValueError(f"b_s must be contiguous float32 ({triton.cdiv(N, TILE)}, {kb}), got {b_s.dtype} "
                         f"{tuple(b_s.shape)}")
    out = torch.empty(M, N, device=a_q.device, dtype=torch.bfloat16)
    a_desc = descriptor(a_q, [128, TILE], gl.float8e4nv)
    b_desc = descriptor(b_q, [128, TILE], gl.float8e4nv)
    c_desc = descriptor(out, [64, 128], gl.bfloat16)
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    sms = torch.cuda.get_device_properties(a_q.device).multi_processor_count
    _fp8_gemm_kernel[(min(sms, tiles), )](a_desc, b_desc, c_desc, a_s_t, b_s, M, N, K, stages, group_m, num_warps=4,
                                          maxnreg=MAXNREG)
    return out


def fp8_gemm_ref(a_q, a_s, b_q, b_s, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The product of the dequantized operands in ``dtype``; a_s (M, K/128) (not transposed)."""
    a = dequantize_rowwise_ref(a_q, a_s, dtype)
    b = dequantize_weight_ref(b_q[None], b_s[None], dtype)[0]
    return a @ b.T
