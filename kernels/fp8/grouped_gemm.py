"""FP8 (e4m3, block-scaled) grouped GEMMs over the expert-sorted rows of the MoE, with references.

Operands come from :mod:`kernels.fp8.blockwise`: A in 1 x 128 tiles along K, B (expert weights) in
128 x 128 blocks, the wgrad operands in 128 x 1 tiles along the token dim. The K loop steps one
scale block (128) at a time and applies the scales to the fp32 accumulator per step::

    acc += dot(a_fp8, b_fp8) * a_scale[:, None] * b_scale[None, :]

so each ``dot`` spans exactly one scale block. On Hopper this is also the accumulator promotion
DeepSeek-V3 prescribes: the FP8 tensor cores accumulate with ~14 mantissa bits, and summing each
128-long partial into fp32 registers bounds that error (Triton lowers each 128-K dot to a few
wgmma steps).

The schedule is the static tile table of :mod:`kernels.common.routing` (no host sync): a 1-D grid
of ``max_tiles * n_tiles`` programs, program -> (M-tile, N-tile), N-tile fastest; surplus tiles exit.

Ops:

- :func:`fp8_grouped_gemm`   out[r] = A[src(r)] @ B[e(r)]^T, src(r) = sorted_slot[r] // top_k when
                             gathering (gate/up input, dgrad of the down GEMM) or r (down, dgrad);
                             optionally stored to row slot(r) and scaled by a per-slot weight (the
                             down GEMM's combine epilogue, the dX GEMM's scatter).
- :func:`fp8_gate_up_swiglu` the gate/up GEMM with w1 and w3 and the SwiGLU epilogue of
                             ``kernels/moe/mega/forward.py``; optionally writes A quantized (1 x 128)
                             for the down GEMM.
- :func:`fp8_wgrad`          dW[e] = dY_e^T @ X_e over each expert's rows (K-grouped), operands
                             quantized along the token dim by :func:`blockwise.quantize_cols_grouped`
                             (one zero-filled 128-column block per tile: aligned, unmasked loads).

TMA (loads through host tensor descriptors) is used for the operands whose rows are contiguous
when both operands can take it: the down and dX GEMMs and the wgrad. Where A's rows are gathered
(gate/up, dA') both stay pointer loads: TMA weights beside gathered pointer loads were slower.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common.routing import max_tiles, tile_table
from kernels.common.triton_utils import cast_out, expert_tile, m_tile_rows, n_tile_cols
from kernels.fp8.blockwise import (
    FP8,
    TILE,
    dequantize_rowwise_ref,
    dequantize_weight_ref,
    group_tile_offsets,
    interpreting,
    quantize_tile,
    scale_from_amax,
    to_e4m3_bits,
)


def _block_sizes(block_m: int | None, block_n: int | None) -> tuple[int, int]:
    # GPU defaults: 64-row tiles were the fastest for all three GEMMs at the 30B shape. The scaled K
    # step keeps two fp32 tiles live per output (the running sum and the fresh dot), four in
    # gate/up. The interpreter gets small tiles so the tests' partial tiles are exercised and stay
    # fast.
    if interpreting():
        return block_m or 16, block_n or 64
    return block_m or 64, block_n or 128


def check_fp8(t: torch.Tensor, ndim: int, name: str) -> None:
    """Raise unless ``t`` is a contiguous ``ndim``-D e4m3 tensor."""
    if t.dtype != FP8:
        raise TypeError(f"{name}: expected torch.float8_e4m3fn, got {t.dtype}")
    if t.dim() != ndim or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {ndim}-D tensor, got shape {tuple(t.shape)}")


def check_scales(s: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """Raise unless ``s`` is a contiguous fp32 tensor of ``shape``."""
    if s.dtype != torch.float32 or tuple(s.shape) != shape or not s.is_contiguous():
        raise ValueError(f"{name}: expected contiguous fp32 scales of shape {shape}, got {s.dtype} {tuple(s.shape)}")


# --------------------------------------------------------------------------------------------------
# Forward / dgrad: M-tiled over expert-sorted rows
# --------------------------------------------------------------------------------------------------


@triton.jit
def _m_tile(table_ptr, offsets_ptr, num_tiles, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program -> (pid_m, pid_n, expert or -1 for a surplus tile, rows, row mask, safe rows): the
    M-tile (of the tile table) and N-tile it computes, N-tile fastest."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n, expert, rows, rmask, safe_rows = m_tile_rows(pid, num_n, table_ptr, offsets_ptr, num_tiles, BLOCK_M)
    return pid // num_n, pid_n, expert, rows, rmask, safe_rows


@triton.jit
def _n_tile(expert, pid_n, N, K, BLOCK_N: tl.constexpr):
    """(KB, NB, expert as int64, the tile's columns, the columns to load, the K offsets of a block):
    columns past N load a valid column (``% N``), dropped at the store."""
    KB = tl.cdiv(K, 128)
    NB = tl.cdiv(N, 128)
    e64 = expert.to(tl.int64)
    offs_n, offs_n_ld, offs_k = n_tile_cols(pid_n, N, BLOCK_N, 128)
    return KB, NB, e64, offs_n, offs_n_ld, offs_k


@triton.jit
def _b_scale_offset(e64, NB, KB, pid_n, offs_n_ld, BLOCK_N: tl.constexpr):
    """Offset of the tile's weight block scales for K block 0 in (E, NB, KB) scales: one per K block
    when the tile's 128 columns lie in one 128 x 128 block, else a (BLOCK_N,) vector."""
    if BLOCK_N == 128:
        return (e64 * NB + pid_n) * KB
    else:
        return (e64 * NB + offs_n_ld // 128) * KB


@triton.jit
def _a_rows(sorted_slot_ptr, rows, rmask, safe_rows, K_TOP, GATHER: tl.constexpr):
    """Source rows of A for GEMM rows ``rows``; rows past the expert's end read a valid row."""
    if GATHER:
        slot = tl.load(sorted_slot_ptr + rows, mask=rmask, other=0)
        src = slot // K_TOP
    else:
        src = safe_rows
    return src.to(tl.int64)


@triton.jit
def _load_a(a_ptrs, kb, K, offs_k, EVEN_K: tl.constexpr):
    """A's 128-wide K block kb, (BLOCK_M, 128) (pointers already at block kb)."""
    if EVEN_K:
        return tl.load(a_ptrs)
    else:
        return tl.load(a_ptrs, mask=(offs_k + kb * 128 < K)[None, :], other=0.0)


@triton.jit
def _load_b(b_ptrs, kb, K, offs_k, EVEN_K: tl.constexpr):
    """B's 128-deep K block kb, (128, BLOCK_N) (pointers already at block kb)."""
    if EVEN_K:
        return tl.load(b_ptrs)
    else:
        return tl.load(b_ptrs, mask=(offs_k + kb * 128 < K)[:, None], other=0.0)


@triton.jit
def _load_b_tma(b_ptrs, b_desc, b_row0, kb, K, offs_k, EVEN_K: tl.constexpr, TMA_B: tl.constexpr):
    """B's K block kb, (128, BLOCK_N): through the tensor descriptor of B viewed (E * N, K) (rows
    b_row0 onwards; TMA zero-fills past K and past the last expert) or through the pointers."""
    if TMA_B:
        return b_desc.load([b_row0, kb * 128]).T
    else:
        return _load_b(b_ptrs, kb, K, offs_k, EVEN_K)


@triton.jit
def _kscales(as_base, bs_base, kb, KB):
    """The scales of K block min(kb, KB - 1): A's (BLOCK_M,) row scales and B's block scale(s),
    a scalar or a (BLOCK_N,) vector depending on ``bs_base``. Clamped so that the prefetch past the
    last block reads a valid address."""
    k = tl.minimum(kb, KB - 1)
    return tl.load(as_base + k), tl.load(bs_base + k)


@triton.jit
def _promote(acc, d, sa, sb, SCALAR_B: tl.constexpr):
    """acc + d * sa[:, None] * sb[None, :]: one FMA per element when B's scale is one scalar for
    the tile (128-wide N tiles lie in one 128 x 128 weight block), else two multiplies and an add."""
    if SCALAR_B:
        return acc + d * (sa * sb)[:, None]
    else:
        return acc + d * sa[:, None] * sb[None, :]


# The promotion is the K loop's cost beyond the MMAs, so it is one FMA per element where B's scale
# is a scalar for the tile (128-wide N tiles). The scales are loaded one K block ahead, off the
# loop's critical path. A lagged promotion (block kb-1's product added after block kb's dot) was
# slower: Triton waits for each wgmma anyway.


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # (T or Nr, K) e4m3
    as_ptr,  # (T or Nr, KB) fp32
    b_ptr,  # (E, N, K) e4m3
    bs_ptr,  # (E, NB, KB) fp32
    out_ptr,  # (Nr, N)
    sorted_slot_ptr,  # (Nr,) int32 (read if GATHER)
    out_slot_ptr,  # (Nr,) int32: output row of each sorted row (read if SCATTER)
    slot_w_ptr,  # (Nr,) fp32 weight by output row (read if WEIGHTED)
    offsets_ptr,  # (E+1,) int32
    table_ptr,  # (2, num_tiles) int32
    a_desc,  # TensorDescriptor of A, block (BLOCK_M, 128) (if TMA_A)
    b_desc,  # TensorDescriptor of B viewed (E * N, K), block (BLOCK_N, 128) (if TMA_B)
    num_tiles,
    K_TOP,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    WEIGHTED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SOFT: tl.constexpr,
    TMA_A: tl.constexpr = False,
    TMA_B: tl.constexpr = False,
):
    pid_m, pid_n, expert, rows, rmask, safe_rows = _m_tile(table_ptr, offsets_ptr, num_tiles, N, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    src = _a_rows(sorted_slot_ptr, rows, rmask, safe_rows, K_TOP, GATHER)

    KB, NB, e64, offs_n, offs_n_ld, offs_k = _n_tile(expert, pid_n, N, K, BLOCK_N)
    a_ptrs = a_ptr + src[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + e64 * N * K + offs_n_ld.to(tl.int64)[None, :] * K + offs_k[:, None]  # (128, BN)
    as_base = as_ptr + src * KB
    bs_base = bs_ptr + _b_scale_offset(e64, NB, KB, pid_n, offs_n_ld, BLOCK_N)

    # TMA: the tile's rows from its first one (rows past the expert's end read the next expert's,
    # dropped at the store; past the last row, zeros), the weight rows of this expert and N-tile.
    row0 = tl.load(table_ptr + num_tiles + pid_m)
    b_row0 = expert * N + pid_n * BLOCK_N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sa, sb = _kscales(as_base, bs_base, 0, KB)
    for kb in range(0, KB):
        if TMA_A:
            a = a_desc.load([row0, kb * 128])
        else:
            a = _load_a(a_ptrs, kb, K, offs_k, EVEN_K)
        b = _load_b_tma(b_ptrs, b_desc, b_row0, kb, K, offs_k, EVEN_K, TMA_B)
        sa_next, sb_next = _kscales(as_base, bs_base, kb + 1, KB)
        acc = _promote(acc, tl.dot(a, b), sa, sb, BLOCK_N == 128)
        sa, sb = sa_next, sb_next
        a_ptrs += 128
        b_ptrs += 128

    if SCATTER:
        # Combine epilogue: each row goes straight to its (token, k) slot, scaled there in fp32
        # before the one rounding, so no N x N_out permute pass follows the GEMM.
        orow = tl.load(out_slot_ptr + rows, mask=rmask, other=0)
        if WEIGHTED:
            acc = acc * tl.load(slot_w_ptr + orow, mask=rmask, other=0.0)[:, None]
    else:
        orow = rows
    smask = rmask[:, None] & (offs_n < N)[None, :]
    out_ptrs = out_ptr + orow.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, cast_out(acc, out_ptr.dtype.element_ty, SOFT), mask=smask)


@triton.jit
def _fp8_gate_up_kernel(
    x_ptr,  # (T, D) e4m3
    xs_ptr,  # (T, DB) fp32
    w1_ptr,  # (E, F, D) e4m3
    w1s_ptr,  # (E, FB, DB) fp32
    w3_ptr,
    w3s_ptr,
    h_ptr,  # (Nr, 2F) out: [gate | up]
    a_ptr,  # (Nr, F) out: silu(gate) * up (if STORE_A)
    aq_ptr,  # (Nr, F) uint8 out: A in e4m3 (if QUANT_A)
    as_out_ptr,  # (Nr, FB) fp32 out (if QUANT_A)
    sorted_slot_ptr,
    offsets_ptr,
    table_ptr,
    num_tiles,
    K_TOP,
    D,
    F,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    STORE_A: tl.constexpr,
    QUANT_A: tl.constexpr,
    POW2: tl.constexpr,
    SOFT: tl.constexpr,
):
    pid_m, pid_n, expert, rows, rmask, safe_rows = _m_tile(table_ptr, offsets_ptr, num_tiles, F, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    src = _a_rows(sorted_slot_ptr, rows, rmask, safe_rows, K_TOP, True)

    DB, FB, e64, offs_n, offs_n_ld, offs_k = _n_tile(expert, pid_n, F, D, BLOCK_N)
    x_ptrs = x_ptr + src[:, None] * D + offs_k[None, :]
    w_off = e64 * F * D + offs_n_ld.to(tl.int64)[None, :] * D + offs_k[:, None]
    w1_ptrs = w1_ptr + w_off
    w3_ptrs = w3_ptr + w_off
    xs_base = xs_ptr + src * DB
    ws_off = _b_scale_offset(e64, FB, DB, pid_n, offs_n_ld, BLOCK_N)
    w1s_base = w1s_ptr + ws_off
    w3s_base = w3s_ptr + ws_off

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Scales loaded one K block ahead (see _promote's note).
    sx, s1 = _kscales(xs_base, w1s_base, 0, DB)
    s3 = tl.load(w3s_base)
    for kb in range(0, DB):
        x = _load_a(x_ptrs, kb, D, offs_k, EVEN_K)
        w1 = _load_b(w1_ptrs, kb, D, offs_k, EVEN_K)
        w3 = _load_b(w3_ptrs, kb, D, offs_k, EVEN_K)
        sx_next, s1_next = _kscales(xs_base, w1s_base, kb + 1, DB)
        s3_next = tl.load(w3s_base + tl.minimum(kb + 1, DB - 1))
        acc_g = _promote(acc_g, tl.dot(x, w1), sx, s1, BLOCK_N == 128)
        acc_u = _promote(acc_u, tl.dot(x, w3), sx, s3, BLOCK_N == 128)
        sx, s1, s3 = sx_next, s1_next, s3_next
        x_ptrs += 128
        w1_ptrs += 128
        w3_ptrs += 128

    dtype = h_ptr.dtype.element_ty
    gate = cast_out(acc_g, dtype, SOFT)
    up = cast_out(acc_u, dtype, SOFT)
    rows64 = rows.to(tl.int64)
    nmask = offs_n < F
    smask = rmask[:, None] & nmask[None, :]
    h_ptrs = h_ptr + rows64[:, None] * (2 * F) + offs_n[None, :]
    tl.store(h_ptrs, gate, mask=smask)
    tl.store(h_ptrs + F, up, mask=smask)
    # A from the rounded gate/up, as the bf16 kernel does (the backward recomputes it from H).
    g = gate.to(tl.float32)
    act = cast_out(g * tl.sigmoid(g) * up.to(tl.float32), dtype, SOFT)
    if STORE_A:
        tl.store(a_ptr + rows64[:, None] * F + offs_n[None, :], act, mask=smask)
    if QUANT_A:
        # BLOCK_N == 128: this tile's columns are exactly one 1 x 128 scale tile of A, so the down
        # GEMM's operand is produced here without another pass over A. Quantized from the stored
        # (rounded) A, so it equals quantize_1x128(A) bit for bit.
        af = tl.where(nmask[None, :], act.to(tl.float32), 0.0)
        s = scale_from_amax(tl.max(tl.abs(af), axis=1), POW2)
        q = to_e4m3_bits(quantize_tile(af, s[:, None]), SOFT)
        tl.store(aq_ptr + rows64[:, None] * F + offs_n[None, :], q, mask=smask)
        tl.store(as_out_ptr + rows64 * FB + pid_n, s, mask=rmask)


def _checked_tiles(tiles: torch.Tensor | None, offsets_E1: torch.Tensor, Nr: int, bm: int,
                   n_tiles: int) -> torch.Tensor:
    """The tile table for ``block_m = bm``: built when not given, else checked, since a table built
    for another block_m makes the kernel read rows past the end (a CUDA address fault, no message)."""
    if tiles is None:
        return tile_table(offsets_E1, Nr, bm)
    if tuple(tiles.shape) != (2, n_tiles):
        raise ValueError(f"tiles has shape {tuple(tiles.shape)}, but block_m = {bm} over {Nr} rows needs "
                         f"(2, {n_tiles}): build it with tile_table(offsets_E1, {Nr}, {bm}) or pass None")
    return tiles


def _tma_descriptor(t: torch.Tensor, rows: int, block_rows: int):
    """A TensorDescriptor of ``t`` viewed (rows, K) with (block_rows, 128) blocks, or None when TMA
    cannot address it (a row must be a multiple of 16 bytes, the base 16-byte aligned)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    K = t.shape[-1]
    if K % 16 or t.data_ptr() % 16 or not t.is_contiguous():
        return None
    return TensorDescriptor.from_tensor(t.view(rows, K), [block_rows, TILE])


def check_grouped_operands(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, sorted_slot_N=None, out_slot_N=None,
                           slot_weights_N=None) -> tuple[int, int, int, int]:
    """Validate the operands of an M-grouped GEMM (see :func:`fp8_grouped_gemm`); returns (E, N, K, Nr)."""
    check_fp8(a_q, 2, "a_q")
    check_fp8(b_q, 3, "b_q")
    E, N, K = b_q.shape
    if a_q.shape[1] != K:
        raise ValueError(f"a_q has K = {a_q.shape[1]}, b_q has K = {K}")
    check_scales(a_s, (a_q.shape[0], triton.cdiv(K, TILE)), "a_s")
    check_scales(b_s, (E, triton.cdiv(N, TILE), triton.cdiv(K, TILE)), "b_s")
    if offsets_E1.numel() != E + 1:
        raise ValueError(f"offsets_E1 has {offsets_E1.numel()} entries, expected E + 1 = {E + 1}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    Nr = sorted_slot_N.numel() if sorted_slot_N is not None else a_q.shape[0]
    if out_slot_N is not None and out_slot_N.numel() != Nr:
        raise ValueError(f"out_slot_N has {out_slot_N.numel()} entries, expected one per row ({Nr})")
    if slot_weights_N is not None:
        if out_slot_N is None:
            raise ValueError("slot_weights_N needs out_slot_N (the weights are indexed by output row)")
        if slot_weights_N.dtype != torch.float32 or slot_weights_N.numel() != Nr or not slot_weights_N.is_contiguous():
            raise ValueError(f"slot_weights_N: expected {Nr} contiguous fp32 weights, got {slot_weights_N.dtype} "
                             f"{tuple(slot_weights_N.shape)}")
    return E, N, K, Nr


def fp8_grouped_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    offsets_E1: torch.Tensor,
    sorted_slot_N: torch.Tensor | None = None,
    top_k: int = 1,
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    out_slot_N: torch.Tensor | None = None,
    slot_weights_N: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    tma: bool = True,
) -> torch.Tensor:
    """out[r] = dequant(A)[src(r)] @ dequant(B)[e(r)]^T for the expert-sorted rows r.

    Args:
        a_q: (T, K) e4m3 token rows (with ``sorted_slot_N``: row r reads token
            ``sorted_slot_N[r] // top_k``) or (Nr, K) e4m3 rows already in expert-sorted order.
        a_s: (a_q.shape[0], ceil(K/128)) fp32, 1 x 128 scales (:func:`blockwise.quantize_1x128`).
        b_q: (E, N, K) e4m3 per-expert weights, K contiguous (pass a dgrad weight as a
            contiguous copy of ``q.mT``: the bytes need no requantization).
        b_s: (E, ceil(N/128), ceil(K/128)) fp32 128 x 128 block scales (:func:`blockwise.quantize_weight`).
        offsets_E1: (E+1,) int32 expert row offsets (:func:`kernels.common.routing.sort_by_expert`).
        sorted_slot_N: (Nr,) int32 or None (no gather).
        tiles: optional tile table for ``block_m`` (:func:`kernels.common.routing.tile_table`).
        out_slot_N: (Nr,) int32 or None: row r is stored at output row ``out_slot_N[r]`` instead
            of r (the MoE combine: expert-sorted row -> its (token, k) slot).
        slot_weights_N: (Nr,) fp32 or None (needs ``out_slot_N``): output row j is scaled by
            ``slot_weights_N[j]`` in fp32 before the rounding to ``out_dtype`` (routing weights).
        num_warps, num_stages: launch parameters (num_stages None: 3 with TMA, 4 without, the
            faster depth of each); the interpreter uses 4 warps.
        tma: when A is not gathered, load A and B through TMA descriptors (False: pointer loads,
            which gathered rows always use); operands TMA cannot address fall back to pointer loads.
    Returns:
        (Nr, N) ``out_dtype`` (bf16 or fp32). Rows r >= offsets_E1[E] (empty slots; with
        ``out_slot_N`` their slots) are not written.
    """
    E, N, K, Nr = check_grouped_operands(a_q, a_s, b_q, b_s, offsets_E1, out_dtype, sorted_slot_N, out_slot_N,
                                         slot_weights_N)
    bm, bn = _block_sizes(block_m, block_n)
    out = torch.empty((Nr, N), device=a_q.device, dtype=out_dtype)
    n_tiles = max_tiles(Nr, E, bm)
    if Nr == 0 or N == 0 or K == 0 or n_tiles == 0:
        return out.zero_() if K == 0 else out
    tiles = _checked_tiles(tiles, offsets_E1, Nr, bm, n_tiles)
    use_tma = tma and sorted_slot_N is None
    a_desc = _tma_descriptor(a_q, a_q.shape[0], bm) if use_tma else None
    b_desc = _tma_descriptor(b_q, E * N, bn) if use_tma else None
    if num_stages is None:
        num_stages = 3 if b_desc is not None else 4
    _fp8_gemm_kernel[(n_tiles * triton.cdiv(N, bn),)](
        a_q, a_s, b_q, b_s, out, sorted_slot_N if sorted_slot_N is not None else offsets_E1,
        out_slot_N if out_slot_N is not None else offsets_E1,
        slot_weights_N if slot_weights_N is not None else a_s,
        offsets_E1, tiles, a_desc, b_desc, n_tiles, top_k, N, K,
        BLOCK_M=bm, BLOCK_N=bn, GATHER=sorted_slot_N is not None, SCATTER=out_slot_N is not None,
        WEIGHTED=slot_weights_N is not None, EVEN_K=K % TILE == 0, SOFT=interpreting(),
        TMA_A=a_desc is not None, TMA_B=b_desc is not None,
        num_warps=num_warps if not interpreting() else 4, num_stages=num_stages,
    )  # fmt: skip
    return out


def fp8_gate_up_swiglu(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w1_q: torch.Tensor,
    w1_s: torch.Tensor,
    w3_q: torch.Tensor,
    w3_s: torch.Tensor,
    sorted_slot_N: torch.Tensor,
    offsets_E1: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype = torch.bfloat16,
    quantize_a: bool = False,
    pow2_scales: bool = False,
    tiles: torch.Tensor | None = None,
    block_m: int | None = None,
    store_a: bool = True,
    num_warps: int = 8,
    num_stages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """FP8 gathered gate/up GEMM with the SwiGLU epilogue (FP8 twin of ``forward.gate_up``).

    Args:
        x_q, x_s: (T, D) e4m3 token rows and (T, ceil(D/128)) fp32 scales.
        w1_q, w3_q: (E, F, D) e4m3; w1_s, w3_s: (E, ceil(F/128), ceil(D/128)) fp32.
        sorted_slot_N, offsets_E1, top_k: routing (row r reads token sorted_slot_N[r] // top_k).
        quantize_a: also write A quantized in 1 x 128 tiles (the down GEMM's operand); uses
            BLOCK_N = 128 so each N-tile is one scale tile.
        store_a: write A in ``out_dtype`` (False with ``quantize_a``: the FP8 MoE needs only A's
            quantized copy, and skipping the N x F store saves its bytes).
        num_warps, num_stages: launch parameters (8 warps: two accumulators); the interpreter
            uses 4 warps. x's rows are gathered, so every load is a pointer load.
    Returns:
        h_N2F: (Nr, 2F) [gate | up] in ``out_dtype``; a_NF: (Nr, F) silu(gate) * up in ``out_dtype``
        (None unless store_a); (a_q (Nr, F) e4m3, a_s (Nr, ceil(F/128)) fp32) if quantize_a else None.
        Rows r >= offsets_E1[E] are not written.
    """
    check_fp8(x_q, 2, "x_q")
    check_fp8(w1_q, 3, "w1_q")
    check_fp8(w3_q, 3, "w3_q")
    T, D = x_q.shape
    E, F, _ = w1_q.shape
    if w1_q.shape != (E, F, D) or w3_q.shape != (E, F, D):
        raise ValueError(f"w1/w3 must be (E, F, D) with D = {D}: {tuple(w1_q.shape)}, {tuple(w3_q.shape)}")
    check_scales(x_s, (T, triton.cdiv(D, TILE)), "x_s")
    for s, name in ((w1_s, "w1_s"), (w3_s, "w3_s")):
        check_scales(s, (E, triton.cdiv(F, TILE), triton.cdiv(D, TILE)), name)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    if not (store_a or quantize_a):
        raise ValueError("fp8_gate_up_swiglu: store_a=False needs quantize_a=True (A must go somewhere)")
    Nr = sorted_slot_N.numel()
    bm, bn = _block_sizes(block_m, 128 if quantize_a else None)
    dev = x_q.device
    h = torch.empty((Nr, 2 * F), device=dev, dtype=out_dtype)
    a = torch.empty((Nr, F), device=dev, dtype=out_dtype) if store_a else None
    aq = torch.empty((Nr, F), device=dev, dtype=FP8) if quantize_a else None
    a_s = torch.empty((Nr, triton.cdiv(F, TILE)), device=dev, dtype=torch.float32) if quantize_a else None
    n_tiles = max_tiles(Nr, E, bm)
    if Nr == 0 or F == 0 or n_tiles == 0:
        return h, a, (aq, a_s) if quantize_a else None
    tiles = _checked_tiles(tiles, offsets_E1, Nr, bm, n_tiles)
    _fp8_gate_up_kernel[(n_tiles * triton.cdiv(F, bn),)](
        x_q, x_s, w1_q, w1_s, w3_q, w3_s, h, a if store_a else h,
        aq.view(torch.uint8) if quantize_a else h, a_s if quantize_a else h,
        sorted_slot_N, offsets_E1, tiles, n_tiles, top_k, D, F,
        BLOCK_M=bm, BLOCK_N=bn, EVEN_K=D % TILE == 0, STORE_A=store_a, QUANT_A=quantize_a, POW2=pow2_scales,
        SOFT=interpreting(), num_warps=num_warps if not interpreting() else 4, num_stages=num_stages,
    )  # fmt: skip
    return h, a, (aq, a_s) if quantize_a else None


# --------------------------------------------------------------------------------------------------
# Wgrad: K-grouped over each expert's rows
# --------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_wgrad_kernel(
    at_ptr,  # (M, LD) e4m3: dY^T, token dim contiguous
    ats_ptr,  # (M, num_tiles) fp32, strides (SA_R, SA_T)
    bt_ptr,  # (Ncol, LD) e4m3: X^T
    bts_ptr,  # (Ncol, num_tiles) fp32, strides (SB_R, SB_T)
    out_ptr,  # (E, M, Ncol)
    offsets_ptr,  # (E+1,) int32 row offsets
    tile_offsets_ptr,  # (E+1,) int32 offsets of each expert's 128-row tiles
    at_desc,  # TensorDescriptor of at (M, LD), block (BLOCK_M, 128) (if TMA)
    bt_desc,  # TensorDescriptor of bt (Ncol, LD), block (BLOCK_N, 128)
    num_tiles,
    LD,  # row stride of at/bt: num_tiles * 128
    M,
    NCOL,
    SA_R,
    SA_T,
    SB_R,
    SB_T,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFT: tl.constexpr,
    TMA: tl.constexpr = False,
):
    expert, offs_m, offs_n, _, _ = expert_tile(tl.program_id(0), M, NCOL, offsets_ptr, BLOCK_M, BLOCK_N)
    t0 = tl.load(tile_offsets_ptr + expert)
    t1 = tl.load(tile_offsets_ptr + expert + 1)
    offs_m_ld = (offs_m % M).to(tl.int64)
    offs_n_ld = (offs_n % NCOL).to(tl.int64)
    offs_r = tl.arange(0, 128)
    m0 = (tl.program_id(0) % (tl.cdiv(M, BLOCK_M) * tl.cdiv(NCOL, BLOCK_N))) // tl.cdiv(NCOL, BLOCK_N) * BLOCK_M
    n0 = (tl.program_id(0) % tl.cdiv(NCOL, BLOCK_N)) * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One 128-row tile of the expert per step: the scale block of both operands. An expert with
    # no rows runs no step and stores zeros. Scales prefetched one step ahead (see _promote's
    # note); the first load is clamped to a valid tile for an expert with none.
    t_first = tl.minimum(t0, tl.maximum(num_tiles - 1, 0))
    sa = tl.load(ats_ptr + offs_m_ld * SA_R + t_first * SA_T)
    sb = tl.load(bts_ptr + offs_n_ld * SB_R + t_first * SB_T)
    for t in range(t0, t1):
        if TMA:
            # Through descriptors: rows past M / Ncol read zeros (dropped).
            a = at_desc.load([m0, t * 128])
            b = bt_desc.load([n0, t * 128]).T
        else:
            # Tile t owns columns [128 t, 128 t + 128), zero past the expert's rows: no mask, and
            # the columns are known 128-aligned and contiguous, so the loads are vectorized
            # (LD = num_tiles * 128 is a multiple of 16, which Triton's specialization sees).
            cols = tl.max_contiguous(tl.multiple_of(t * 128 + offs_r, 128), 128)
            a = tl.load(at_ptr + offs_m_ld[:, None] * LD + cols[None, :])
            b = tl.load(bt_ptr + offs_n_ld[None, :] * LD + cols[:, None])
        t_next = tl.minimum(t + 1, t1 - 1)
        sa_next = tl.load(ats_ptr + offs_m_ld * SA_R + t_next * SA_T)
        sb_next = tl.load(bts_ptr + offs_n_ld * SB_R + t_next * SB_T)
        acc = _promote(acc, tl.dot(a, b), sa, sb, False)
        sa, sb = sa_next, sb_next

    out_off = expert.to(tl.int64) * M * NCOL + offs_m.to(tl.int64)[:, None] * NCOL + offs_n[None, :]
    omask = (offs_m < M)[:, None] & (offs_n < NCOL)[None, :]
    tl.store(out_ptr + out_off, cast_out(acc, out_ptr.dtype.element_ty, SOFT), mask=omask)


def check_wgrad_operands(at_q, at_s, bt_q, bt_s, offsets_E1, out_dtype) -> tuple[int, int, int, int]:
    """Validate the wgrad operands (see :func:`fp8_wgrad`); returns (M, Ncol, E, n_tiles)."""
    check_fp8(at_q, 2, "at_q")
    check_fp8(bt_q, 2, "bt_q")
    M, ld = at_q.shape
    NCOL = bt_q.shape[0]
    if bt_q.shape[1] != ld:
        raise ValueError(f"at_q and bt_q must have the same rows (dim 1): {ld} vs {bt_q.shape[1]}")
    E = offsets_E1.numel() - 1
    n_tiles = at_s.shape[-1] if at_s.dim() == 2 else -1
    if n_tiles < E or ld != n_tiles * TILE:
        raise ValueError(
            f"fp8_wgrad expects at_q (M, n_tiles * 128) with at_s (M, n_tiles), n_tiles >= E = {E} "
            f"(quantize_cols_grouped); got at_q {tuple(at_q.shape)}, at_s {tuple(at_s.shape)}"
        )
    for name, st, rows in (("at_s", at_s, M), ("bt_s", bt_s, NCOL)):
        # Any strides: quantize_cols_grouped's are tile-major (1, K); a row slice keeps them.
        if st.dtype != torch.float32 or tuple(st.shape) != (rows, n_tiles):
            raise ValueError(f"{name}: expected fp32 scales of shape {(rows, n_tiles)}, got {st.dtype} "
                             f"{tuple(st.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    return M, NCOL, E, n_tiles


def fp8_wgrad(
    at_q: torch.Tensor,
    at_s: torch.Tensor,
    bt_q: torch.Tensor,
    bt_s: torch.Tensor,
    offsets_E1: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    tma: bool = True,
) -> torch.Tensor:
    """dW[e] = dY_e^T @ X_e, the sum over expert e's rows, from token-dim-quantized operands.

    Args:
        at_q, at_s: (M, n_tiles * 128) e4m3 and (M, n_tiles) fp32, n_tiles = Nr // 128 + E: dY's
            expert-sorted rows quantized in 128 x 1 tiles and stored transposed, tile i at columns
            [128 i, 128 i + 128), zero filled past its rows (:func:`blockwise.quantize_cols_grouped`
            of dY (Nr, M)). The loads are then aligned and unmasked (vectorized).
        bt_q, bt_s: (Ncol, n_tiles * 128) e4m3 and (Ncol, n_tiles) fp32: the same for X (Nr or
            gathered T rows, Ncol). Both must come from the same offsets_E1 (same 128-row tiles).
        offsets_E1: (E+1,) int32.
        num_warps, num_stages: launch parameters (the interpreter uses 4 warps); num_stages None:
            3 with TMA, 4 without, the faster depth of each.
        tma: load both operands through TMA descriptors (False: pointer loads, also the fallback
            for operands TMA cannot address).
    Returns:
        (E, M, Ncol) ``out_dtype``; zeros for an expert with no rows.
    """
    M, NCOL, E, n_tiles = check_wgrad_operands(at_q, at_s, bt_q, bt_s, offsets_E1, out_dtype)
    ld = at_q.shape[1]
    bm, bn = _block_sizes(block_m, block_n)
    if interpreting() and block_m is None:
        bm = 64
    out = torch.empty((E, M, NCOL), device=at_q.device, dtype=out_dtype)
    if out.numel() == 0:
        return out
    tile_offs = group_tile_offsets(offsets_E1)
    at_desc = _tma_descriptor(at_q, M, bm) if tma else None
    bt_desc = _tma_descriptor(bt_q, NCOL, bn) if tma else None
    if num_stages is None:
        num_stages = 3 if at_desc is not None and bt_desc is not None else 4
    _fp8_wgrad_kernel[(E * triton.cdiv(M, bm) * triton.cdiv(NCOL, bn),)](
        at_q, at_s, bt_q, bt_s, out, offsets_E1, tile_offs, at_desc, bt_desc, n_tiles, ld, M, NCOL,
        *at_s.stride(), *bt_s.stride(), BLOCK_M=bm, BLOCK_N=bn, SOFT=interpreting(),
        TMA=at_desc is not None and bt_desc is not None,
        num_warps=num_warps if not interpreting() else 4, num_stages=num_stages,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------
# References (float64 from the dequantized operands; host loops over experts, tests only)
# --------------------------------------------------------------------------------------------------


def fp8_grouped_gemm_ref(a_q, a_s, b_q, b_s, offsets_E1, sorted_slot_N=None, top_k=1, out_slot_N=None,
                         slot_weights_N=None) -> torch.Tensor:
    """float64 (Nr, N) reference of :func:`fp8_grouped_gemm`; rows r >= offsets_E1[E] (with
    ``out_slot_N``: their slots) are zero."""
    a = dequantize_rowwise_ref(a_q, a_s, torch.float64)
    b = dequantize_weight_ref(b_q, b_s, torch.float64)
    if sorted_slot_N is not None:
        a = a[sorted_slot_N.long() // top_k]
    out = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float64, device=a.device)
    offs = offsets_E1.tolist()
    for e in range(b.shape[0]):
        out[offs[e] : offs[e + 1]] = a[offs[e] : offs[e + 1]] @ b[e].t()
    if out_slot_N is not None:
        if slot_weights_N is not None:
            # Only covered rows are scaled: an empty slot's weight may be anything, NaN included.
            w = torch.where(torch.arange(out.shape[0], device=out.device) < offs[-1],
                            slot_weights_N.double()[out_slot_N.long()], 0.0)
            out = out * w[:, None]
        out = torch.zeros_like(out).index_copy(0, out_slot_N.long(), out)
    return out


def fp8_gate_up_swiglu_ref(x_q, x_s, w1_q, w1_s, w3_q, w3_s, sorted_slot_N, offsets_E1, top_k):
    """float64 (gate, up, silu(gate) * up), each (Nr, F), of :func:`fp8_gate_up_swiglu`."""
    g = fp8_grouped_gemm_ref(x_q, x_s, w1_q, w1_s, offsets_E1, sorted_slot_N, top_k)
    u = fp8_grouped_gemm_ref(x_q, x_s, w3_q, w3_s, offsets_E1, sorted_slot_N, top_k)
    return g, u, torch.nn.functional.silu(g) * u


def cols_grouped_dequant_ref(qt: torch.Tensor, st: torch.Tensor, offsets_E1: torch.Tensor) -> torch.Tensor:
    """(offsets_E1[E], K) float64 rows back from a :func:`blockwise.quantize_cols_grouped` pair
    (qt (K, n_tiles * 128), st (K, n_tiles)). The padding is not read: a GEMM that relies on it
    being zero is checked against this."""
    K = qt.shape[0]
    offs = offsets_E1.tolist()
    out = torch.zeros((offs[-1], K), dtype=torch.float64, device=qt.device)
    tile = 0
    for e in range(len(offs) - 1):
        for r0 in range(offs[e], offs[e + 1], TILE):
            r1 = min(r0 + TILE, offs[e + 1])
            c0 = tile * TILE
            out[r0:r1] = (qt[:, c0 : c0 + r1 - r0].double() * st[:, tile : tile + 1].double()).t()
            tile += 1
    return out


def fp8_wgrad_ref(at_q, at_s, bt_q, bt_s, offsets_E1) -> torch.Tensor:
    """float64 (E, M, Ncol) reference of :func:`fp8_wgrad`."""
    dy = cols_grouped_dequant_ref(at_q, at_s, offsets_E1)
    x = cols_grouped_dequant_ref(bt_q, bt_s, offsets_E1)
    offs = offsets_E1.tolist()
    E = len(offs) - 1
    out = torch.zeros((E, dy.shape[1], x.shape[1]), dtype=torch.float64, device=dy.device)
    for e in range(E):
        out[e] = dy[offs[e] : offs[e + 1]].t() @ x[offs[e] : offs[e + 1]]
    return out
