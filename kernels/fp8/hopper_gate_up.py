"""The FP8 gate/up GEMM of the MoE op with its SwiGLU and 1 x 128 A-quantization epilogue, on the
warp-specialized Hopper (sm_90a) engine of :mod:`kernels.fp8.gluon_base`.

    gate[r] = sum over kb of (a_q[r, kb] @ w1_q[e(r), :, kb].T) * a_s[r, kb] * w1_s[e(r), :, kb]   (up: w3)
    H[r] = [gate | up] (bf16), A = silu(gate) * up (rounded to bf16), A quantized 1 x 128 (e4m3 + fp32 scale)

the result of :func:`kernels.fp8.grouped_gemm.fp8_gate_up_swiglu` (``quantize_a=True, store_a=False``),
bit for bit, for expert-sorted rows r whose A rows are already in expert order, so that both
operands load by TMA: the op writes x's quantized rows there first
(:func:`kernels.fp8.engine.expert_order_rows`: ``quantize_1x128_sorted``, or ``gather_sorted_rows``
of the quantized rows and scales).

The partitions are the M-grouped kernels' (``hopper_grouped.py``): a one-warp producer streams per
K block the A tile and the expert's w1 and w3 tiles (TMA) with A's row scales and the two block
scales (cp.async); two consumer warpgroups own 64 rows each and run gate's wgmma -> wait -> promote,
then up's, while the other warpgroup's wgmmas run. Each consumer holds gate, up and one partial
product: 3 x 64 registers. The epilogue works in the MMA's register layout (SwiGLU, the row amax
over the tile's 128 columns, which are one scale block) and changes layout only to store.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.common.routing import max_tiles
from kernels.fp8.blockwise import TILE
from kernels.fp8.gluon_base import (BLOCK_K, CONSUMER_REGS, GROUPED_BLOCK_M, MAXNREG, PRODUCER_REGS, allocate_ring,
                                    checked_tile_table, descriptor, grouped_producer, table_tile)
from kernels.fp8.grouped_gemm import check_fp8, check_scales

STAGES = 4  # 48 KiB of tiles a stage (A, w1, w3)
E4M3_MAX = gl.constexpr(448.0)
AMAX_EPS = gl.constexpr(1e-12)


@gluon.jit
def _scale_from_amax(amax, POW2: gl.constexpr):
    """max(amax, eps) / 448, optionally rounded up to a power of two (as
    :func:`kernels.fp8.blockwise.scale_from_amax`)."""
    s = gl.div_rn(gl.maximum(amax, AMAX_EPS), E4M3_MAX)
    if POW2:
        u = s.to(gl.int32, bitcast=True)
        s = ((u + 0x7FFFFF) & -8388608).to(gl.float32, bitcast=True)
    return s


@gluon.jit
def _epilogue(acc_g, acc_u, h_ptr, aq_ptr, as_out_ptr, row0, end, pid_n, F, POW2: gl.constexpr,
              store_layout: gl.constexpr):
    """gate and up rounded to H's dtype and stored; A = silu(gate) * up rounded the same way and its
    1 x 128 quantization (this tile's 128 columns are one scale block) stored with the scales. The
    math runs in the accumulators' layout, so only the stored tiles change layout."""
    R: gl.constexpr = acc_g.type.shape[0]
    C: gl.constexpr = acc_g.type.shape[1]
    dtype: gl.constexpr = h_ptr.dtype.element_ty
    mma: gl.constexpr = acc_g.type.layout
    rows = row0 + gl.arange(0, R, gl.SliceLayout(1, store_layout))
    cols = pid_n * C + gl.arange(0, C, gl.SliceLayout(0, store_layout))
    mask = (rows < end)[:, None] & (cols < F)[None, :]
    r64 = rows.to(gl.int64)
    h_ptrs = h_ptr + r64[:, None] * (2 * F) + cols[None, :]
    gate = acc_g.to(dtype)
    gl.store(h_ptrs, gl.convert_layout(gate, store_layout), mask=mask)
    up = acc_u.to(dtype)
    gl.store(h_ptrs + F, gl.convert_layout(up, store_layout), mask=mask)
    g = gate.to(gl.float32)
    act = (g / (1.0 + gl.exp(-g)) * up.to(gl.float32)).to(dtype).to(gl.float32)
    cols_m = pid_n * C + gl.arange(0, C, gl.SliceLayout(0, mma))
    act = gl.where((cols_m < F)[None, :], act, 0.0)
    s = _scale_from_amax(gl.max(gl.abs(act), axis=1), POW2)
    y = gl.minimum(gl.maximum(gl.div_rn(act, s[:, None]), -E4M3_MAX), E4M3_MAX).to(gl.float8e4nv)
    gl.store(aq_ptr + r64[:, None] * F + cols[None, :], gl.convert_layout(y, store_layout), mask=mask)
    rows_m = row0 + gl.arange(0, R, gl.SliceLayout(1, mma))
    gl.store(as_out_ptr + rows_m.to(gl.int64) * ((F + C - 1) // C) + pid_n, s, mask=rows_m < end)


@gluon.jit
def _consumer(h_ptr, aq_ptr, as_out_ptr, offsets_ptr, table_ptr, a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs, ready,
              empty, num_tiles, F, K, POW2: gl.constexpr, WG: gl.constexpr):
    TN: gl.constexpr = b1_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW0: gl.constexpr = WG * 64
    gl.static_assert(a_bufs.type.shape[1] == 128 and TN == 128, "128 x 128 tiles")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    VEC: gl.constexpr = 128 // h_ptr.dtype.element_ty.primitive_bitwidth
    store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // TN, TN // VEC], [4, 1], [1, 0])
    num_n = (F + TN - 1) // TN
    kb_count = (K + BLOCK_K - 1) // BLOCK_K
    real = gl.load(table_ptr + 2 * num_tiles)
    it = 0
    for tile in range(gl.program_id(0), real * num_n, gl.num_programs(0)):
        expert, row0, pid_n = table_tile(tile, num_n, num_tiles, table_ptr)
        acc_g = gl.zeros([64, TN], gl.float32, mma)
        acc_u = gl.zeros([64, TN], gl.float32, mma)
        # Each K block's product (use_acc=False): created per tile, so it is not live across the epilogue.
        part = gl.zeros([64, TN], gl.float32, mma)
        for kb in range(kb_count):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s).slice(ROW0, 64)
            part = warpgroup_mma(a, b1_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
            sa = as_bufs.index(s).slice(ROW0, 64).load(rows_layout)
            s1 = sa * bs_bufs.index(s).slice(0, 1).load(rows_layout)
            s3 = sa * bs_bufs.index(s).slice(1, 1).load(rows_layout)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            acc_g = acc_g + part * s1[:, None]
            part = warpgroup_mma(a, b3_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            mbarrier.arrive(empty.index(s), count=1)
            acc_u = acc_u + part * s3[:, None]
            it += 1
        end = gl.load(offsets_ptr + expert + 1)
        _epilogue(acc_g, acc_u, h_ptr, aq_ptr, as_out_ptr, row0 + ROW0, end, pid_n, F, POW2, store_layout)


@gluon.jit
def _worker(a_desc, b1_desc, b3_desc, h_ptr, aq_ptr, as_out_ptr, as_ptr, w1s_ptr, w3s_ptr, offsets_ptr, table_ptr,
            a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs, ready, empty, num_tiles, NR, F, K, SA_R, SA_K,
            POW2: gl.constexpr, ROLE: gl.constexpr):
    # Worker partitions share one signature: ROLE 0 loads, ROLE 1 is the second consumer warpgroup.
    if ROLE == 0:
        grouped_producer(a_desc, b1_desc, as_ptr, w1s_ptr, table_ptr, a_bufs, b1_bufs, as_bufs, bs_bufs, ready, empty,
                         num_tiles, NR, F, K, SA_R, SA_K, b3_desc, w3s_ptr, b3_bufs)
    else:
        _consumer(h_ptr, aq_ptr, as_out_ptr, offsets_ptr, table_ptr, a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs,
                  ready, empty, num_tiles, F, K, POW2, 1)


@gluon.jit
def _fp8_gate_up_ws_kernel(a_desc, b1_desc, b3_desc, h_ptr, aq_ptr, as_out_ptr, as_ptr, w1s_ptr, w3s_ptr, offsets_ptr,
                           table_ptr, num_tiles, NR, F, K, SA_R, SA_K, STAGES: gl.constexpr, POW2: gl.constexpr):
    # One ring with w1's tiles in its B slots and room for the two block scales; w3's tiles beside it.
    a_bufs, b1_bufs, as_bufs, bs_bufs, ready, empty = allocate_ring(a_desc, b1_desc, STAGES, 4)
    b3_bufs = gl.allocate_shared_memory(b1_desc.dtype, [STAGES] + b1_desc.block_type.shape, b1_desc.layout)
    gl.warp_specialize([
        (_consumer, (h_ptr, aq_ptr, as_out_ptr, offsets_ptr, table_ptr, a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs,
                     ready, empty, num_tiles, F, K, POW2, 0)),
        (_worker, (a_desc, b1_desc, b3_desc, h_ptr, aq_ptr, as_out_ptr, as_ptr, w1s_ptr, w3s_ptr, offsets_ptr,
                   table_ptr, a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs, ready, empty, num_tiles, NR, F, K, SA_R,
                   SA_K, POW2, 0)),
        (_worker, (a_desc, b1_desc, b3_desc, h_ptr, aq_ptr, as_out_ptr, as_ptr, w1s_ptr, w3s_ptr, offsets_ptr,
                   table_ptr, a_bufs, b1_bufs, b3_bufs, as_bufs, bs_bufs, ready, empty, num_tiles, NR, F, K, SA_R,
                   SA_K, POW2, 1)),
    ], [1, 4], [PRODUCER_REGS, CONSUMER_REGS])


def gate_up_supported(D: int, F: int, out_dtype: torch.dtype) -> bool:
    """Whether :func:`fp8_gate_up_swiglu_ws` takes these sizes: TMA rows of e4m3 (D bytes) 16-byte
    aligned, F in whole 128-column tiles (one A scale block per tile), bf16 H."""
    return D % 16 == 0 and F % TILE == 0 and out_dtype == torch.bfloat16


def fp8_gate_up_swiglu_ws(a_q: torch.Tensor, a_s: torch.Tensor, w1_q: torch.Tensor, w1_s: torch.Tensor,
                          w3_q: torch.Tensor, w3_s: torch.Tensor, offsets_E1: torch.Tensor,
                          out_dtype: torch.dtype = torch.bfloat16, tiles: torch.Tensor | None = None,
                          pow2_scales: bool = False, *, stages: int = STAGES):
    """Gate/up with the SwiGLU and A-quantization epilogue (sm_90 GPU) over expert-sorted e4m3 rows
    ``a_q`` (Nr, D) with 1 x 128 scales ``a_s`` (Nr, ceil(D/128)); w1_q, w3_q (E, F, D) e4m3 with
    128 x 128 block scales (E, F/128, ceil(D/128)). ``tiles``: ``tile_table(offsets_E1, Nr, 128)``
    (built when None). Returns (H (Nr, 2F), (A_q (Nr, F) e4m3, A_s (Nr, F/128) fp32)), as
    :func:`kernels.fp8.grouped_gemm.fp8_gate_up_swiglu`; rows from offsets_E1[E] on are not written."""
    check_fp8(a_q, 2, "a_q")
    check_fp8(w1_q, 3, "w1_q")
    check_fp8(w3_q, 3, "w3_q")
    Nr, D = a_q.shape
    E, F, _ = w1_q.shape
    if tuple(w1_q.shape) != (E, F, D) or tuple(w3_q.shape) != (E, F, D):
        raise ValueError(f"w1_q {tuple(w1_q.shape)} and w3_q {tuple(w3_q.shape)} must both be (E, F, D = {D})")
    if not gate_up_supported(D, F, out_dtype):
        raise ValueError(f"fp8_gate_up_swiglu_ws needs D (={D}) a multiple of 16, F (={F}) a multiple of 128 and "
                         f"bf16 output (got {out_dtype}); kernels.fp8.grouped_gemm.fp8_gate_up_swiglu takes any")
    nkb = -(-D // TILE)
    check_scales(a_s, (Nr, nkb), "a_s")
    check_scales(w1_s, (E, F // TILE, nkb), "w1_s")
    check_scales(w3_s, (E, F // TILE, nkb), "w3_s")
    if offsets_E1.numel() != E + 1:
        raise ValueError(f"offsets_E1 has {offsets_E1.numel()} entries, expected E + 1 = {E + 1}")
    h = torch.empty((Nr, 2 * F), device=a_q.device, dtype=out_dtype)
    aq = torch.empty((Nr, F), device=a_q.device, dtype=torch.float8_e4m3fn)
    a_scales = torch.empty((Nr, F // TILE), device=a_q.device, dtype=torch.float32)
    n_tiles = max_tiles(Nr, E, GROUPED_BLOCK_M)
    if Nr == 0 or F == 0 or n_tiles == 0:
        return h, (aq, a_scales)
    tiles = checked_tile_table(tiles, offsets_E1, Nr, n_tiles)
    a_desc = descriptor(a_q, [GROUPED_BLOCK_M, TILE], gl.float8e4nv)
    b1_desc = descriptor(w1_q.view(E * F, D), [128, TILE], gl.float8e4nv)
    b3_desc = descriptor(w3_q.view(E * F, D), [128, TILE], gl.float8e4nv)
    sms = torch.cuda.get_device_properties(a_q.device).multi_processor_count
    programs = min(sms, n_tiles * (F // TILE))
    _fp8_gate_up_ws_kernel[(programs, )](a_desc, b1_desc, b3_desc, h, aq, a_scales, a_s, w1_s, w3_s, offsets_E1, tiles,
                                         n_tiles, Nr, F, D, *a_s.stride(), stages, pow2_scales, num_warps=4,
                                         maxnreg=MAXNREG)
    return h, (aq, a_scales)
